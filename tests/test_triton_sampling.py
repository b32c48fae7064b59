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

CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
runs_here = pytest.mark.skipif(not (CUDA or INTERPRETED), reason="runs on CUDA or under the interpreter")


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
