"""Batch-invariant RMSNorm on CUDA, the HF formula exactly: normalize in fp32, cast, multiply by the
weight. One program reduces one whole row in one block, so the order never follows the row count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from parity.core.errors import InputError


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, H, x_row_stride, out_row_stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / H
    normed = (xf * tl.math.rsqrt(variance + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    # The product of two bf16/fp16 values is exact in fp32, so this is one rounding, as in torch.
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., H] with weight [H] -> [..., H] in the dtype torch would give (w * x)."""
    h = x.shape[-1]
    if weight.shape != (h,):
        raise InputError(f"rms_norm: weight shape {tuple(weight.shape)} != ({h},)")
    x2 = x.reshape(-1, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            weight,
            out,
            h,
            x2.stride(0),
            out.stride(0),
            eps,
            BLOCK=triton.next_power_of_2(h),
            num_warps=4 if h <= 4096 else 8,
        )
    return out.reshape(x.shape)
