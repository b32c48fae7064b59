"""Gumbel-max sampling on CUDA in one kernel: counter-based noise, add, argmax, one program per row.

The draw of `parity.kernels.sampling` (the same integers) without ~30 [N, V] passes through
memory (~6 ms at 256 x 151936): the noise stays in registers. A program walks its row in fixed
ascending chunks, keeps the first maximum per lane, then the lowest id among lanes at the max.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: vocabulary entries per chunk (a power of two).
BLOCK = 2048


@triton.jit
def _mix32(x):
    # The integer hash of `parity.kernels.sampling.mix32_` in uint32: torch's int64 version keeps
    # values below 2^32 and masks every product to its low 32 bits, which is what a uint32 multiply
    # keeps; shifts of unsigned values are logical. The same bits, at a third of the integer work.
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x68E31DA5
    return x ^ (x >> 16)


@triton.jit
def _gumbel_argmax_kernel(scores_ptr, state_ptr, noisy_ptr, out_ptr, V, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    state = tl.load(state_ptr + row).to(tl.uint32)  # in [0, 2^32): exact
    noisy = tl.load(noisy_ptr + row) != 0
    lanes = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), tl.float64)
    best_id = tl.zeros((BLOCK,), tl.int64)
    for start in range(0, V, BLOCK):
        token = (start + lanes).to(tl.int64)
        ok = token < V
        x = tl.load(scores_ptr + row * stride + token, mask=ok, other=float("-inf")).to(tl.float64)
        word = (2 * token).to(tl.uint32)  # V < 2^31: 2 * token + 1 fits 32 bits
        high = _mix32(state ^ _mix32(word)).to(tl.uint64)
        low = _mix32(state ^ _mix32(word + 1)).to(tl.uint64)
        # 53 bits convert to float64 exactly; u lies strictly inside (0, 1), so both logs are finite.
        u = (((high << 21) | (low >> 11)).to(tl.float64) + 0.5) / 9007199254740992.0
        noise = -tl.log(-tl.log(u))
        y = x + tl.where(noisy, noise, 0.0)
        better = ok & (y > best)
        best = tl.where(better, y, best)
        best_id = tl.where(better, token, best_id)
    top = tl.max(best, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(best == top, best_id, V), axis=0))


def gumbel_argmax(scores: torch.Tensor, state: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
    """argmax(scores [N, V] + noise) per row -> [N] int64, ties to the lower id; state [N] int64 in
    [0, 2^32); rows not `noisy` (greedy) add no noise.
    """
    n, v = scores.shape
    if v >= 2**31:
        raise ValueError(f"gumbel_argmax hashes token ids in 32 bits; a vocabulary of {v} ids is too large")
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    out = torch.empty(n, dtype=torch.int64, device=scores.device)
    if n:
        _gumbel_argmax_kernel[(n,)](scores, state, noisy.to(torch.int8), out, v, scores.stride(0),
                                    BLOCK=BLOCK, num_warps=8)
    return out
