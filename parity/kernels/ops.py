"""The ops patched models and the sampler call: the family's invariant kernel for the tensor's
device when on, the stock torch op otherwise (exactly the unpatched HF module). Under autograd a
kernel keeps its bits and takes the stock derivative (`parity.kernels.grad.exact`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from parity.core.errors import BackendUnavailableError
from parity.kernels import sampling
from parity.kernels.grad import exact, needs_grad
from parity.kernels.switch import impl

RotaryForward = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _fused(family: str, op: str, device_type: str) -> Callable[..., Any] | None:
    """A fused op's kernel (one launch for ops that also run one by one), or None where `family` is
    off or the device was registered (`kernels.register`) without it: the caller runs the pieces,
    each its family's own kernel, with the same bits."""
    try:
        return impl(family, op, device_type)
    except BackendUnavailableError:
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N]  (family "matmul")."""
    fn = impl("matmul", "linear", x.device.type)
    if fn is None:
        return F.linear(x, weight, bias)
    return exact(lambda: fn(x, weight, bias), F.linear, x, weight, bias)


def linears(x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> list[torch.Tensor] | None:
    """[x [..., K] @ w.T for w in weights] (bias-free) in one launch where the device's kernel has a
    proven grouped plan for them; None: call `linear` per weight (the same bits either way)."""
    fn = _fused("matmul", "linears", x.device.type)
    if fn is None or needs_grad(x, *weights):
        return None
    return fn(x, weights)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             native: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """RMSNorm over the last dim (family "rmsnorm"); `native` is the module's own forward."""
    fn = impl("rmsnorm", "rms_norm", x.device.type)
    if fn is None:
        return native(x)
    # `native` reads the module's own weight, which is `weight` (a parameter: see `exact`)
    return exact(lambda: fn(x, weight, eps), lambda x_, _weight: native(x_), x, weight)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 native: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + delta), residual + delta) [..., H], a decoder layer's residual add and the
    norm after it (family "rmsnorm"; one pass on CUDA, the bits of the two ops)."""
    def stock(r: torch.Tensor, d: torch.Tensor, _weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total = r + d
        return native(total), total

    fn = impl("rmsnorm", "add_rms_norm", residual.device.type)
    if fn is None:
        return stock(residual, delta, weight)
    return exact(lambda: fn(residual, delta, weight, eps), stock, residual, delta, weight)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim (family "softmax")."""
    fn = impl("softmax", "softmax", x.device.type)
    if fn is None:
        return torch.softmax(x, dim=-1)
    return exact(lambda: fn(x), lambda x_: torch.softmax(x_, dim=-1), x)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the last dim (family "softmax")."""
    fn = impl("softmax", "log_softmax", x.device.type)
    if fn is None:
        return torch.log_softmax(x, dim=-1)
    return exact(lambda: fn(x), lambda x_: torch.log_softmax(x_, dim=-1), x)


def cumsum(x: torch.Tensor) -> torch.Tensor:
    """Inclusive cumulative sum over the last dim (family "softmax": a reduction over the vocabulary)."""
    fn = impl("softmax", "cumsum", x.device.type)
    if fn is None:
        return torch.cumsum(x, dim=-1)
    return exact(lambda: fn(x), lambda x_: torch.cumsum(x_, dim=-1), x)


def activation(act: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """An elementwise activation such as SiLU (family "pointwise")."""
    fn = impl("pointwise", "activation", x.device.type)
    if fn is None:
        return act(x)
    return exact(lambda: fn(act, x), act, x)


def gated(act: Callable[[torch.Tensor], torch.Tensor], gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up [..., I], a gated MLP's inner product (family "pointwise"; SiLU in one pass on CUDA)."""
    fn = impl("pointwise", "gated", gate.device.type)
    if fn is None:
        return act(gate) * up
    return exact(lambda: fn(act, gate, up), lambda g, u: act(g) * u, gate, up)


def rotary(forward: RotaryForward, x: torch.Tensor, position_ids: torch.Tensor, max_positions: int,
           tables: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary cos, sin [B, L, D] for position_ids [B, L] (family "rotary"); `forward` is the module's own.

    A function of the positions only (HF computes it under no_grad): nothing to differentiate."""
    fn = impl("rotary", "rotary", x.device.type)
    if fn is None:
        return forward(x, position_ids)
    return fn(forward, x, position_ids, max_positions, tables)


def apply_rotary(native: Callable[..., tuple[torch.Tensor, torch.Tensor]], q: torch.Tensor,
                 k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k rotated by cos, sin (family "rotary"); elementwise, so invariant as stock; the CUDA kernel
    fuses HF's ten launches into two with the same bits.
    """
    fn = impl("rotary", "apply", q.device.type)
    if fn is None:
        return native(q, k, cos, sin, unsqueeze_dim)
    return exact(lambda: fn(native, q, k, cos, sin, unsqueeze_dim),
                 lambda q_, k_, cos_, sin_: native(q_, k_, cos_, sin_, unsqueeze_dim), q, k, cos, sin)


def norm_rotary(q: torch.Tensor, k: torch.Tensor, q_norm: nn.Module, k_norm: nn.Module, cos: torch.Tensor,
                sin: torch.Tensor, rotate: Callable[..., tuple[torch.Tensor, torch.Tensor]]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorm of q [B, L, Hq, D] and k [B, L, Hk, D], then their rotation by cos, sin
    [B, L, D] -> q [B, Hq, L, D], k [B, Hk, L, D]. One launch on CUDA when families "rmsnorm" and
    "rotary" are both on (the bits of the three ops); else, or where the layout does not fit, `q_norm`,
    `k_norm` and `rotate` (the model's apply_rotary_pos_emb) as HF calls them."""

    def three_ops(q_: torch.Tensor, k_: torch.Tensor, *_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotate(q_norm(q_).transpose(1, 2), k_norm(k_).transpose(1, 2), cos, sin)

    device = q.device.type
    fn = _fused("rotary", "norm_apply", device) if impl("rmsnorm", "rms_norm", device) is not None else None
    if fn is None:
        return three_ops(q, k)
    with torch.no_grad():
        fused = fn(q, k, q_norm.weight, k_norm.weight, q_norm.variance_epsilon, k_norm.variance_epsilon,
                   cos, sin)
    if fused is None:
        return three_ops(q, k)
    return exact(lambda: fused, three_ops, q, k, q_norm.weight, k_norm.weight)


def topk(scores: torch.Tensor, k: int, *, normalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) [..., k] of the k largest scores; family "moe": ties to the lower index and a
    fixed-order renormalizing sum.
    """
    fn = impl("moe", "topk", scores.device.type)
    if fn is not None:
        if not needs_grad(scores):
            return fn(scores, k, normalize)
        with torch.no_grad():
            values, indices = fn(scores, k, normalize)
        return exact(lambda: values, lambda s: _picked(s, indices, normalize), scores), indices
    values, indices = torch.topk(scores, k, dim=-1)
    if normalize:
        values = values / values.sum(dim=-1, keepdim=True)
    return values, indices


def _picked(scores: torch.Tensor, indices: torch.Tensor, normalize: bool) -> torch.Tensor:
    """The top-k values at `indices` in stock ops (the "moe" top-k's derivative; the choice has none)."""
    values = scores.gather(-1, indices)
    return values / values.sum(dim=-1, keepdim=True) if normalize else values


def gumbel_argmax(scores: torch.Tensor, state: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
    """One token per row [N] int64: argmax(scores [N, V] + Gumbel noise of `state` [N]), ties to the
    lower id; rows not `noisy` add none.
    """
    fn = impl("pointwise", "gumbel_argmax", scores.device.type)
    return sampling.gumbel_argmax(scores, state, noisy) if fn is None else fn(scores, state, noisy)


def log_softmax_draw(logits: torch.Tensor, state: torch.Tensor,
                     noisy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`gumbel_argmax(log_softmax(logits))` -> tokens [N] int64 and their log-probs [N] float32, for
    logits [N, V] of any float dtype (widened to float32, exactly). One fused op where families
    "softmax" and "pointwise" are both on (the same bits as the two), the two ops otherwise."""
    device = logits.device.type
    fn = _fused("pointwise", "log_softmax_draw", device) if impl("softmax", "log_softmax", device) else None
    if fn is not None:
        return fn(logits, state, noisy)
    return sampling.log_softmax_then_draw(logits, state, noisy, log_softmax, gumbel_argmax)
