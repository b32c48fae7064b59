"""Rejection sampling (`rollout_rs`): per block, the keep mask and the per-row statistics of each rule."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from parity.correction.config import RejectionRule
from parity.correction.stats import Rows, fraction, seq_summary
from parity.drift.ratio_rules import in_band, token_statistic
from parity.drift.token_arrays import Block, masked_row_max, masked_row_min


@dataclass(frozen=True)
class TokenRuleRows:
    """Per-row statistics `[batch]` of one "token_k*" rule: total, max, min (±inf when empty), high,
    low (k1 only), clamped_sum, clamped_sq, rejected.
    """

    total: torch.Tensor
    max: torch.Tensor
    min: torch.Tensor
    high: torch.Tensor
    clamped_sum: torch.Tensor
    clamped_sq: torch.Tensor
    rejected: torch.Tensor
    low: torch.Tensor | None = None


@dataclass(frozen=True)
class SequenceRuleRows:
    """The tested value `[batch]` of one sequence-level rule ("seq_sum_*", "seq_mean_*", "seq_max_*")."""

    value: torch.Tensor


RuleRows = TokenRuleRows | SequenceRuleRows


@dataclass(frozen=True)
class RejectionRows:
    """Per-row statistics of every rule, in the config's order, and the tokens rejected by any
    rule per row `[batch]`."""

    rules: tuple[RuleRows, ...]
    rejected: torch.Tensor


def keeps(rule: RejectionRule, x: torch.Tensor) -> torch.Tensor:
    """Where statistic `x` passes `rule` (bool, same shape)."""
    return in_band(x, rule.lower, rule.upper)


def block_keep(rules: Sequence[RejectionRule], b: Block, row_count: torch.Tensor
               ) -> tuple[torch.Tensor, RejectionRows]:
    """The keep mask of one block `[rows, seq]` (False at padding) and its per-row statistics,
    from its clamped log ratios `b.clamped`; row_count: row lengths, EPS for empty rows.
    """
    mask, maskf = b.mask, b.maskf
    statistics: dict[str, torch.Tensor] = {}
    keep_tokens = mask.clone()
    keep_rows = torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)
    per_rule: list[RuleRows] = []
    for rule in rules:
        if rule.estimator not in statistics:
            statistics[rule.estimator] = token_statistic(rule.estimator, b.clamped)  # 0 at padding
        stat = statistics[rule.estimator]
        if rule.reduce == "token":
            ok = keeps(rule, stat)
            low_clamp = rule.lower if rule.lower is not None else 0.0
            clamped_stat = stat.clamp(low_clamp, rule.upper) * maskf
            per_rule.append(TokenRuleRows(
                total=stat.sum(-1),
                max=masked_row_max(stat, mask),
                min=masked_row_min(stat, mask),
                high=((stat > rule.upper) & mask).sum(-1, dtype=torch.float64),
                clamped_sum=clamped_stat.sum(-1),
                clamped_sq=clamped_stat.square().sum(-1),
                rejected=(~ok & mask).sum(-1, dtype=torch.float64),
                low=None if rule.lower is None else ((stat < rule.lower) & mask).sum(-1, dtype=torch.float64),
            ))
            keep_tokens &= ok
        else:
            if rule.reduce == "sum":
                value = stat.sum(-1)
            elif rule.reduce == "mean":
                value = stat.sum(-1) / row_count
            else:  # "max"; verl reports 0 for an empty row
                value = masked_row_max(stat, mask)
                value = torch.where(torch.isneginf(value), 0.0, value)
            per_rule.append(SequenceRuleRows(value))
            keep_rows &= keeps(rule, value)
    keep = keep_tokens & keep_rows[:, None]
    return keep, RejectionRows(tuple(per_rule), (mask & ~keep).sum(-1, dtype=torch.float64))


def rejection_metrics(rules: Sequence[RejectionRule], rs: RejectionRows, r: Rows) -> dict[str, float]:
    """verl's `rollout_rs_*` metrics from per-row statistics."""
    m: dict[str, float] = {}
    for rule, s in zip(rules, rs.rules):
        p = f"rollout_rs_{rule.option}"
        k1 = rule.lower is not None
        if isinstance(s, TokenRuleRows):
            seq_values = (s.total / r.row_count)[r.row_valid]
            m[f"{p}_mean"] = r.token_mean(s.total)
            m[f"{p}_max"] = float(s.max.max())
            m[f"{p}_min"] = float(s.min.min())
            m[f"{p}_fraction_high"] = r.token_mean(s.high)
            m[f"{p}_fraction_low"] = r.token_mean(s.low) if k1 else 0.0
            m[f"{p}_std"] = r.std(float(s.clamped_sum.sum()), float(s.clamped_sq.sum()))
            rejected_tokens = float(s.rejected.sum())
            rejected_rows = s.rejected > 0
        else:
            seq_values = s.value[r.row_valid]
            clamped = s.value.clamp(rule.lower if k1 else 0.0, rule.upper)
            m[f"{p}_mean"] = r.weighted_mean(s.value)
            m[f"{p}_max"] = float(seq_values.max())
            m[f"{p}_min"] = float(seq_values.min())
            m[f"{p}_fraction_high"] = fraction(seq_values > rule.upper)
            m[f"{p}_fraction_low"] = fraction(seq_values < rule.lower) if k1 else 0.0
            m[f"{p}_std"] = r.std(
                float((clamped * r.lengths).sum()), float((clamped.square() * r.lengths).sum())
            )
            rejected_rows = ~keeps(rule, s.value)
            rejected_tokens = float((rejected_rows * r.lengths).sum())
        m.update(seq_summary(p, seq_values))
        m[f"{p}_seq_max_deviation"] = float(seq_values.abs().max())
        m[f"{p}_seq_fraction_high"] = fraction(seq_values > rule.upper)
        if k1:
            m[f"{p}_seq_fraction_low"] = fraction(seq_values < rule.lower)
        m[f"{p}_masked_fraction"] = rejected_tokens / r.total
        m[f"{p}_seq_masked_fraction"] = r.valid_fraction(rejected_rows)
    m["rollout_rs_masked_fraction"] = r.token_mean(rs.rejected)
    # Over all rows, empty ones included, as verl does.
    m["rollout_rs_seq_masked_fraction"] = fraction(rs.rejected > 0)
    return m
