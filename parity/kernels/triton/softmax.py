"""Batch-invariant softmax and log-softmax over the last dim on CUDA: one program per row, read in
fixed `CHUNK`s (a function of V only) with per-lane running max and sum combined by one `tl.sum`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: columns per chunk; rows up to this length are read in one chunk.
CHUNK = 4096


@triton.jit
def _softmax_kernel(x_ptr, out_ptr, V, x_row_stride, out_row_stride, LOG: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    out_row = out_ptr + row * out_row_stride
    cols = tl.arange(0, BLOCK)
    lane_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    lane_sum = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, V, BLOCK):
        x = tl.load(x_row + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        # A lane that has seen only -inf keeps max -inf; guard its rescale against (-inf) - (-inf).
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp(lane_max - safe_max) + tl.exp(x - safe_max)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    safe_lane = tl.where(lane_max == float("-inf"), row_max, lane_max)
    total = tl.sum(lane_sum * tl.exp(safe_lane - row_max), axis=0)
    log_total = tl.log(total)
    for start in range(0, V, BLOCK):
        mask = start + cols < V
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        if LOG:
            y = x - row_max - log_total
        else:
            y = tl.exp(x - row_max) / total
        tl.store(out_row + start + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, log: bool) -> torch.Tensor:
    v = x.shape[-1]
    x2 = x.reshape(-1, v)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] and v:
        block = min(CHUNK, triton.next_power_of_2(v))
        _softmax_kernel[(x2.shape[0],)](
            x2,
            out,
            v,
            x2.stride(0),
            out.stride(0),
            LOG=log,
            BLOCK=block,
            num_warps=8 if block >= 2048 else 4,
        )
    return out.reshape(x.shape)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax(x [..., V], dim=-1) -> [..., V] in x's dtype, computed in fp32."""
    return _launch(x, log=False)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax(x [..., V], dim=-1) -> [..., V] in x's dtype, computed in fp32."""
    return _launch(x, log=True)
