"""Gradients through the invariant kernels: the kernel's forward bits, the stock op's derivative.

The batch-invariant kernels are forward code: fixed-shape GEMMs written into preallocated
outputs on CPU, Triton launches on CUDA. Autograd cannot differentiate most of them, and a
training step needs the gradient of exactly the logprobs the rollout engine reported.
`exact(kernel, stock, *inputs)` runs `kernel()` and returns its result bit for bit; its backward
recomputes `stock(*inputs)` (the stock torch op the family replaces, which autograd
differentiates) at the same inputs and back-propagates through it. Kernel and stock op compute
the same function up to rounding, so the gradient is the stock op's local derivative evaluated
at the invariant forward's own activations: the forward a loss sees is the rollout's, bit for
bit, and only the backward's rounding is stock (its batch dependence is measured in
docs/DESIGN.md, "Gradients").

Without grad mode, or when no input requires a gradient (the engine, `inference_mode`), `exact`
is a plain call of `kernel()`: the engine pays nothing for it.

The recompute runs with every kernel family off (`switch.native`), so a stock function that calls
patched modules (HF's expert MLP calls the patched activation) runs stock all the way down.
A stock function may read module parameters directly (HF's RMSNorm and expert forwards read
their own weights) provided those parameters are among `inputs`: inputs that are leaves
(parameters) enter the recompute as themselves, every other input as a detached copy.
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
    """`kernel()`'s result (a tensor or a tuple of tensors), differentiable as `stock(*inputs)`.

    kernel: computes the forward (an invariant kernel called on `inputs`); stock: the same
    function of `inputs` in stock torch ops, same output shapes and dtypes; inputs: every tensor
    the result depends on differentiably (None entries, e.g. a missing bias, are allowed).
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
