"""Rotary position embedding applied to q and k on CUDA in one kernel, the HF formula exactly.

It rounds at HF's three points with FMA contraction off, so its bits are stock, replacing ten bf16
launches with one for q and k; it writes [B, L, H, D] (returned as HF's [B, H, L, D] view) so
attention's reshape is free. Elementwise, hence invariant. `norm_rotary` runs Qwen3's per-head
RMSNorm of q and k before the rotation in the same launch.
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
def _turn(x1, x2, c1, c2, s1, s2, dt: tl.constexpr):
    """HF's rotation of a head's halves x1, x2 (fp32 holding dt values) by cos and sin halves c, s."""
    # q * cos, rotate_half(q) * sin, their sum: each rounded to the tensor dtype, as torch does
    # (negating in fp32 is negating in dt)
    lo = _rounded(x1 * c1.to(tl.float32), dt) + _rounded(-x2 * s1.to(tl.float32), dt)
    hi = _rounded(x2 * c2.to(tl.float32), dt) + _rounded(x1 * s2.to(tl.float32), dt)
    return lo, hi


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
    lo, hi = _turn(x1.to(tl.float32), x2.to(tl.float32), c1, c2, s1, s2, dt)
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


@triton.jit
def _norm_rotate(x_ptr, w_ptr, eps, cos_ptr, sin_ptr, out_ptr, HALF: tl.constexpr):
    """One head's row x [2 * HALF]: RMSNorm with weight w as `rmsnorm._norm_store` computes it (the
    whole row's sum of squares in one block; each element rounded where HF's norm rounds), then
    rotated by that token's cos and sin rows (`_turn`), stored at out_ptr."""
    row = tl.arange(0, 2 * HALF)
    xf = tl.load(x_ptr + row).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / (2 * HALF) + eps)
    d = tl.arange(0, HALF)
    x1, x2 = tl.load(x_ptr + d), tl.load(x_ptr + HALF + d)
    dt = x1.dtype
    y1 = _rounded(tl.load(w_ptr + d).to(tl.float32) * _rounded(x1.to(tl.float32) * rstd, dt), dt)
    y2 = _rounded(tl.load(w_ptr + HALF + d).to(tl.float32) * _rounded(x2.to(tl.float32) * rstd, dt), dt)
    lo, hi = _turn(y1, y2, tl.load(cos_ptr + d), tl.load(cos_ptr + HALF + d), tl.load(sin_ptr + d),
                   tl.load(sin_ptr + HALF + d), dt)
    tl.store(out_ptr + d, lo.to(dt, fp_downcast_rounding="rtne"))
    tl.store(out_ptr + HALF + d, hi.to(dt, fp_downcast_rounding="rtne"))


@triton.jit
def _norm_rotary_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, L, HQ, HK,
                        stride_qb, stride_ql, stride_qh, stride_kb, stride_kl, stride_kh, stride_cb,
                        stride_cl, q_eps, k_eps, HALF: tl.constexpr):
    """Grid (B * L tokens, Hq + Hk heads): every head of q and k of a layer normed and rotated."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    b, pos = token // L, token % L
    table = b * stride_cb + pos * stride_cl
    cos_row, sin_row = cos_ptr + table, sin_ptr + table
    if head < HQ:
        _norm_rotate(q_ptr + b * stride_qb + pos * stride_ql + head * stride_qh, qw_ptr, q_eps, cos_row,
                     sin_row, q_out_ptr + (token * HQ + head) * (2 * HALF), HALF)
    else:
        kh = head - HQ
        _norm_rotate(k_ptr + b * stride_kb + pos * stride_kl + kh * stride_kh, kw_ptr, k_eps, cos_row,
                     sin_row, k_out_ptr + (token * HK + kh) * (2 * HALF), HALF)


def _token_major(q: torch.Tensor, b: int, length: int, hq: int, hk: int, d: int, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Empty q and k outputs [B, L, H, D] in q's dtype, and cos/sin expanded to [B, L, D]."""
    q_out = torch.empty((b, length, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((b, length, hk, d), dtype=q.dtype, device=q.device)
    return q_out, k_out, cos.expand(b, length, d), sin.expand(b, length, d)


def norm_rotary(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                q_eps: float, k_eps: float, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """q [B, L, Hq, D] and k [B, L, Hk, D] each RMSNormed per head (weights [D]) and rotated by cos/sin
    [B, L, D] -> [B, H, L, D] views of [B, L, H, D] memory; None where the layout or dtypes do not fit
    (a power-of-two D, contiguous rows, one dtype throughout): the caller runs the three ops."""
    d = q.shape[-1]
    fits = (q.dim() == k.dim() == 4 and cos.dim() == sin.dim() == 3 and d >= 2 and d & (d - 1) == 0
            and q.shape[:2] == k.shape[:2] and k.shape[-1] == d and cos.shape[-1] == d
            and q_weight.shape == k_weight.shape == (d,)
            and q.stride(-1) == k.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1
            and len({q.dtype, k.dtype, q_weight.dtype, k_weight.dtype, cos.dtype, sin.dtype}) == 1)
    if not fits:
        return None
    b, length, hq, _ = q.shape
    hk = k.shape[2]
    q_out, k_out, cos, sin = _token_major(q, b, length, hq, hk, d, cos, sin)
    if q_out.numel() and k_out.numel():
        _norm_rotary_kernel[(b * length, hq + hk)](
            q, k, q_weight, k_weight, cos, sin, q_out, k_out, length, hq, hk, q.stride(0), q.stride(1),
            q.stride(2), k.stride(0), k.stride(1), k.stride(2), cos.stride(0), cos.stride(1), q_eps, k_eps,
            HALF=d // 2, num_warps=4, enable_fp_fusion=False)
    return q_out.transpose(1, 2), k_out.transpose(1, 2)


def _apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, L, D], k [B, Hkv, L, D] (last dim contiguous), cos/sin [B, L, D] -> each rotated, as a
    [B, H, L, D] view of [B, L, H, D] memory."""
    b, hq, length, d = q.shape
    hk = k.shape[1]
    q_out, k_out, cos, sin = _token_major(q, b, length, hq, hk, d, cos, sin)
    if q_out.numel() and k_out.numel():
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
