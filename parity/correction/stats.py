"""Per-row statistics and the batch reductions verl applies to them: each block leaves typed
`[rows]` statistics, `join` concatenates them, and every metric reduces them through `Rows`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, TypeVar

import torch

from parity.drift.ratio_rules import SAFETY_BOUND
from parity.drift.token_arrays import Block

#: verl's epsilon in `masked_mean` (`sum / (count + 1e-8)`), ESS and batch normalization.
EPS = 1e-8

T = TypeVar("T")


def join(parts: Sequence[T]) -> T:
    """Per-block statistics joined in block order (tensors concatenated; tuples and dataclasses by element).
    """
    first: Any = parts[0]
    if first is None:
        return None  # type: ignore[return-value]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)  # type: ignore[return-value]
    if isinstance(first, tuple):
        return tuple(join(column) for column in zip(*parts))  # type: ignore[return-value]
    return dataclasses.replace(
        first, **{f.name: join([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(first)})


@dataclass(frozen=True)
class Rows:
    """The batch's rows and verl's batch-level reductions over per-row statistics.

    verl's masked_mean divides by `mask.sum() + 1e-8` in float32, where the epsilon rounds away for
    any count >= 1 and only turns 0/0 into 0; `token_mean` and `row_count` do exactly that (1e-8 in
    float64 would turn a constant statistic's zero std into ~1e-4/sqrt(count) of its value).
    """

    lengths: torch.Tensor
    total: float

    @cached_property
    def row_valid(self) -> torch.Tensor:
        """Rows with at least one valid token `[batch]` (bool)."""
        return self.lengths > 0

    @cached_property
    def row_count(self) -> torch.Tensor:
        """Row lengths with EPS for empty rows: divides a row sum into verl's row mean."""
        return torch.where(self.row_valid, self.lengths, EPS)

    def token_mean(self, row_sums: torch.Tensor) -> float:
        """verl's batch `masked_mean` of a per-token quantity, from its row sums `[batch]`."""
        return float(row_sums.sum()) / self.total

    def weighted_mean(self, per_row: torch.Tensor) -> float:
        """Token mean of a quantity constant within each row (one value per row)."""
        return float((per_row * self.lengths).sum()) / self.total

    def std(self, first: float, second: float) -> float:
        """verl's std from token sums of x and x²: sqrt(max(E[x²] - E[x]², 0)); 0 for one token."""
        if self.total <= 1:
            return 0.0
        mean = first / self.total
        return math.sqrt(max(second / self.total - mean * mean, 0.0))

    def valid_fraction(self, flags: torch.Tensor) -> float:
        """Share of non-empty rows where `flags` is set."""
        return float((flags & self.row_valid).sum()) / float(self.row_valid.sum())


def seq_summary(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """mean / unbiased std / max / min of per-sequence values, as verl reports them."""
    return {
        f"{prefix}_seq_mean": float(values.mean()),
        f"{prefix}_seq_std": float(values.std()) if values.numel() > 1 else 0.0,
        f"{prefix}_seq_max": float(values.max()),
        f"{prefix}_seq_min": float(values.min()),
    }


def fraction(flags: torch.Tensor) -> float:
    """Share of the entries of `flags` that are set (over every row, empty ones included)."""
    return float(flags.double().mean())


@dataclass(frozen=True)
class PolicyRows:
    """Row sums `[batch]` behind verl's off-policy metrics (0 when empty): train, rollout, log_ratio,
    k3_kl (unclamped, as verl), ratio_sq.
    """

    train: torch.Tensor
    rollout: torch.Tensor
    log_ratio: torch.Tensor
    k3_kl: torch.Tensor
    ratio_sq: torch.Tensor

    @classmethod
    def of_block(cls, b: Block) -> PolicyRows:
        """The row sums of one block."""
        d, work = b.log_ratio, b.buffer()
        return cls(
            train=b.train.sum(-1),
            rollout=b.rollout.sum(-1),
            log_ratio=b.row_log_ratio_sum,
            # exp(0) - 0 - 1 = 0 at padding.
            k3_kl=torch.sub(b.exp_log_ratio, d, out=work).sub_(1.0).sum(-1),
            ratio_sq=torch.square(b.ratio, out=work).sum(-1),
        )


def offpolicy_metrics(p: PolicyRows, r: Rows) -> dict[str, float]:
    """verl's `compute_offpolicy_metrics`: KL, perplexities and χ² of the two policies. Batch
    means over sequences include empty rows (mean logprob 0), as verl's do. k3_kl is verl's, at Δ
    unclamped (χ² at Δ clamped to ±20): above the summary's `k3_kl` (clamped) where some |Δ| > 20."""
    mean_train = p.train / r.row_count
    mean_rollout = p.rollout / r.row_count
    log_ppl_diff = mean_rollout - mean_train
    seq_log = p.log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": float(torch.exp(-mean_train).mean()),
        "training_log_ppl": float((-mean_train).mean()),
        "kl": -r.token_mean(p.log_ratio),
        "k3_kl": r.token_mean(p.k3_kl),
        "rollout_ppl": float(torch.exp(-mean_rollout).mean()),
        "rollout_log_ppl": float((-mean_rollout).mean()),
        "log_ppl_diff": float(log_ppl_diff.mean()),
        "log_ppl_abs_diff": float(log_ppl_diff.abs().mean()),
        "log_ppl_diff_max": float(log_ppl_diff.max()),
        "log_ppl_diff_min": float(log_ppl_diff.min()),
        "ppl_ratio": float(torch.exp(log_ppl_diff).mean()),
        "chi2_token": r.token_mean(p.ratio_sq) - 1.0,
        "chi2_seq": float(torch.exp(2.0 * seq_log).mean()) - 1.0,
    }
