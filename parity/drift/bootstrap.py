"""A percentile bootstrap interval of a ratio of two sums over sequences, resampled whole (Poisson(1)
counts): the advisor's correction figures and the gold forward's error ratio both use it."""

from __future__ import annotations

import math

import numpy as np


def bootstrap_ratio(numerator: np.ndarray, denominator: np.ndarray, resamples: int, seed: int,
                    confidence: float, *, empty: float) -> tuple[np.ndarray, np.ndarray]:
    """Percentile interval `(low [C], high [C])` of Σ_s q_s x_s / Σ_s q_s d_s over Poisson(1) resample
    counts q `[resamples, S]`: a ratio of two sums over sequences (numerator `[S, C]`, denominator
    `[S]`), sequences resampled whole. A resample whose sums are both 0 (it drew nothing, or nothing
    but zeros) counts as `empty`; a positive sum over 0 as inf. `resamples` <= 0: NaNs."""
    cols = numerator.shape[1]
    if resamples <= 0:
        return np.full(cols, math.nan), np.full(cols, math.nan)
    q = np.random.default_rng(seed).poisson(1.0, (resamples, denominator.size)).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        stats = (q @ numerator) / (q @ denominator)[:, None]
    stats[np.isnan(stats)] = empty
    tail = 100.0 * (1.0 - confidence) / 2.0
    low, high = np.percentile(stats, [tail, 100.0 - tail], axis=0)
    return low, high
