"""A percentile bootstrap interval of a ratio of two sums over sequences, resampled whole (Poisson(1)
counts): the advisor's correction figures and the gold forward's error ratio both use it."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

#: resample counts drawn at once, at most (256 MiB as float64, as much again while NumPy's integer
#: draws are converted): up to it every resample is drawn and summed in one product, as always;
#: beyond (200 resamples of 1M sequences held 3.2 GB at once), in chunks of whole resamples.
MAX_DRAWS = 1 << 25


def resample_chunks(resamples: int, width: int) -> Iterator[int]:
    """Resamples per chunk, in order, for `resamples` draws of `width` counts each: one chunk of all
    while resamples x width <= `MAX_DRAWS`. A generator continues its stream from chunk to chunk, so
    the counts are the same bit for bit; only BLAS's summation blocking, which already varies with
    its build and threads, may round the sums of a chunked batch differently (~1e-16 relative)."""
    rows = max(1, MAX_DRAWS // max(width, 1))
    for start in range(0, resamples, rows):
        yield min(rows, resamples - start)


def bootstrap_ratio(numerator: np.ndarray, denominator: np.ndarray, resamples: int, seed: int,
                    confidence: float, *, empty: float | None) -> tuple[np.ndarray, np.ndarray]:
    """Percentile interval `(low [C], high [C])` of Σ_s q_s x_s / Σ_s q_s d_s over Poisson(1) counts q
    `[resamples, S]` (numerator `[S, C]`, denominator `[S]`; whole sequences resampled). A resample
    with both sums 0 counts as `empty`, or is dropped when `empty` is None (no evidence must not pull
    the interval); positive over 0 is inf. No resamples left, or fewer than two sequences to weigh (one
    resampled is itself, an interval [r, r] of no width; with `empty` None, those of a non-zero sum): NaNs.
    """
    cols = numerator.shape[1]
    # the sequences a resample can weigh: all where an empty one counts as `empty`, else those with a sum
    evidence = denominator.size if empty is not None else int(((denominator != 0)
                                                              | (numerator != 0).any(axis=1)).sum())
    if resamples <= 0 or evidence < 2:
        return np.full(cols, math.nan), np.full(cols, math.nan)
    rng, parts = np.random.default_rng(seed), []
    for rows in resample_chunks(resamples, denominator.size):
        q = rng.poisson(1.0, (rows, denominator.size)).astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            parts.append((q @ numerator) / (q @ denominator)[:, None])
    stats = parts[0] if len(parts) == 1 else np.concatenate(parts)
    tail = 100.0 * (1.0 - confidence) / 2.0
    if empty is not None:
        stats[np.isnan(stats)] = empty
        return _percentiles(stats, tail)
    low, high = np.full(cols, math.nan), np.full(cols, math.nan)
    for c in range(cols):
        kept = stats[~np.isnan(stats[:, c]), c:c + 1]
        if kept.size:
            (low[c],), (high[c],) = _percentiles(kept, tail)
    return low, high


def _percentiles(stats: np.ndarray, tail: float) -> tuple[np.ndarray, np.ndarray]:
    """The `tail` and 100 - `tail` percentiles per column of `stats` `[resamples, C]`, inf kept
    (interpolating next to inf would give inf - inf = NaN, so inf stands in as the largest float).
    """
    inf = np.isposinf(stats)
    low, high = np.percentile(np.where(inf, np.finfo(np.float64).max, stats), [tail, 100.0 - tail], axis=0)
    largest = np.where(inf, -np.inf, stats).max(axis=0)
    return np.where(low > largest, math.inf, low), np.where(high > largest, math.inf, high)
