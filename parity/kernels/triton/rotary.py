"""Rotary position embedding applied to q and k on CUDA in one kernel, the HF formula exactly.

It rounds at HF's three points with FMA contraction off, so its bits are stock, replacing ten bf16
launches; it writes [B, L, H, D] (returned as HF's [B, H, L, D] view) so attention's reshape is
free. Elementwise, hence invariant.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl


@triton.jit
def _rounded(x, dt: tl.constexpr):
    """fp32 x rounded to dt (to nearest, ties to even, as torch rounds), back in fp32."""
    return x.to(dt, fp_downcast_rounding="rtne").to(tl.float32)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, L, H, stride_xb, stride_xh, stride_xl, stride_cb,
                   stride_cl, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Grid (B * L tokens, head blocks): one token's BLOCK_H heads; out is [B, L, H, 2 * HALF]."""
    token = tl.program_id(0).to(tl.int64)
    b, pos = token // L, token % L
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = (heads < H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    x = x_ptr + b * stride_xb + pos * stride_xl + heads[:, None] * stride_xh
    x1 = tl.load(x + d, mask=ok, other=0.0)
    x2 = tl.load(x + HALF + d, mask=ok, other=0.0)
    table = b * stride_cb + pos * stride_cl
    c1, c2 = tl.load(cos_ptr + table + d), tl.load(cos_ptr + table + HALF + d)
    s1, s2 = tl.load(sin_ptr + table + d), tl.load(sin_ptr + table + HALF + d)
    dt = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)  # exact; negating in fp32 is negating in dt
    # q * cos, rotate_half(q) * sin, their sum: each rounded to the tensor dtype, as torch does
    lo = _rounded(x1 * c1.to(tl.float32), dt) + _rounded(-x2 * s1.to(tl.float32), dt)
    hi = _rounded(x2 * c2.to(tl.float32), dt) + _rounded(x1 * s2.to(tl.float32), dt)
    out = out_ptr + (token * H + heads[:, None]) * (2 * HALF)
    tl.store(out + d, lo.to(dt, fp_downcast_rounding="rtne"), mask=ok)
    tl.store(out + HALF + d, hi.to(dt, fp_downcast_rounding="rtne"), mask=ok)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, L, D] (last dim contiguous), cos/sin [B, L, D] -> [B, H, L, D] view of [B, L, H, D] memory."""
    b, h, length, d = x.shape
    out = torch.empty((b, length, h, d), dtype=x.dtype, device=x.device)
    if out.numel():
        cos, sin = cos.expand(b, length, d), sin.expand(b, length, d)
        block_h = min(triton.next_power_of_2(h), 16)
        _rotary_kernel[(b * length, triton.cdiv(h, block_h))](
            x, cos, sin, out, length, h, x.stride(0), x.stride(1), x.stride(2), cos.stride(0), cos.stride(1),
            HALF=d // 2, BLOCK_H=block_h, num_warps=4, enable_fp_fusion=False)
    return out.transpose(1, 2)


def apply_rotary(native: Callable[..., tuple[torch.Tensor, torch.Tensor]], q: torch.Tensor,
                 k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)` for q [B, Hq, L, D], k [B, Hkv, L, D]
    and cos/sin [B, L, D]; other layouts (or an odd head_dim, strided rows, mismatched dtypes) run
    `native`, the model's own function."""
    d = q.shape[-1]
    fits = (unsqueeze_dim == 1 and q.dim() == k.dim() == 4 and cos.dim() == sin.dim() == 3 and d % 2 == 0
            and d & (d - 1) == 0 and q.stride(-1) == k.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1
            and q.dtype == k.dtype == cos.dtype == sin.dtype and cos.shape[-1] == d)
    if not fits:
        return native(q, k, cos, sin, unsqueeze_dim)
    return _apply(q, cos, sin), _apply(k, cos, sin)
