"""Batch-invariant RMSNorm on CUDA, the HF formula exactly: normalize in fp32, cast, multiply by the
weight. One program reduces one whole row in one block, so the order never follows the row count.
`add_rms_norm` adds a decoder layer's residual first, in the same pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from parity.core.errors import InputError


@triton.jit
def _norm_store(x, w_ptr, out_row_ptr, cols, mask, H, eps):
    """Store RMSNorm(x) * w of one loaded row x [BLOCK] (zeros past H) at out_row_ptr."""
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / H
    normed = (xf * tl.math.rsqrt(variance + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    # The product of two bf16/fp16 values is exact in fp32, so this is one rounding, as in torch.
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_row_ptr + cols, y.to(out_row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, H, x_row_stride, out_row_stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    _norm_store(x, w_ptr, out_ptr + row * out_row_stride, cols, mask, H, eps)


@triton.jit
def _add_rms_norm_kernel(r_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, H, r_row_stride, d_row_stride, eps,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    r = tl.load(r_ptr + row * r_row_stride + cols, mask=mask, other=0.0)
    d = tl.load(d_ptr + row * d_row_stride + cols, mask=mask, other=0.0)
    # torch adds two bf16/fp16 tensors in fp32 and rounds the sum once; in fp32 it is the same add
    total = (r.to(tl.float32) + d.to(tl.float32)).to(r.dtype, fp_downcast_rounding="rtne")
    tl.store(sum_ptr + row * H + cols, total, mask=mask)
    _norm_store(total, w_ptr, out_ptr + row * H, cols, mask, H, eps)


def _rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., H] as [rows, H] with unit column stride; InputError unless weight is [H]."""
    h = x.shape[-1]
    if weight.shape != (h,):
        raise InputError(f"rms_norm: weight shape {tuple(weight.shape)} != ({h},)")
    x2 = x.reshape(-1, h)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch_options(h: int) -> dict[str, int | bool]:
    # FMA contraction off: float32 sums of squares then round as in `rotary.norm_rotary`'s norm
    return {"BLOCK": triton.next_power_of_2(h), "num_warps": 4 if h <= 4096 else 8, "enable_fp_fusion": False}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., H] with weight [H] -> [..., H] in the dtype torch would give (w * x)."""
    x2 = _rows(x, weight)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, x2.shape[1], x2.stride(0), out.stride(0), eps,
                                         **_launch_options(x2.shape[1]))
    return out.reshape(x.shape)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + delta), residual + delta) [..., H] in one launch, the bits of the two ops."""
    if residual.shape != delta.shape or residual.dtype != delta.dtype:
        total = residual + delta
        return rms_norm(total, weight, eps), total
    r2, d2 = _rows(residual, weight), _rows(delta, weight)
    rows, h = r2.shape
    total = torch.empty((rows, h), dtype=residual.dtype, device=residual.device)
    out = torch.empty((rows, h), dtype=torch.promote_types(weight.dtype, total.dtype), device=total.device)
    if rows:
        _add_rms_norm_kernel[(rows,)](r2, d2, weight, total, out, h, r2.stride(0), d2.stride(0), eps,
                                      **_launch_options(h))
    return out.reshape(residual.shape), total.reshape(residual.shape)
