"""The fused CUDA sampling kernel draws exactly what the CPU draw and the stock formula draw, row by row.

Without a GPU it runs on CPU tensors under Triton's interpreter, in a child process started with
`TRITON_INTERPRET=1` (the interpreter must be chosen before triton is imported; see
tests/interpreter.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from interpreter import run_interpreted

pytest.importorskip("triton")

import triton  # after the skip: Triton is optional
import triton.language as tl

from parity.kernels.triton import sampling

CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
runs_here = pytest.mark.skipif(not (CUDA or INTERPRETED), reason="runs on CUDA or under the interpreter")


@triton.jit
def _both_noises(high_ptr, low_ptr, out32_ptr, out64_ptr, n, BLOCK: tl.constexpr):
    """The sampler's float32 and float64 noise of each (high, low) hash word pair."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    high = tl.load(high_ptr + i, mask=ok).to(tl.uint32)
    low = tl.load(low_ptr + i, mask=ok).to(tl.uint32)
    tl.store(out32_ptr + i, sampling._noise32(high, low), mask=ok)
    tl.store(out64_ptr + i, sampling._noise64(high, low), mask=ok)


@pytest.mark.slow
@pytest.mark.skipif(CUDA or INTERPRETED, reason="the kernel tests run in this process")
def test_sampling_kernel_under_the_triton_interpreter_in_a_child_process() -> None:
    run_interpreted(__file__, min_passed=1, timeout=600)


def _draw(processed: torch.Tensor, keys: list) -> torch.Tensor:
    """The kernel's draw for `keys` (None: greedy), on processed's device."""
    from parity.engine.sampler import key_state
    from parity.kernels.triton.sampling import gumbel_argmax

    state = key_state([key or (0, 0, 0) for key in keys], processed.device)
    noisy = torch.tensor([key is not None for key in keys], device=processed.device)
    return gumbel_argmax(processed, state, noisy)


@runs_here
def test_kernel_draws_the_torch_samplers_tokens() -> None:
    from parity.engine.sampler import key_state
    from parity.kernels import sampling
    from parity.kernels.cpu_sampling import gumbel_noise

    device = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(0)
    vocab = 3000  # not a multiple of the kernel's chunk: the masked tail is exercised
    processed = torch.log_softmax(torch.randn(6, vocab, generator=g) * 3, dim=-1)
    processed[4, 100:] = float("-inf")  # a truncated (top-k) row
    processed[5] = 0.0  # every token ties: greedy picks token 0
    keys = [(7, 0, 3), (7, 1, 3), (2**40 + 7, 0, 3), (7, 0, 4), (11, 2, 9), None]
    state = key_state([key or (0, 0, 0) for key in keys], "cpu")
    noise = gumbel_noise(state, vocab)
    noise[5] = 0.0
    expected = (processed.double() + noise).argmax(dim=-1)
    got = _draw(processed.to(device), keys).cpu()
    assert torch.equal(got, expected)
    noisy = torch.tensor([key is not None for key in keys])
    stock = sampling.gumbel_argmax(processed.to(device), state.to(device), noisy.to(device))  # family off
    assert torch.equal(stock.cpu(), expected)
    assert got[5] == 0
    for i, key in enumerate(keys):  # a row drawn alone equals the row drawn in the batch
        assert torch.equal(_draw(processed[i:i + 1].to(device), [key]).cpu(), got[i:i + 1])


@runs_here
def test_a_row_split_over_spans_draws_the_lowest_id_at_its_maximum() -> None:
    """Rows longer than one program's span (`SPAN`): ties across spans go to the lower id, a span of
    -inf never wins, a row of -inf draws token 0; the same tokens as the float64 argmax on the CPU."""
    from parity.engine.sampler import key_state
    from parity.kernels.cpu_sampling import gumbel_noise
    from parity.kernels.triton.sampling import SPAN

    device = "cuda" if CUDA else "cpu"
    vocab = 2 * SPAN + 123
    g = torch.Generator().manual_seed(1)
    processed = torch.log_softmax(torch.randn(5, vocab, generator=g), dim=-1)
    processed[1, SPAN + 5] = processed[1, 2 * SPAN + 7] = 5.0  # greedy: a tie in the 2nd and 3rd spans
    processed[2, :SPAN] = float("-inf")  # the first span cannot win
    processed[2, vocab - 1] = 4.0
    processed[3] = float("-inf")  # nothing to draw: token 0, as argmax gives
    keys = [(3, 0, 1), None, (5, 1, 2), (9, 0, 0), None]
    state = key_state([key or (0, 0, 0) for key in keys], "cpu")
    noise = gumbel_noise(state, vocab)
    noise[[1, 4]] = 0.0
    expected = (processed.double() + noise).argmax(dim=-1)
    got = _draw(processed.to(device), keys).cpu()
    assert torch.equal(got, expected)
    assert got[1] == SPAN + 5 and got[2] == vocab - 1 and got[3] == 0


def _near_ties(rows: int) -> tuple[torch.Tensor, list, torch.Tensor]:
    """Rows whose two best noisy scores, in chunks 0 and 5 of one span, lie ~1e-9..1e-8 apart
    (far above float64's rounding, far below float32's); the rest score 30 lower. Returns the
    scores [rows, V] float32, the keys and the float64 argmax on the CPU."""
    from parity.engine.sampler import key_state
    from parity.kernels.cpu_sampling import gumbel_noise
    from parity.kernels.triton.sampling import BLOCK

    vocab = 6 * BLOCK
    keys = [(101, r, 7) for r in range(rows)]
    noise = gumbel_noise(key_state(keys, "cpu"), vocab)
    g = torch.Generator().manual_seed(5)
    scores = torch.full((rows, vocab), -30.0)
    for r in range(rows):
        a = int(torch.randint(0, BLOCK, (1,), generator=g))
        b = 5 * BLOCK + int(torch.randint(0, BLOCK, (1,), generator=g))
        scores[r, a] = 1.0 - noise[r, a]
        gap = float(torch.rand(1, generator=g)) * 9e-9 + 1e-9
        scores[r, b] = (scores[r, a].double() + noise[r, a] - noise[r, b] + gap).float()
    return scores, keys, (scores.double() + noise).argmax(dim=-1)


@runs_here
def test_near_ties_across_chunks_draw_the_float64_maximum() -> None:
    """The float32 filter keeps every chunk that may hold the maximum: near ties far below float32's
    resolution draw the float64 argmax. Negative control: with no margin the filter keeps only the
    chunk of the float32 maximum, and some rows draw the other token."""
    from parity.engine.sampler import key_state

    device = "cuda" if CUDA else "cpu"
    scores, keys, expected = _near_ties(32)
    state = key_state(keys, device)
    noisy = torch.ones(len(keys), dtype=torch.bool, device=device)
    got = sampling.draw(scores.to(device), state, noisy, sampling.SLACK).cpu()
    assert torch.equal(got, expected)
    thin = sampling.draw(scores.to(device), state, noisy, 0.0).cpu()
    assert not torch.equal(thin, expected)


@runs_here
def test_the_float32_noise_lies_well_within_half_the_margin_of_the_float64_noise() -> None:
    """|noise32 - noise64| over random hash words and the extremes (u next to 0, 1/2 and 1, where
    float64 rounds k + 1/2 to even, and around the series' switch at 1 - u = 2^-6): a few float32
    ulps, far below SLACK / 2; both +inf where float64's u is 1."""
    device = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(3)
    words = torch.randint(0, 2**32, (2, 1 << 16), generator=g, dtype=torch.int64)
    switch = (2**32 - 2**26) + torch.arange(-64, 64)  # high words where 1 - u crosses 2^-6
    edges = torch.tensor([[0, 0], [0, 2**32 - 1], [2**31 - 1, 2**32 - 1], [2**31, 0], [2**32 - 1, 2**32 - 1],
                          [2**32 - 1, 0]]).T
    near_one = torch.stack([torch.full((128,), 2**32 - 1), ((2**21 - 1 - torch.arange(128)) << 11) + 5])
    words = torch.cat([words, edges, torch.stack([switch, torch.zeros_like(switch)]), near_one], dim=1)
    top_word = (words[0] == 2**32 - 1) & (words[1] >> 11 == 2**21 - 1)  # k = 2^53 - 1: u rounds to 1
    words = words.to(device)
    n = words.shape[1]
    out32 = torch.empty(n, dtype=torch.float32, device=device)
    out64 = torch.empty(n, dtype=torch.float64, device=device)
    high, low = words[0].contiguous(), words[1].contiguous()
    _both_noises[(triton.cdiv(n, 1024),)](high, low, out32, out64, n, BLOCK=1024)
    infinite = out64.isinf()
    assert torch.equal(infinite.cpu(), top_word) and torch.equal(out32.isinf(), infinite)
    assert bool((out32[infinite] > 0).all())
    error = (out32.double() - out64)[~infinite].abs().max().item()
    assert error < sampling.SLACK / 20, error


@runs_here
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_draw_is_log_softmax_then_the_draw_bit_for_bit(dtype: torch.dtype) -> None:
    """`log_softmax_draw` on the logits as the model leaves them: the tokens of `gumbel_argmax` on
    log_softmax of the float32 logits and those log-probs, bit for bit; each row alone the same."""
    from parity.engine.sampler import key_state
    from parity.kernels.triton import softmax

    device = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(4)
    vocab = sampling.SPAN + 777  # two spans, a masked tail
    logits = (torch.randn(4, vocab, generator=g) * 4).to(dtype).to(device)
    logits[3, :vocab // 2] = -60.0  # the best tokens all in the second span
    keys = [(13, r, 40 + r) for r in range(4)]
    state = key_state(keys, device)
    noisy = torch.ones(4, dtype=torch.bool, device=device)
    tokens, logprobs = sampling.log_softmax_draw(logits, state, noisy)
    processed = softmax.log_softmax(logits.float())
    assert torch.equal(tokens, sampling.gumbel_argmax(processed, state, noisy))
    assert torch.equal(logprobs, processed.gather(1, tokens.unsqueeze(1)).squeeze(1))
    assert int(tokens[3]) >= vocab // 2
    for r in (0, 3):
        alone = sampling.log_softmax_draw(logits[r:r + 1], state[r:r + 1], noisy[r:r + 1])
        assert torch.equal(alone[0], tokens[r:r + 1]) and torch.equal(alone[1], logprobs[r:r + 1])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="register layouts exist on the GPU only")
def test_log_softmax_of_bf16_logits_is_log_softmax_of_their_float32_widening() -> None:
    """The row stats of bf16 logits (8 per thread when loaded) equal those of their float32 copy (4 per
    thread): the lanes' sum is a fixed tree, not `tl.sum`'s layout-following order, so the fused draw's
    log-probs are the training forward's. Negative control: the same stats by `tl.sum` differ."""
    from parity.kernels.triton import softmax

    g = torch.Generator().manual_seed(8)
    x = (torch.randn(64, 151936, generator=g) * 3).to(torch.bfloat16).cuda()
    stats = softmax.row_stats(x)
    assert torch.equal(stats, softmax.row_stats(x.float()))
    row_max, log_total = stats.unbind(1)
    assert torch.equal(softmax.log_softmax(x.float()), (x.float() - row_max[:, None]) - log_total[:, None])
    assert not torch.equal(softmax.row_stats(x, tree=False), softmax.row_stats(x.float(), tree=False))
