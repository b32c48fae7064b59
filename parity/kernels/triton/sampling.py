"""Gumbel-max sampling on CUDA: counter-based noise, add, argmax, SPAN tokens of a row per program.

The draw of `parity.kernels.sampling` (the same integers) without ~30 [N, V] passes through
memory (~6 ms at 256 x 151936): the noise stays in registers. A program first scores its span in
float32 (`_noise32`, a few ulps from the float64 noise) and keeps each chunk's largest score; only
the chunks within a margin of the span's largest take the float64 noise (the definition, whose two
logs cost the kernel its time), walked as before: first maximum per lane, then the lowest id among
lanes at the max. A second kernel takes the lowest id among a row's spans at the row's max. The
token is the lowest id whose float64 noisy score is the row's maximum, whatever the split.
`log_softmax_draw` reads raw logits instead and forms each log-prob in registers from the row's stats.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from parity.kernels.triton import softmax

#: vocabulary entries per chunk (a power of two).
BLOCK = 2048
#: chunks per program: a program draws from SPAN tokens of its row, 10 programs a row at V = 151936.
CHUNKS = 8
SPAN = CHUNKS * BLOCK
#: the float32 filter's margin: |noise32 - noise64| stays below ~1e-5 (a few ulps per step; 2e-6
#: measured over the hash's extremes), so 1e-3 holds the maximum with a 50x reserve; the margin
#: decides how many chunks take the float64 logs, never the token.
SLACK = 1e-3


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
def _words(state, token):
    """The two hashed words of `token`'s uniform (uint32): u = (((high << 21) | (low >> 11)) + 1/2) / 2^53."""
    word = (2 * token).to(tl.uint32)  # V < 2^31: 2 * token + 1 fits 32 bits
    return _mix32(state ^ _mix32(word)), _mix32(state ^ _mix32(word + 1))


@triton.jit
def _noise64(high, low):
    """The noise's definition: -log(-log(u)) in float64 (the device's own logs)."""
    # 53 bits convert to float64 exactly; k + 1/2 rounds to even above 2^52 (u = 1 for k = 2^53 - 1).
    u = (((high.to(tl.uint64) << 21) | (low.to(tl.uint64) >> 11)).to(tl.float64) + 0.5) / 9007199254740992.0
    return -tl.log(-tl.log(u))


@triton.jit
def _noise32(high, low):
    """`_noise64` in float32, a few float32 ulps from it: -log(u) from u below 1/2 and from 1 - u
    (formed from the complemented words, exact before one rounding) above, by its series where
    1 - u < 2^-6; the outer log turns t's relative error into the same absolute error of the noise
    (|noise| < 38). Where float64 gives u = 1 (one word pair in 2^53), both give +inf."""
    upper = high >= 0x80000000
    # k = (high << 21) | (low >> 11). Below 2^52, float64 holds k + 1/2 exactly: 2^53 u = k + 1/2.
    # Above, it rounds k + 1/2 to the even neighbour: 2^53 (1 - u) = 2^53 - 1 - k, plus 1 for even k,
    # where 2^53 - 1 - k = ~high 2^21 + (~low >> 11).
    h = tl.where(upper, ~high, high).to(tl.float32)
    lo = (tl.where(upper, ~low, low) >> 11).to(tl.float32)
    even = ((low >> 11) & 1) == 0
    v = (h * 2097152.0 + (lo + tl.where(upper, tl.where(even, 1.0, 0.0), 0.5))) * 1.1102230246251565e-16
    series = v * (1.0 + v * (0.5 + v * 0.3333333333333333))  # -log(1 - v), relative error < v^3/4
    t = tl.where(upper, tl.where(v < 0.015625, series, -tl.log(1.0 - v)), -tl.log(v))
    return -tl.log(t)


@triton.jit
def _scores(row_ptr, token, ok, row_stats_ptr, SHIFTED: tl.constexpr):
    """The row's scores at `token`; SHIFTED: logits widened to float32 and shifted by the row's stats
    (max, log-sum) as `log_softmax` does, the same float32 operations in the same order."""
    x = tl.load(row_ptr + token, mask=ok, other=float("-inf"))
    if SHIFTED:
        x = x.to(tl.float32) - tl.load(row_stats_ptr) - tl.load(row_stats_ptr + 1)
    return x


@triton.jit
def _gumbel_span_kernel(scores_ptr, stats_ptr, state_ptr, noisy_ptr, best_ptr, id_ptr, V, stride, SPANS,
                        SLACK, BLOCK: tl.constexpr, CHUNKS: tl.constexpr, SHIFTED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    span = tl.program_id(1)
    state = tl.load(state_ptr + row).to(tl.uint32)  # in [0, 2^32): exact
    noisy = tl.load(noisy_ptr + row) != 0
    row_ptr = scores_ptr + row * stride
    row_stats_ptr = stats_ptr + 2 * row
    lanes = tl.arange(0, BLOCK)
    chunks = tl.arange(0, CHUNKS)
    first = span * (CHUNKS * BLOCK)
    # Pass 1, float32: each chunk's largest approximate score (NaN and -inf never count).
    approx = tl.full((CHUNKS,), float("-inf"), tl.float32)
    for c in range(CHUNKS):
        token = (first + c * BLOCK + lanes).to(tl.int64)
        ok = token < V
        x = _scores(row_ptr, token, ok, row_stats_ptr, SHIFTED).to(tl.float32)
        high, low = _words(state, token)
        y = x + tl.where(noisy, _noise32(high, low), 0.0)
        y = tl.where(ok & (y == y), y, float("-inf"))
        approx = tl.where(chunks == c, tl.max(y, axis=0), approx)
    # A token within the margin of the span's largest approximate score may be its exact maximum;
    # one further below cannot be (each approximate score lies within half the margin of its exact
    # one), so only the chunks holding such tokens take the float64 logs. The margin grows with the
    # scores: the float32 sum x + noise rounds by half an ulp of it (2^-24 |y|; the margin's share
    # is SLACK / 64 |y|).
    top = tl.max(approx, axis=0)
    bound = tl.where(tl.abs(top) == float("inf"), top, top - SLACK * (1.0 + tl.abs(top) * 0.015625))
    best = tl.full((BLOCK,), float("-inf"), tl.float64)
    best_id = tl.zeros((BLOCK,), tl.int64)
    for c in range(CHUNKS):
        if tl.max(tl.where(chunks == c, approx, float("-inf")), axis=0) >= bound:
            token = (first + c * BLOCK + lanes).to(tl.int64)
            ok = token < V
            x = _scores(row_ptr, token, ok, row_stats_ptr, SHIFTED).to(tl.float64)
            high, low = _words(state, token)
            y = x + tl.where(noisy, _noise64(high, low), 0.0)
            better = ok & (y > best)
            best = tl.where(better, y, best)
            best_id = tl.where(better, token, best_id)
    # A lane never updated (its scores all -inf) keeps id 0: a row of -inf alone draws token 0.
    top64 = tl.max(best, axis=0)
    tl.store(best_ptr + row * SPANS + span, top64)
    tl.store(id_ptr + row * SPANS + span, tl.min(tl.where(best == top64, best_id, V), axis=0))


@triton.jit
def _pick_kernel(best_ptr, id_ptr, out_ptr, scores_ptr, stats_ptr, logprob_ptr, V, stride, SPANS,
                 LANES: tl.constexpr, SHIFTED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, LANES)
    ok = lanes < SPANS
    best = tl.load(best_ptr + row * SPANS + lanes, mask=ok, other=float("-inf"))
    ids = tl.load(id_ptr + row * SPANS + lanes, mask=ok, other=V)
    top = tl.max(best, axis=0)
    token = tl.min(tl.where(best == top, ids, V), axis=0)
    tl.store(out_ptr + row, token)
    if SHIFTED:
        logprob = _scores(scores_ptr + row * stride, token, True, stats_ptr + 2 * row, True)
        tl.store(logprob_ptr + row, logprob)


def gumbel_argmax(scores: torch.Tensor, state: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
    """argmax(scores [N, V] + noise) per row -> [N] int64, ties to the lower id; state [N] int64 in
    [0, 2^32); rows not `noisy` (greedy) add no noise.
    """
    return draw(scores, state, noisy, SLACK)


def log_softmax_draw(logits: torch.Tensor, state: torch.Tensor,
                     noisy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`gumbel_argmax(log_softmax(logits))` and the drawn tokens' log-probs, ([N] int64, [N] float32),
    for logits [N, V] of any float dtype (bf16 read as it is: widening to float32 is exact). The
    log-probs are formed in registers from one row-stats pass (`softmax.row_stats`), so the [N, V]
    float32 copy, log-softmax's table and the draw's read of it are three passes saved; the same bits,
    since `log_softmax`'s values are the same (x - m) - log-sum of the same stats."""
    return _draw(logits, state, noisy, SLACK, softmax.row_stats(logits))


def draw(scores: torch.Tensor, state: torch.Tensor, noisy: torch.Tensor, slack: float) -> torch.Tensor:
    """`gumbel_argmax` with the float32 filter's margin `slack` (a test's too thin one shows its use)."""
    return _draw(scores, state, noisy, slack, None)[0]


def _draw(scores: torch.Tensor, state: torch.Tensor, noisy: torch.Tensor, slack: float,
          stats: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tokens [N] of scores (stats [N, 2]: of log_softmax(scores)) and, with stats, their log-probs [N]."""
    n, v = scores.shape
    if v >= 2**31:
        raise ValueError(f"gumbel_argmax hashes token ids in 32 bits; a vocabulary of {v} ids is too large")
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    out = torch.empty(n, dtype=torch.int64, device=scores.device)
    shifted = stats is not None
    logprobs = torch.empty(n, dtype=torch.float32, device=scores.device) if shifted else None
    if n:
        spans = triton.cdiv(v, SPAN)
        best = torch.empty((n, spans), dtype=torch.float64, device=scores.device)
        ids = torch.empty((n, spans), dtype=torch.int64, device=scores.device)
        stats_arg = stats if shifted else best  # not read unless shifted
        _gumbel_span_kernel[(n, spans)](scores, stats_arg, state, noisy.to(torch.int8), best, ids, v,
                                        scores.stride(0), spans, slack, BLOCK=BLOCK, CHUNKS=CHUNKS,
                                        SHIFTED=shifted, num_warps=8)
        _pick_kernel[(n,)](best, ids, out, scores, stats_arg, logprobs if shifted else best, v,
                           scores.stride(0), spans, LANES=triton.next_power_of_2(spans), SHIFTED=shifted,
                           num_warps=1)
    return out, logprobs
