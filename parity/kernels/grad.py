"""Gradients through the invariant kernels: the kernel's forward bits, the stock op's derivative.

Autograd cannot differentiate most kernels, yet training needs the gradient of exactly the
logprobs the engine reported. `exact(kernel, stock, *inputs)` returns `kernel()` bit for bit and
back-propagates through `stock(*inputs)` recomputed at the same inputs with every family off
(batch dependence of the backward: docs/DESIGN.md, "Gradients"). Without grad it is a plain call.
Leaf inputs (parameters) enter the recompute as themselves, others detached.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from parity.kernels import switch

Output = torch.Tensor | tuple[torch.Tensor, ...]


def needs_grad(*inputs: torch.Tensor | None) -> bool:
    """Whether a call on `inputs` is being recorded for autograd (grad mode on and some input
    requires a gradient)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)


def exact(kernel: Callable[[], Output], stock: Callable[..., Output], *inputs: torch.Tensor | None) -> Output:
    """`kernel()`'s result (a tensor or tuple), differentiable as `stock(*inputs)`; `inputs` holds
    every tensor it depends on differentiably (None allowed).
    """
    if not needs_grad(*inputs):
        return kernel()
    return _Exact.apply(kernel, stock, *inputs)


def _recompute_input(saved: torch.Tensor | None, need: bool) -> torch.Tensor | None:
    if saved is None:
        return None
    if need and saved.is_leaf:
        return saved  # a parameter: the stock function may read it from its module directly
    return saved.detach().requires_grad_(need)


class _Exact(torch.autograd.Function):
    """Forward: the kernel. Backward: vector-Jacobian product of the stock recompute."""

    @staticmethod
    def forward(ctx: Any, kernel: Callable[[], Output], stock: Callable[..., Output],
                *inputs: torch.Tensor | None) -> Output:
        ctx.stock = stock
        ctx.save_for_backward(*inputs)
        return kernel()

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        needs = ctx.needs_input_grad[2:]
        with torch.enable_grad(), switch.native():
            args = [_recompute_input(t, need) for t, need in zip(ctx.saved_tensors, needs)]
            outs = ctx.stock(*args)
            outs = outs if isinstance(outs, tuple) else (outs,)
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            wanted = [a for a, need in zip(args, needs) if need]
            found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                             allow_unused=True) if pairs else [None] * len(wanted))
        return (None, None, *(next(found) if need else None for need in needs))
