"""verl-compatible rollout correction: importance-sampling weights, rejection masks and metrics.

`rollout_correction` reproduces verl 0.9.x `compute_rollout_correction_and_rejection_mask`:
option names, semantics, `rollout_corr/*` keys, values to 1e-6 relative
(tests/test_correction.py, vectors from verl). Kept on purpose: Δ clamped to ±20 before `exp`
(not in `k3_kl`); verl's `masked_mean` (empty rows count in sequence means); k1 thresholds as
ratio bounds (`u` means `[1/u, u]`), k2/k3 as upper bounds; a numeric `rollout_is_threshold`
truncates (TIS), `"lower_upper"` zeroes outside the band (IcePop). Differs: `ConfigError` /
`InputError` instead of verl's exceptions, no silent skip of IS without a threshold, ESS 0.0
when every weight is 0 and exact (no +1e-8, which makes verl's exceed 1) when the mean weight is
below 1e-4, half-precision weights computed in float32 and refused rather than returned inf.
Extras: "geometric", "seq_mask_tis", `rollout_is_clamp_lower`.
"""

from typing import Any

from parity.correction.config import (
    IS_LEVELS,
    RS_OPTIONS,
    VERL_IS_LEVELS,
    CorrectionConfig,
    ImportanceRule,
    RejectionRule,
    correction_from_name,
)

__all__ = ["EPS", "IS_LEVELS", "RS_OPTIONS", "VERL_IS_LEVELS", "CorrectionConfig", "ImportanceRule",
           "RejectionRule", "apply_correction", "correction_from_name", "rollout_correction"]

#: names whose modules load torch: imported on first use, so the options (`config`) stay light
#: for the advisor and for parsing a case.
_LAZY = {"apply_correction": "parity.correction.apply", "rollout_correction": "parity.correction.apply",
         "EPS": "parity.correction.stats"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib  # only on first use of a lazy name: `import parity.correction` stays NumPy-only

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'parity.correction' has no attribute {name!r}")
