"""The numbers: per-token arrays, drift metrics, quantiles, ratio rules, tolerances, router agreement
and the bootstrap interval. NumPy only."""
