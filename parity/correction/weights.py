"""Importance-sampling weights: per block, the weights and the per-row statistics their metrics need."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from parity.correction.config import ImportanceRule
from parity.correction.stats import EPS, Rows, fraction, seq_summary
from parity.drift.ratio_rules import (
    SAFETY_BOUND,
    band_weights,
    clamp_log_ratio,
    in_band,
    sequence_log_ratio,
    truncate,
)
from parity.drift.ratio_rules import ratio as ratio_of
from parity.drift.token_arrays import Block, masked_row_min, row_counts

#: mean (clamped) weight below which the ESS drops verl's +1e-8 (there it inflates the ESS by > 2e-4).
ESS_EXACT_BELOW = 1e-4


@dataclass(frozen=True)
class SequenceWeightRows:
    """Per-row `[batch]` sequence-level weight statistics: seq_log (Σ Δ, or mean for "geometric"), raw
    exp(clamp(seq_log, ±20)), and weight after truncation, clamp or band.
    """

    seq_log: torch.Tensor
    raw: torch.Tensor
    weight: torch.Tensor


@dataclass(frozen=True)
class TokenWeightRows:
    """Per-row `[batch]` token-level weight statistics: weight_sum/max/min (max needs no mask: weights
    are >= 0, 0 at padding), raw_sum, high, low, clamped_sum, clamped_sq, seq_keep (seq_mask_tis),
    outside (IcePop).
    """

    weight_sum: torch.Tensor
    weight_max: torch.Tensor
    weight_min: torch.Tensor
    raw_sum: torch.Tensor
    high: torch.Tensor
    low: torch.Tensor
    clamped_sum: torch.Tensor
    clamped_sq: torch.Tensor
    seq_keep: torch.Tensor | None = None
    outside: torch.Tensor | None = None


WeightRows = SequenceWeightRows | TokenWeightRows


def block_weights(rule: ImportanceRule, b: Block, row_count: torch.Tensor) -> tuple[torch.Tensor, WeightRows]:
    """IS weights of one block `[rows, seq]` (0 at padding) and their per-row statistics, from
    its ratios `b.ratio`; row_count: row lengths, EPS for empty rows.
    """
    upper, band_lower = rule.upper, rule.band_lower
    if rule.sequence_level:
        seq_log = sequence_log_ratio(b.row_log_ratio_sum, row_count, rule.level)
        raw = ratio_of(clamp_log_ratio(seq_log))
        if band_lower is not None:
            weight = band_weights(raw, band_lower, upper)
        else:
            weight = truncate(raw, upper, rule.clamp_lower)
        return weight[:, None] * b.maskf, SequenceWeightRows(seq_log, raw, weight)

    mask, ratio = b.mask, b.ratio
    seq_keep = outside = None
    if rule.level == "seq_mask_tis":
        geo_log = sequence_log_ratio(b.row_log_ratio_sum, row_count, "geometric")
        seq_keep = in_band(geo_log, math.log(band_lower), math.log(upper))
        weights = ratio * seq_keep[:, None]
    elif band_lower is not None:
        weights = band_weights(ratio, band_lower, upper)
        outside = (~in_band(ratio, band_lower, upper) & mask).sum(-1, dtype=torch.float64)
    elif rule.clamp_lower is not None:
        weights = truncate(ratio, upper, rule.clamp_lower) * b.maskf
    else:
        weights = truncate(ratio, upper, out=b.buffer())
    # every rule but seq-mask-TIS leaves the weights in [0, upper] already: no second clamp, and
    # their clamped sum is their sum
    clamped = weights.clamp(0.0, upper) if rule.level == "seq_mask_tis" else weights
    weight_sum = weights.sum(-1)
    stats = TokenWeightRows(
        weight_sum=weight_sum,
        weight_max=weights.amax(-1),
        weight_min=weights.amin(-1) if b.dense else masked_row_min(weights, mask),
        raw_sum=ratio.sum(-1),
        # ratio is 0 at padding and upper > 0, so `ratio > upper` needs no mask; `<` does.
        high=row_counts(ratio, above=upper),
        low=row_counts(ratio, below=rule.metric_lower, mask=None if b.dense else mask),
        clamped_sum=weight_sum if clamped is weights else clamped.sum(-1),
        clamped_sq=torch.square(clamped, out=b.buffer()).sum(-1),
        seq_keep=seq_keep,
        outside=outside,
    )
    return weights, stats


def weight_metrics(rule: ImportanceRule, w: WeightRows, r: Rows) -> dict[str, float]:
    """verl's `rollout_is_*` metrics (before batch normalization) from per-row statistics."""
    upper, lower = rule.upper, rule.metric_lower
    m: dict[str, float] = {}
    if isinstance(w, SequenceWeightRows):
        m["rollout_is_max"] = math.exp(min(float(w.seq_log.max()), SAFETY_BOUND))
        m["rollout_is_min"] = math.exp(float(w.seq_log.min()))
        m["rollout_is_mean"] = r.weighted_mean(w.weight)
        # Over all rows, empty ones included (their Σ Δ is 0), as verl does.
        m["rollout_is_ratio_fraction_high"] = fraction(w.seq_log > math.log(upper))
        m["rollout_is_ratio_fraction_low"] = fraction(w.seq_log < math.log(lower))
        clamped = w.weight.clamp(0.0, upper)
        wc_sum = float((clamped * r.lengths).sum())
        wc_sq = float((clamped.square() * r.lengths).sum())
        seq_mean_w = w.weight * r.lengths / r.row_count
        raw_seq_mean = w.raw * r.lengths / r.row_count
        if rule.band_lower is not None:
            outside = (w.raw < rule.band_lower) | (w.raw > upper)
            m["rollout_is_oob_ratio"] = r.weighted_mean(outside.double())
    else:
        m["rollout_is_mean"] = r.token_mean(w.weight_sum)
        m["rollout_is_ratio_fraction_high"] = r.token_mean(w.high)
        m["rollout_is_ratio_fraction_low"] = r.token_mean(w.low)
        m["rollout_is_max"] = float(w.weight_max.max())
        m["rollout_is_min"] = float(w.weight_min.min())
        wc_sum, wc_sq = float(w.clamped_sum.sum()), float(w.clamped_sq.sum())
        seq_mean_w = w.weight_sum / r.row_count
        raw_seq_mean = w.raw_sum / r.row_count
        if w.seq_keep is not None:
            m["rollout_is_seq_masked_fraction"] = r.valid_fraction(~w.seq_keep)
        elif w.outside is not None:
            m["rollout_is_oob_ratio"] = r.token_mean(w.outside)
    m["rollout_is_std"] = r.std(wc_sum, wc_sq)
    # Effective sample size 1 / E[(w / (E[w] + 1e-8))²] of the weights clamped to upper, as verl. Its
    # 1e-8 inflates the ESS by (1 + 1e-8 / E[w])²: noise for weights ~1, but ESS > 1 (34 at sequence
    # weights ~2e-9) for tiny ones; below E[w] = `ESS_EXACT_BELOW` parity reports the exact
    # E[w]² / E[w²]. verl divides by zero when every weight is 0 (IcePop rejecting all): parity 0.
    mean_c = wc_sum / r.total
    if wc_sq <= 0:
        m["rollout_is_eff_sample_size"] = 0.0
    elif mean_c < ESS_EXACT_BELOW:
        m["rollout_is_eff_sample_size"] = mean_c * mean_c * r.total / wc_sq
    else:
        m["rollout_is_eff_sample_size"] = (mean_c + EPS) ** 2 * r.total / wc_sq
    m.update(seq_summary("rollout_is", seq_mean_w))
    m["rollout_is_seq_max_deviation"] = float((seq_mean_w - 1.0).abs().max())
    # Raw (pre-truncation) per-sequence means: a mean of truncated weights never exceeds upper.
    # Over all rows: an empty row's mean is 0, so it counts as "low", as in verl.
    m["rollout_is_seq_fraction_high"] = fraction(raw_seq_mean > upper)
    m["rollout_is_seq_fraction_low"] = fraction(raw_seq_mean < lower)
    return m


def batch_norm_factor(w: WeightRows, r: Rows) -> float:
    """verl's batch-normalization divisor: mean weight over tokens (token levels) or over
    non-empty sequences (sequence levels)."""
    if isinstance(w, TokenWeightRows):
        return r.token_mean(w.weight_sum)
    per_seq = w.weight * r.lengths / r.row_count
    return float((per_seq * r.row_valid).sum()) / max(float(r.row_valid.sum()), EPS)
