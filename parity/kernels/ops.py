"""The ops patched models call: each runs the invariant kernel of its family when that family is on
(looked up for the tensor's device) and the stock torch op otherwise.

The stock branch is exactly what the unpatched HF module computes, so a model with every family
off gives the same bits as an unpatched one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from parity.kernels.switch import impl

RotaryForward = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N]  (family "matmul")."""
    fn = impl("matmul", "linear", x.device.type)
    return F.linear(x, weight, bias) if fn is None else fn(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             native: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """RMSNorm over the last dim (family "rmsnorm"); `native` is the module's own forward."""
    fn = impl("rmsnorm", "rms_norm", x.device.type)
    return native(x) if fn is None else fn(x, weight, eps)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim (family "softmax")."""
    fn = impl("softmax", "softmax", x.device.type)
    return torch.softmax(x, dim=-1) if fn is None else fn(x)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the last dim (family "softmax")."""
    fn = impl("softmax", "log_softmax", x.device.type)
    return torch.log_softmax(x, dim=-1) if fn is None else fn(x)


def cumsum(x: torch.Tensor) -> torch.Tensor:
    """Inclusive cumulative sum over the last dim (family "softmax": a reduction over the vocabulary)."""
    fn = impl("softmax", "cumsum", x.device.type)
    return torch.cumsum(x, dim=-1) if fn is None else fn(x)


def activation(act: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """An elementwise activation such as SiLU (family "pointwise")."""
    fn = impl("pointwise", "activation", x.device.type)
    return act(x) if fn is None else fn(act, x)


def rotary(forward: RotaryForward, x: torch.Tensor, position_ids: torch.Tensor, max_positions: int,
           tables: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary cos, sin [B, L, D] for position_ids [B, L] (family "rotary"); `forward` is the module's own."""
    fn = impl("rotary", "rotary", x.device.type)
    if fn is None:
        return forward(x, position_ids)
    return fn(forward, x, position_ids, max_positions, tables)


def apply_rotary(native: Callable[..., tuple[torch.Tensor, torch.Tensor]], q: torch.Tensor,
                 k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k rotated by cos, sin (family "rotary"); `native` is the model's own `apply_rotary_pos_emb`.

    Elementwise, so invariant as stock; the CUDA kernel fuses HF's ten launches into two with the
    same bits (`parity.kernels.triton.rotary`)."""
    fn = impl("rotary", "apply", q.device.type)
    if fn is None:
        return native(q, k, cos, sin, unsqueeze_dim)
    return fn(native, q, k, cos, sin, unsqueeze_dim)


def topk(scores: torch.Tensor, k: int, *, normalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) [..., k] of the k largest scores, values renormalized to sum 1 if `normalize`.

    Family "moe": ties go to the lower index and the renormalizing sum has a fixed order.
    """
    fn = impl("moe", "topk", scores.device.type)
    if fn is not None:
        return fn(scores, k, normalize)
    values, indices = torch.topk(scores, k, dim=-1)
    if normalize:
        values = values / values.sum(dim=-1, keepdim=True)
    return values, indices
