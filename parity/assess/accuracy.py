"""Which side moved: each side's distance from the gold forward, their ratio and a one-sentence verdict.

Per token, |logp_train - logp_gold| and |logp_rollout - logp_gold| (`parity.engine.gold`); the
ratio of their means (`gold/rollout_to_train_error_ratio`) is > 1 when the rollout engine is the
less accurate side, with a 95% bootstrap interval over whole sequences. Tokens outside any side's
support (-inf) are left out and counted apart.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from parity.core.errors import InputError
from parity.core.logprobs import MAX_LOGPROB, above_bound, check_logprob_array
from parity.core.schema import json_safe
from parity.drift.bootstrap import bootstrap_ratio

#: resamples of the sequences for the ratio's interval (the advisor's default).
BOOTSTRAP = 200
#: `ParityReport.breakdowns` key of the per-position gold errors.
BY_POSITION = "gold_by_position"


def gold_tokens(train: np.ndarray, rollout: np.ndarray, gold: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """bool `[batch, seq]`: the real tokens to which all three sides give a finite logprob (the tokens
    every gold figure counts). InputError for a mask other than 0/1, at a real token holding NaN or
    +inf on any side, or a gold value above `MAX_LOGPROB`: only -inf (outside a sampling support) is
    left out and counted."""
    train, rollout, gold, mask = (np.asarray(a) for a in (train, rollout, gold, mask))
    if not train.shape == rollout.shape == gold.shape == mask.shape or train.ndim != 2:
        raise InputError(f"gold: train {train.shape}, rollout {rollout.shape}, gold {gold.shape} and mask "
                         f"{mask.shape} must be 2-D [batch, seq] arrays of one shape")
    if mask.dtype != bool and not np.isin(mask, (0, 1)).all():  # 0.5 or 2 would count as a whole token
        raise InputError("gold: mask must be bool or hold only 0 and 1 (1 = the token counts)")
    real = mask.astype(bool)
    for name, side in (("train", train), ("rollout", rollout), ("gold", gold)):
        with np.errstate(invalid="ignore"):
            bad = real & (np.isnan(side) | np.isposinf(side))
        if bad.any():
            row, col = (int(i) for i in np.argwhere(bad)[0])
            raise InputError(f"gold: {name} logprob[{row}, {col}] is {side[row, col]}; a logprob is a "
                             "number <= 0 (-inf for a token outside the sampling support)")
    check_logprob_array(gold, real, "gold: gold logprob")
    return real & np.isfinite(train) & np.isfinite(rollout) & np.isfinite(gold)


def gold_summary(train: np.ndarray, rollout: np.ndarray, gold: np.ndarray, mask: np.ndarray, *,
                 bootstrap: int = BOOTSTRAP, seed: int = 0, keep: np.ndarray | None = None) -> dict[str, Any]:
    """The `GOLD_SUMMARY_KEYS`, in order, of `[batch, seq]` logprobs (nats) and a mask.

    Max / mean |train - gold| and |rollout - gold|; their mean ratio (1.0 when both 0, inf when only
    train is) with a 95% Poisson bootstrap over sequences (NaNs when no resample is left, or one
    sequence alone is measured: its resamples are itself, an interval of no width); a verdict
    sentence; tokens counted and left out (-inf). Non-finite values are spelled as `json_safe` does.
    A counted train or rollout value above `MAX_LOGPROB` is an InputError naming its side. keep: these
    arrays' `gold_tokens`, when the caller has it already (checked and computed once).
    """
    keep = gold_tokens(train, rollout, gold, mask) if keep is None else keep
    g = np.where(keep, np.asarray(gold, np.float64), 0.0)
    kept_train, kept_rollout = (_kept(values, keep, f"gold: {side} logprob")
                                for side, values in (("train", train), ("rollout", rollout)))
    train_err = np.abs(kept_train - g)
    rollout_err = np.abs(kept_rollout - g)
    n = int(keep.sum())
    if n == 0:
        raise InputError("gold: no token has a finite logprob on all three sides; nothing to measure")
    rows = keep.any(axis=1)
    train_seq, rollout_seq = train_err.sum(axis=1)[rows], rollout_err.sum(axis=1)[rows]
    ratio = _ratio(float(rollout_seq.sum()), float(train_seq.sum()))
    if bootstrap > 0:  # NaNs from one sequence alone: resampled, it is itself (`bootstrap_ratio`)
        low, high = (float(v[0]) for v in bootstrap_ratio(rollout_seq[:, None], train_seq, bootstrap, seed,
                                                          0.95, empty=None))
    else:
        low = high = float("nan")
    # the logprobs themselves: equal errors alone (train and rollout mirrored about the gold) are not
    # identical logprobs
    identical = bool(np.array_equal(kept_train, kept_rollout))
    mean_train, mean_rollout = float(train_err.sum() / n), float(rollout_err.sum() / n)
    return {
        "gold/train_max_abs_logprob_diff": float(train_err.max()),
        "gold/train_mean_abs_logprob_diff": mean_train,
        "gold/rollout_max_abs_logprob_diff": float(rollout_err.max()),
        "gold/rollout_mean_abs_logprob_diff": mean_rollout,
        "gold/rollout_to_train_error_ratio": json_safe(ratio),
        "gold/rollout_to_train_error_ratio_ci95": json_safe([low, high]),
        "gold/verdict": verdict(ratio, low, high, identical=identical, train_error=mean_train,
                                rollout_error=mean_rollout),
        "gold/num_tokens": n,
        "gold/num_tokens_outside_support": int(np.asarray(mask, bool).sum()) - n,
    }


def _kept(values: np.ndarray, keep: np.ndarray, name: str) -> np.ndarray:
    """float64 `values` where `keep`, else 0; InputError naming `name[row, col]` of the first kept value
    above `MAX_LOGPROB` (one max of the array the figures read: the others are 0)."""
    kept = np.where(keep, np.asarray(values, np.float64), 0.0)
    if kept.size and kept.max() > MAX_LOGPROB:
        row, col = np.unravel_index(int(np.argmax(kept > MAX_LOGPROB)), kept.shape)
        raise above_bound(np.asarray(values)[row, col], f"{name}[{row}, {col}]")
    return kept


def _ratio(rollout_error: float, train_error: float) -> float:
    if train_error == 0.0:
        return 1.0 if rollout_error == 0.0 else float("inf")
    return rollout_error / train_error


def verdict(ratio: float, low: float, high: float, *, identical: bool = False,
            train_error: float | None = None, rollout_error: float | None = None) -> str:
    """The sentence a person reads: which side is farther from the gold, by how much, and whether the
    interval says so (an interval that holds 1 reads "equally far"). A side that matches the gold
    exactly (ratio 0 or inf) is said in words, with the other side's mean error (nats) when given."""
    if identical:
        return "the rollout and the trainer are equally far from the gold: their logprobs are identical"
    if ratio == 0.0:
        off = "" if train_error is None else f" (mean error {train_error:.3g} nats)"
        return f"the rollout matches the gold exactly; the trainer is farther{off}"
    if ratio == float("inf"):
        off = "" if rollout_error is None else f" (mean error {rollout_error:.3g} nats)"
        return f"the trainer matches the gold exactly; the rollout is farther{off}"
    interval = "" if low != low else f" (95% interval {low:.3g}-{high:.3g})"  # NaN: no interval
    if (low != low and ratio == 1.0) or low <= 1.0 <= high:
        return f"the rollout and the trainer are equally far from the gold within noise: error ratio " \
               f"{ratio:.3g}{interval}"
    if ratio > 1.0:
        return f"the rollout is {ratio:.3g}x farther from the gold than the trainer{interval}"
    inverse = "" if low != low else f" (95% interval {_inverse(high):.3g}-{_inverse(low):.3g})"
    return f"the trainer is {1.0 / ratio:.3g}x farther from the gold than the rollout{inverse}"


def _inverse(value: float) -> float:
    """1 / value, inf for 0 (an interval end at ratio 0: the rollout exact in those resamples)."""
    return float("inf") if value == 0.0 else 1.0 / value


def gold_by_position(train: np.ndarray, rollout: np.ndarray, gold: np.ndarray, mask: np.ndarray, *,
                     keep: np.ndarray | None = None) -> dict[str, list[dict[str, Any]]]:
    """Each side's error from the gold per response-position bucket
    (`parity.drift.metrics.drift_by_position`'s buckets and fields, with the gold as the other side):
    {"train": [...], "rollout": [...]}. A counted train or rollout value above `MAX_LOGPROB` is an
    InputError naming its side. keep: as `gold_summary`'s."""
    from parity.drift.metrics import drift_by_position, token_arrays  # torch: `import parity` stays light

    keep = gold_tokens(train, rollout, gold, mask) if keep is None else keep
    g = np.where(keep, np.asarray(gold, np.float64), 0.0)
    out = {}
    for side, values in (("train", train), ("rollout", rollout)):
        check_logprob_array(np.asarray(values), keep, f"gold: {side} logprob")
        # checked here and by `gold_tokens`: a `TokenArrays` is not searched again
        tok = token_arrays(np.where(keep, np.asarray(values, np.float64), 0.0), g, keep)
        out[side] = drift_by_position(tok)
    return out
