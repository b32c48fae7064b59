"""A `ParityReport` from rollouts and the training side's logprobs of their tokens: arrays, drift
summary, breakdowns, correction metrics, tolerance verdict, gold figures and the advisor's
section. Metrics come from the stored float32 arrays, so a report loaded from JSON recomputes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from parity.advisor import SECTION as ADVICE_SECTION
from parity.advisor import SUMMARY_KEY as RECOMMENDATION_KEY
from parity.advisor import advise
from parity.assess.accuracy import BY_POSITION, gold_by_position, gold_summary, gold_tokens
from parity.core.errors import InputError
from parity.core.logprobs import above_bound, first_above_bound
from parity.core.schema import UNMEASURED_SEQUENCE_KEYS
from parity.core.turns import after_injection, turn_index
from parity.core.types import Rollout
from parity.correction.config import DEFAULT_OPTIONS, CorrectionConfig
from parity.drift.tolerance import Tolerance
from parity.report.document import ParityReport

#: rollout correction applied for `ParityReport.metrics`: verl's token-level truncated IS at 2.0
#: (the one a monitored step's `rollout_corr/*` metrics use too).
DEFAULT_CORRECTION: dict[str, Any] = DEFAULT_OPTIONS


def build_report(rollouts: Sequence[Rollout], train_logprobs: Sequence[np.ndarray], *,
                 tolerance: Tolerance, provenance: dict[str, Any] | None = None,
                 correction: dict[str, Any] | None = None,
                 extras: dict[str, Any] | None = None,
                 gold_logprobs: Sequence[np.ndarray] | None = None) -> ParityReport:
    """A `ParityReport` from rollouts and the training forward's logprobs of their tokens.

    train_logprobs[i], gold_logprobs[i]: `[len(rollouts[i].token_ids)]`; gold (or None) adds the
    `GOLD_SUMMARY_KEYS` and per-side error by position. Tokens -inf on either side are counted in
    `num_tokens_outside_support` and left out of every other metric; rollouts with no measured token
    are counted in `UNMEASURED_SEQUENCE_KEYS` (`num_sequences` leaves them out). A counted logprob above
    `MAX_LOGPROB` (probabilities or logits passed) is an InputError.
    """
    # torch: `import parity` stays light
    from parity.correction.apply import CorrectionPass
    from parity.drift.metrics import (
        drift_by_position,
        drift_by_probability,
        drift_by_turn,
        summarize,
        token_arrays,
    )

    if len(train_logprobs) != len(rollouts):
        raise InputError(f"{len(train_logprobs)} train logprob arrays for {len(rollouts)} rollouts; "
                         "give one per rollout")
    if gold_logprobs is not None and len(gold_logprobs) != len(rollouts):
        raise InputError(f"{len(gold_logprobs)} gold logprob arrays for {len(rollouts)} rollouts; "
                         "give one per rollout")
    rows = len(rollouts)
    width = max((len(r.token_ids) for r in rollouts), default=0)
    train = np.zeros((rows, width), np.float32)
    rollout = np.zeros((rows, width), np.float32)
    mask = np.zeros((rows, width), bool)
    positions = np.zeros((rows, width), np.int64)
    token_ids = np.zeros((rows, width), np.int64)
    gold = None if gold_logprobs is None else np.zeros((rows, width), np.float64)
    for i, (ro, lp) in enumerate(zip(rollouts, train_logprobs)):
        n = len(ro.token_ids)
        lp = np.asarray(lp, dtype=np.float32).ravel()
        if lp.shape[0] != n:
            raise InputError(f"rollout {ro.request_id!r}/{ro.sample_index} has {n} tokens but "
                             f"{lp.shape[0]} train logprobs")
        train[i, :n] = lp
        rollout[i, :n] = ro.logprobs
        mask[i, :n] = ro.mask  # generated tokens only: injected turns of a trajectory are 0
        positions[i, :n] = len(ro.prompt_ids) + np.arange(n)
        token_ids[i, :n] = ro.token_ids
        if gold is not None:
            g = np.asarray(gold_logprobs[i], dtype=np.float64).ravel()
            if g.shape[0] != n:
                raise InputError(f"rollout {ro.request_id!r}/{ro.sample_index} has {n} tokens but "
                                 f"{g.shape[0]} gold logprobs")
            gold[i, :n] = g
    for side, values in (("train_logprobs", train), ("rollout_logprobs", rollout)):
        _check_bound(values, mask, side, rollouts)
    # A token one side gives logprob -inf lies outside that side's sampling support (e.g. the
    # trainer's top-p nucleus excludes a token the backend sampled: bf16 drift moved it across
    # the boundary). Its ratio is 0 or inf, so it is counted on its own and kept out of the
    # finite metrics, which it would turn infinite; worst_tokens still lists it first.
    outside = mask & (np.isneginf(train) | np.isneginf(rollout))
    scored = mask & ~outside
    if mask.any() and not scored.any():
        raise InputError(f"every token ({int(mask.sum())}) is outside the sampling support (-inf) of the "
                         "trainer or the rollout: no token is left to measure; check that both sides used "
                         "the same sampling (temperature, top-k, top-p, logprobs mode) and the same tokens")
    finite_train, finite_rollout = np.where(scored, train, 0.0), np.where(scored, rollout, 0.0)
    tok = token_arrays(finite_train, finite_rollout, scored)  # checked once, read by every metric below
    summary = dict(summarize(tok))
    summary["num_tokens_outside_support"] = int(outside.sum())
    summary["frac_tokens_outside_support"] = float(outside.sum() / max(int(mask.sum()), 1))
    # rows num_sequences leaves out, counted so the sequences add up to the rollouts given
    generated = mask.any(axis=1)
    summary.update(zip(UNMEASURED_SEQUENCE_KEYS, (int((~generated).sum()),
                                                  int((generated & ~scored.any(axis=1)).sum()))))
    breakdowns = {"by_position": drift_by_position(tok), "by_probability": drift_by_probability(tok)}
    if any(r.response_mask is not None for r in rollouts):
        breakdowns.update(drift_by_turn(tok, turns=_padded([turn_index(r.mask) for r in rollouts], width, -1),
                                        after_injection=_padded([after_injection(r.mask) for r in rollouts],
                                                                width, False)))
    if gold is not None:
        keep = gold_tokens(train, rollout, gold, mask)  # checked once, read by both gold figures
        if keep.any():
            summary.update(gold_summary(train, rollout, gold, mask, keep=keep))
            breakdowns[BY_POSITION] = gold_by_position(train, rollout, gold, mask, keep=keep)
    # the metrics alone, from `tok` as checked above (the bound searched once, with the rollout named)
    corr = CorrectionPass(CorrectionConfig(**(correction or DEFAULT_CORRECTION)), tok, outputs=False)
    tok.scan(corr)
    metrics = corr.result()[2]
    violations = tolerance.violations(summary)
    sequences = [{"request_id": r.request_id, "sample_index": r.sample_index, "prompt_len": len(r.prompt_ids),
                  "response_len": len(r.token_ids), "finish_reason": r.finish_reason} for r in rollouts]
    report = ParityReport(
        train_logprobs=train, rollout_logprobs=rollout, mask=mask, positions=positions, token_ids=token_ids,
        sequences=sequences, summary=summary, metrics=dict(metrics), breakdowns=breakdowns,
        passed=not violations, tolerance=tolerance, violations=violations,
        provenance=dict(provenance or {}), extras=dict(extras or {}), gold_logprobs=gold,
    )
    if scored.any():
        attach_advice(report)
    return report


def attach_advice(report: ParityReport) -> None:
    """Advise on `report`'s tokens: the section goes to `extras["advice"]`, the recommendation's
    name to `summary["recommended_correction"]` (what nightly rows carry and compare)."""
    advice = advise(report)
    report.extras[ADVICE_SECTION] = advice.to_dict()
    report.summary[RECOMMENDATION_KEY] = advice.name


def _check_bound(values: np.ndarray, mask: np.ndarray, side: str, rollouts: Sequence[Rollout]) -> None:
    """InputError naming `side[row, col]` and its rollout for the first counted (`mask`) value of
    `values` `[rollouts, tokens]` above `MAX_LOGPROB` (`first_above_bound`), or NaN: a NaN where the
    other side gives -inf would otherwise be counted as a token outside the support, with no word."""
    index = first_above_bound(values, mask)
    if index is None:
        hit = np.isnan(values) & mask
        if not hit.any():
            return
        r, c = (int(i) for i in np.argwhere(hit)[0])
    else:
        r, c = index
    ro = rollouts[r]
    where = f"{side}[{r}, {c}] (rollout {ro.request_id!r}/{ro.sample_index}, token {c})"
    if index is not None:
        raise above_bound(values[r, c], where)
    raise InputError(f"{side} contains NaN or +inf: {where} is nan at a counted token; log-probabilities "
                     "must be finite and <= 0 (-inf: outside the sampling support); check the side that "
                     "computed it (an overflow in float16/bfloat16?)")


def _padded(rows: list[list[Any]], width: int, fill: Any) -> np.ndarray:
    """Right-padded `[len(rows), width]` array of per-token values."""
    return np.array([list(r) + [fill] * (width - len(r)) for r in rows]).reshape(len(rows), width)
