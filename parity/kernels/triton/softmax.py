"""Batch-invariant softmax and log-softmax over the last dim on CUDA: one program per row, read in
fixed `CHUNK`s (a function of V only) with per-lane running max and sum, the lanes' sum taken by one
fixed pairwise tree. `row_stats` gives a row's max and log-sum alone, for the sampler's fused draw.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: columns per chunk; rows up to this length are read in one chunk.
CHUNK = 4096


@triton.jit
def _tree_sum(v, BLOCK: tl.constexpr, LEVELS: tl.constexpr):
    # Lane i + lane i + n/2, halving n: a fixed tree. `tl.sum`'s order follows the register layout,
    # which follows the loaded dtype (8 bf16 or 4 float32 per thread), so with it log-softmax of bf16
    # logits would differ from log-softmax of their exact float32 widening.
    for level in tl.static_range(LEVELS):
        v = tl.sum(tl.reshape(v, (2, BLOCK >> (level + 1))), axis=0)
    return tl.sum(v, axis=0)


@triton.jit
def _row_stats(x_row, V, BLOCK: tl.constexpr, LEVELS: tl.constexpr, TREE: tl.constexpr):
    """A row's max and sum of exp(x - max), x widened to float32 (exact from bf16, fp16, float32)."""
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
    lanes = lane_sum * tl.exp(safe_lane - row_max)
    if TREE:
        total = _tree_sum(lanes, BLOCK, LEVELS)
    else:
        total = tl.sum(lanes, axis=0)
    return row_max, total


@triton.jit
def _softmax_kernel(x_ptr, out_ptr, V, x_row_stride, out_row_stride, LOG: tl.constexpr, BLOCK: tl.constexpr,
                    LEVELS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    out_row = out_ptr + row * out_row_stride
    cols = tl.arange(0, BLOCK)
    row_max, total = _row_stats(x_row, V, BLOCK, LEVELS, True)
    log_total = tl.log(total)
    for start in range(0, V, BLOCK):
        mask = start + cols < V
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        if LOG:
            y = x - row_max - log_total
        else:
            y = tl.exp(x - row_max) / total
        tl.store(out_row + start + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _stats_kernel(x_ptr, stats_ptr, V, x_row_stride, BLOCK: tl.constexpr, LEVELS: tl.constexpr,
                  TREE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_max, total = _row_stats(x_ptr + row * x_row_stride, V, BLOCK, LEVELS, TREE)
    tl.store(stats_ptr + 2 * row, row_max)
    tl.store(stats_ptr + 2 * row + 1, tl.log(total))


def _block(v: int) -> tuple[int, int, int]:
    """The chunk, its tree's levels and the warps for rows of v columns."""
    block = min(CHUNK, triton.next_power_of_2(v))
    return block, block.bit_length() - 1, 8 if block >= 2048 else 4


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(x: torch.Tensor, log: bool) -> torch.Tensor:
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] and x2.shape[1]:
        block, levels, warps = _block(x2.shape[1])
        _softmax_kernel[(x2.shape[0],)](x2, out, x2.shape[1], x2.stride(0), out.stride(0), LOG=log,
                                        BLOCK=block, LEVELS=levels, num_warps=warps)
    return out.reshape(x.shape)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax(x [..., V], dim=-1) -> [..., V] in x's dtype, computed in fp32."""
    return _launch(x, log=False)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax(x [..., V], dim=-1) -> [..., V] in x's dtype, computed in fp32."""
    return _launch(x, log=True)


def row_stats(x: torch.Tensor, tree: bool = True) -> torch.Tensor:
    """[N, 2] float32 of x [N, V]: each row's max m and log(sum(exp(x - m))), the values `log_softmax`
    subtracts (its output is (x - m) - log-sum), whatever x's float dtype: one read of x. tree=False
    sums the lanes by `tl.sum` instead (the dtype-dependent order; a test's control)."""
    x2 = _rows(x)
    stats = torch.empty((x2.shape[0], 2), dtype=torch.float32, device=x.device)
    if x2.shape[0] and x2.shape[1]:
        block, levels, warps = _block(x2.shape[1])
        _stats_kernel[(x2.shape[0],)](x2, stats, x2.shape[1], x2.stride(0), BLOCK=block, LEVELS=levels,
                                      TREE=tree, num_warps=warps)
    return stats
