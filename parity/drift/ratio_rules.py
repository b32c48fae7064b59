"""The elementwise formulas of rollout correction, written once for torch tensors and NumPy arrays.

`parity.correction` (torch, verl-exact) and `parity.advisor` (NumPy, a grid of configurations:
bounds `[configs]` broadcast against `[tokens, 1]`) share these; each returns its input's kind.
No torch import: the advisor and report rendering stay torch-free.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import numpy as np

#: verl's bound on |log ratio| before exponentiating (rollout_corr_helper.SAFETY_BOUND).
SAFETY_BOUND = 20.0

#: The per-token KL estimators rejection sampling tests, verl's names.
ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def namespace(x: Any) -> ModuleType:
    """`torch` for a torch tensor (already imported by whoever made it), else `numpy`."""
    if type(x).__module__.partition(".")[0] == "torch":
        return sys.modules["torch"]
    return np


def clamp_log_ratio(log_ratio: Any) -> Any:
    """Δ = logp_train - logp_rollout clamped to ±`SAFETY_BOUND`, verl's guard before any exp."""
    return log_ratio.clip(-SAFETY_BOUND, SAFETY_BOUND)


def ratio(clamped_log_ratio: Any) -> Any:
    """The importance ratio π_train / π_rollout = exp(Δ) of an already clamped Δ."""
    return namespace(clamped_log_ratio).exp(clamped_log_ratio)


def token_statistic(estimator: str, clamped_log_ratio: Any) -> Any:
    """Per-token KL(π_rollout || π_train) estimator at Δ clamped to ±20: k1 = -Δ, k2 = Δ²/2,
    k3 = exp(Δ) - 1 - Δ (verl's rejection statistics; the summary's `k3_kl` is this k3's mean, while
    verl's `rollout_corr/k3_kl` metric takes Δ unclamped and exceeds it where |Δ| > 20).
    """
    c = clamped_log_ratio
    if estimator == "k1":
        return -c
    if estimator == "k2":
        return 0.5 * (c * c)
    # verl's exp(Δ) - 1 - Δ, not expm1(Δ) - Δ: thresholds must cut exactly where verl's do.
    return namespace(c).exp(c) - 1.0 - c


def in_band(x: Any, lower: Any, upper: Any) -> Any:
    """Where `lower <= x <= upper` (bool; `lower` None: no lower bound): rejection, IcePop and
    seq-mask-TIS bands alike.
    """
    ok = x <= upper
    if lower is not None:
        ok = ok & (x >= lower)
    return ok


def band_weights(ratios: Any, lower: Any, upper: Any) -> Any:
    """IcePop: the ratio inside [lower, upper], 0 outside."""
    return namespace(ratios).where(in_band(ratios, lower, upper), ratios, 0.0)


def truncate(ratios: Any, upper: Any, lower: Any = None, out: Any = None) -> Any:
    """Truncated IS (TIS): ratios clamped to <= upper, and to >= lower when given (into `out`
    when given)."""
    return namespace(ratios).clip(ratios, lower, upper, out=out)


def sequence_log_ratio(row_sum: Any, row_count: Any, level: str) -> Any:
    """A sequence's log ratio from its Σ_t Δ_t: the sum ("sequence") or the per-token mean
    ("geometric", `row_count` valid tokens)."""
    return row_sum / row_count if level == "geometric" else row_sum
