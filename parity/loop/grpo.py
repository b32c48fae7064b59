"""GRPO's advantages and the policy loss with rollout correction, in verl's definitions.

Advantage (`compute_grpo_outcome_advantage`): `(r - mean) / (std + 1e-6)` over a prompt's n
responses (unbiased std; a group of one: 0, 1). Loss (`compute_policy_loss_vanilla`,
token-mean): `max(-A ρ, -A clip(ρ, 1 - ε, 1 + ε))` times the correction's weight over kept tokens.
One update per step, so `logp_old` is the forward at the current weights (ρ = 1, gradient
`-A ∇logp`); on the reference engine every correction weight is exactly 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from parity.core.errors import InputError
from parity.correction import CorrectionConfig, apply_correction
from parity.drift.ratio_rules import clamp_log_ratio, in_band
from parity.drift.ratio_rules import ratio as ratio_of

#: verl's epsilon in the GRPO normalization.
GRPO_EPS = 1e-6
#: PPO's clip range ε (verl's default clip_ratio).
CLIP_RATIO = 0.2


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """GRPO advantages `[groups, n]` of rewards `[groups, n]` (float64)."""
    if rewards.dim() != 2:
        raise InputError(f"rewards must be [groups, n], got shape {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        raise InputError("a reward is NaN or infinite; a reward function must return finite floats")
    r = rewards.to(torch.float64)
    if r.shape[1] == 1:
        return r.clone()  # (r - 0) / (1 + eps) in verl; a group of one teaches nothing either way
    # a group of equal rewards teaches nothing: the rounding of its mean (0.7 x 3: 1e-16, over a std of
    # the same rounding) must not become an advantage, which AdamW would scale up to a full step
    same = (r == r[:, :1]).all(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True)
    wide = ~same & ~torch.isfinite(std)
    if wide.any():
        group = int(wide.nonzero()[0, 0])
        raise InputError(f"the rewards of group {group} ({r[group].tolist()[:4]}) overflow float64's "
                         "variance (every advantage would be 0); scale the reward function's values down")
    return torch.where(same, 0.0, (r - r.mean(dim=1, keepdim=True)) / (std + GRPO_EPS))


def padded(rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence vectors -> (`[batch, max_len]` right-padded with 0, bool mask `[batch, max_len]`)."""
    values = pad_sequence([r.reshape(-1) for r in rows], batch_first=True)
    lengths = torch.tensor([r.numel() for r in rows])
    mask = torch.arange(values.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    return values, mask


@dataclass(frozen=True)
class LossPlan:
    """What one step's loss needs besides the differentiable logprobs, `[batch, max_len]` float32: old
    (detached), advantages, correction weights (1 where none), keep (mask minus rejections), metrics.
    """

    old: torch.Tensor
    advantages: torch.Tensor
    weights: torch.Tensor
    keep: torch.Tensor
    metrics: dict[str, float]

    @property
    def kept_tokens(self) -> int:
        return int(self.keep.sum())


def plan_loss(old: Sequence[torch.Tensor], rollout: Sequence[torch.Tensor], advantages: Sequence[float],
              correction: CorrectionConfig) -> LossPlan:
    """The step's `LossPlan` from per-sequence training logprobs `old`, rollout logprobs and
    per-sequence advantages, under `correction`."""
    old_b, mask = padded(old)
    rollout_b, _ = padded(rollout)
    weights, keep, metrics = apply_correction(correction, old_b, rollout_b, mask)
    adv = torch.tensor(list(advantages), dtype=torch.float32).unsqueeze(1).expand_as(old_b)
    return LossPlan(old=old_b, advantages=adv * mask,
                    weights=torch.ones_like(old_b) if weights is None else weights, keep=keep.bool(),
                    metrics=metrics)


def micro_batch_loss(logprobs: Sequence[torch.Tensor], plan: LossPlan, rows: range) -> torch.Tensor:
    """The loss terms of the sequences `rows` of the step: their kept tokens' clipped policy-gradient
    losses, summed and divided by the step's kept tokens (so micro-batch losses add up to verl's
    token mean); `logprobs`: their differentiable logprobs, one vector per sequence."""
    width = plan.old.shape[1]
    logp = torch.stack([torch.nn.functional.pad(lp.reshape(-1), (0, width - lp.numel())) for lp in logprobs])
    keep = plan.keep[rows.start:rows.stop]
    ratio = torch.exp(torch.where(keep, logp - plan.old[rows.start:rows.stop], 0.0))
    adv = plan.advantages[rows.start:rows.stop]
    clipped = torch.clamp(ratio, 1.0 - CLIP_RATIO, 1.0 + CLIP_RATIO)
    losses = torch.maximum(-adv * ratio, -adv * clipped) * plan.weights[rows.start:rows.stop]
    return torch.where(keep, losses, 0.0).sum() / max(plan.kept_tokens, 1)


def clip_fraction(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> float:
    """Share of valid tokens whose IS ratio π_train / π_rollout lies outside PPO's
    [1 - ε, 1 + ε]: the tokens PPO would clip if it took this backend's logprobs as π_old (verl's
    bypass mode, where the rollout's logprobs are the old policy)."""
    ratio = ratio_of(clamp_log_ratio(train.double() - rollout.double()))
    outside = ~in_band(ratio, 1.0 - CLIP_RATIO, 1.0 + CLIP_RATIO)
    return float((outside & mask).sum()) / max(int(mask.sum()), 1)
