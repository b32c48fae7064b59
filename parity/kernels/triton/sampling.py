"""Gumbel-max sampling on CUDA: counter-based noise, add, argmax, SPAN tokens of a row per program.

The draw of `parity.kernels.sampling` (the same integers) without ~30 [N, V] passes through
memory (~6 ms at 256 x 151936): the noise stays in registers. A program walks its span in fixed
ascending chunks, keeps the first maximum per lane, then the lowest id among lanes at the max; a
second kernel takes the lowest id among a row's spans at the row's max. Either way the token is
the lowest id whose noisy score is the row's maximum, so the split changes no draw; it spreads
the float64 logs (the kernel's cost) over ten times more programs than rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: vocabulary entries per chunk (a power of two).
BLOCK = 2048
#: vocabulary entries per program (a multiple of BLOCK): 10 programs a row at V = 151936.
SPAN = 8 * BLOCK


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
def _gumbel_span_kernel(scores_ptr, state_ptr, noisy_ptr, best_ptr, id_ptr, V, stride, SPANS,
                        BLOCK: tl.constexpr, SPAN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    span = tl.program_id(1)
    state = tl.load(state_ptr + row).to(tl.uint32)  # in [0, 2^32): exact
    noisy = tl.load(noisy_ptr + row) != 0
    lanes = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), tl.float64)
    best_id = tl.zeros((BLOCK,), tl.int64)
    first = span * SPAN
    for start in range(first, tl.minimum(first + SPAN, V), BLOCK):
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
    # A lane never updated (its scores all -inf) keeps id 0: a row of -inf alone draws token 0.
    top = tl.max(best, axis=0)
    tl.store(best_ptr + row * SPANS + span, top)
    tl.store(id_ptr + row * SPANS + span, tl.min(tl.where(best == top, best_id, V), axis=0))


@triton.jit
def _pick_kernel(best_ptr, id_ptr, out_ptr, V, SPANS, LANES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, LANES)
    ok = lanes < SPANS
    best = tl.load(best_ptr + row * SPANS + lanes, mask=ok, other=float("-inf"))
    ids = tl.load(id_ptr + row * SPANS + lanes, mask=ok, other=V)
    top = tl.max(best, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(best == top, ids, V), axis=0))


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
        spans = triton.cdiv(v, SPAN)
        best = torch.empty((n, spans), dtype=torch.float64, device=scores.device)
        ids = torch.empty((n, spans), dtype=torch.int64, device=scores.device)
        _gumbel_span_kernel[(n, spans)](scores, state, noisy.to(torch.int8), best, ids, v, scores.stride(0),
                                        spans, BLOCK=BLOCK, SPAN=SPAN, num_warps=8)
        _pick_kernel[(n,)](best, ids, out, v, spans, LANES=triton.next_power_of_2(spans), num_warps=1)
    return out
