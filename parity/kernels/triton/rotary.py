"""Rotary position embedding applied to q and k on CUDA in one kernel, the HF formula exactly.

It rounds at HF's three points with FMA contraction off, so its bits are stock, replacing ten bf16
launches with one for q and k; it writes [B, L, H, D] (returned as HF's [B, H, L, D] view) so
attention's reshape is free. Elementwise, hence invariant.
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
def _rotate(x_ptr, cos_ptr, sin_ptr, out_ptr, token, block, L, H, stride_xb, stride_xh, stride_xl, stride_cb,
            stride_cl, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """One token's heads block * BLOCK_H.. of x rotated into out [B, L, H, 2 * HALF]."""
    b, pos = token // L, token % L
    heads = block * BLOCK_H + tl.arange(0, BLOCK_H)
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


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, L, HQ, HK, Q_BLOCKS,
                   stride_qb, stride_qh, stride_ql, stride_kb, stride_kh, stride_kl, stride_cb, stride_cl,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Grid (B * L tokens, q head blocks + k head blocks): q and k of a layer in one launch."""
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    if block < Q_BLOCKS:
        _rotate(q_ptr, cos_ptr, sin_ptr, q_out_ptr, token, block, L, HQ, stride_qb, stride_qh, stride_ql,
                stride_cb, stride_cl, HALF, BLOCK_H)
    else:
        _rotate(k_ptr, cos_ptr, sin_ptr, k_out_ptr, token, block - Q_BLOCKS, L, HK, stride_kb, stride_kh,
                stride_kl, stride_cb, stride_cl, HALF, BLOCK_H)


def _apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, L, D], k [B, Hkv, L, D] (last dim contiguous), cos/sin [B, L, D] -> each rotated, as a
    [B, H, L, D] view of [B, L, H, D] memory."""
    b, hq, length, d = q.shape
    hk = k.shape[1]
    q_out = torch.empty((b, length, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((b, length, hk, d), dtype=k.dtype, device=k.device)
    if q_out.numel() and k_out.numel():
        cos, sin = cos.expand(b, length, d), sin.expand(b, length, d)
        block_h = min(triton.next_power_of_2(max(hq, hk)), 16)
        q_blocks = triton.cdiv(hq, block_h)
        _rotary_kernel[(b * length, q_blocks + triton.cdiv(hk, block_h))](
            q, k, cos, sin, q_out, k_out, length, hq, hk, q_blocks, q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2), cos.stride(0), cos.stride(1),
            HALF=d // 2, BLOCK_H=block_h, num_warps=4, enable_fp_fusion=False)
    return q_out.transpose(1, 2), k_out.transpose(1, 2)


def apply_rotary(native: Callable[..., tuple[torch.Tensor, torch.Tensor]], q: torch.Tensor,
                 k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)` for q [B, Hq, L, D], k [B, Hkv, L, D]
    and cos/sin [B, L, D]; other layouts (or an odd head_dim, strided rows, mismatched dtypes) run
    `native`, the model's own function."""
    d = q.shape[-1]
    fits = (unsqueeze_dim == 1 and q.dim() == k.dim() == 4 and cos.dim() == sin.dim() == 3 and d % 2 == 0
            and d & (d - 1) == 0 and q.stride(-1) == k.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1
            and q.dtype == k.dtype == cos.dtype == sin.dtype and cos.shape[-1] == d
            and (q.shape[0], q.shape[2], q.shape[3]) == (k.shape[0], k.shape[2], k.shape[3]))
    if not fits:
        return native(q, k, cos, sin, unsqueeze_dim)
    return _apply(q, k, cos, sin)
