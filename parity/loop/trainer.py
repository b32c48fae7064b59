"""The training side of the loop: parity's training forward with gradients, and an AdamW step.

The trainer owns a model copy and scores with `train_forward`; the update's `grad=True` forward
must give the same bits as the no-grad one (checked every step), gradients are clipped (verl's
1.0) and AdamW steps; a non-finite loss or gradient stops before the optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from parity.core.errors import DivergedError
from parity.core.types import Rollout
from parity.engine import TrainConfig, train_forward
from parity.loop.adapter import AdapterWeights, initial_adapter, unpinned
from parity.loop.grpo import LossPlan, micro_batch_loss
from parity.loop.weights import FullWeights, trained_weights
from parity.models.checkpoints import resolve_model
from parity.models.loading import LoadedModel, copy_model, load_model


@dataclass(frozen=True)
class UpdateStats:
    """One optimizer step: loss (token mean), gradient norm before clipping, and whether the
    differentiable forward gave exactly the planned (no-grad) logprobs on every sequence."""

    loss: float
    grad_norm: float
    forward_bitwise: bool


class Trainer:
    """The training model, its optimizer (AdamW: lr, weight_decay, betas, grad_clip) and its forward
    (`config`, and `grad_config` with autograd); lora_rank: train only an adapter under `adapter_dir`.
    """

    def __init__(self, model: str, *, dtype: str, device: str, lr: float, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), grad_clip: float | None = 1.0,
                 micro_batch_size: int | None = None, lora_rank: int | None = None,
                 adapter_dir: Path | None = None, seed: int = 0) -> None:
        self.config = TrainConfig(dtype=dtype, device=device)
        self.grad_config = self.config.replace(grad=True)
        self.weights: FullWeights | AdapterWeights
        if lora_rank is None:
            self.weights = trained_weights(copy_model(load_model(model, dtype=dtype, device=device)))
        else:
            if adapter_dir is None:
                raise ValueError("lora_rank needs adapter_dir, where the trainer writes its adapters")
            start = initial_adapter(resolve_model(model), model, lora_rank, seed, adapter_dir / "step-0")
            lm = copy_model(load_model(model, dtype=dtype, device=device, lora=start))
            self.weights = AdapterWeights(lm, adapter_dir)
        self.optimizer = torch.optim.AdamW(self.weights.parameters(), lr=lr, betas=betas,
                                           weight_decay=weight_decay)
        self.grad_clip = grad_clip
        self.micro_batch_size = micro_batch_size

    @property
    def lm(self) -> LoadedModel:
        """The training model at the current weights (with an adapter: recording the current one)."""
        return self.weights.lm

    def logprobs(self, rollouts: Sequence[Rollout]) -> list[torch.Tensor]:
        """Teacher-forced logprobs of each rollout's response at the current weights (no grad),
        whatever adapter the rollouts record (a stale one is the sync check's to report)."""
        return train_forward(self.lm, unpinned(rollouts), self.config).logprobs

    def update(self, rollouts: Sequence[Rollout], plan: LossPlan) -> UpdateStats:
        """One optimizer step on `rollouts` with the loss `plan` (made from `logprobs(rollouts)`)."""
        n = len(rollouts)
        size = self.micro_batch_size or n
        bitwise = True
        total = 0.0
        self.weights.zero_grad()
        for start in range(0, n, size):
            rows = range(start, min(n, start + size))
            part = unpinned([rollouts[i] for i in rows])
            logprobs = train_forward(self.lm, part, self.grad_config).logprobs
            for i, lp in zip(rows, logprobs):
                bitwise &= torch.equal(lp.detach(), plan.old[i, :lp.numel()])
            loss = micro_batch_loss(logprobs, plan, rows)
            loss.backward()
            total += float(loss.detach())
        self.weights.gradients_to_masters()
        params = self.weights.parameters()
        norm = float(torch.nn.utils.clip_grad_norm_(params, self.grad_clip if self.grad_clip else math.inf))
        if not (math.isfinite(total) and math.isfinite(norm)):
            self.weights.zero_grad()
            raise DivergedError(f"the loss is {total} and the gradient norm {norm}")
        self.optimizer.step()
        self.weights.masters_to_model()
        self.weights.zero_grad()
        return UpdateStats(loss=total, grad_norm=norm, forward_bitwise=bitwise)
