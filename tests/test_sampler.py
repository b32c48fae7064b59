"""Processed logprobs: one definition for the engine and the training forward, row by row.

Every reduction over the vocabulary (the top-p prefix sum, the renormalizing sum, the logsumexp)
must give a row the same bits whatever rows share the call: the engine computes a decode step
of a few rows, the training forward thousands. Proven over the sampling grid on real vocabulary
sizes, with a negative control that gives one path a scan whose order follows the row count
(what torch's CUDA scan does), and shows the comparison catches it.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parity import kernels
from parity.engine import sampler
from parity.engine.sampler import RowParams, processed_logprobs
from parity.kernels import ops
from parity.kernels.cpu import pointwise
from parity.kernels.cpu_sampling import gumbel_noise
from parity.kernels.sampling import mix32
from parity.monitor.summary import bounded_threads

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not CUDA, reason="needs an NVIDIA GPU (CUDA not available)")])]
VOCABS = [32000, 151936]
ROWS = 12
#: the sampling grid every parity check covers: temperature x top_p x top_k.
GRID = [(t, p, k) for t in (0.6, 1.0, 1.2) for p in (1.0, 0.9) for k in (0, 40)]

pytestmark = pytest.mark.usefixtures("one_thread")


def _logits(vocab: int, device: str, rows: int = ROWS) -> torch.Tensor:
    """Near-uniform logits, as a random-weight model gives: the top-p cut lands among thousands of
    tokens of almost equal mass, where a change in the prefix sum's rounding can move it."""
    g = torch.Generator().manual_seed(0)
    return (torch.randn(rows, vocab, generator=g) * 0.5).to(device)


def _params(settings_per_row: list[tuple[float, float, int]]) -> RowParams:
    return RowParams.of([t for t, _, _ in settings_per_row], [k for _, _, k in settings_per_row],
                        [p for _, p, _ in settings_per_row])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", VOCABS)
@settings(max_examples=8)
@given(grid=st.lists(st.sampled_from(GRID), min_size=ROWS, max_size=ROWS),
       rows=st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=ROWS))
def test_processed_logprobs_of_a_row_do_not_depend_on_the_batch(device, vocab, grid, rows):
    logits = _logits(vocab, device)
    with kernels.invariant():
        full = processed_logprobs(logits, _params(grid))
        part = processed_logprobs(logits[rows], _params([grid[i] for i in rows]))
    assert torch.equal(part, full[rows])


def _scan_following_the_row_count(x: torch.Tensor) -> torch.Tensor:
    """A prefix sum whose order depends on how many rows share the call, like a stock GPU scan:
    a float32 log-step scan (each step adds the value `shift` places back) for more than 4 rows,
    the sequential scan otherwise."""
    if x.shape[0] <= 4:
        return torch.cumsum(x, dim=-1)
    shift = 1
    while shift < x.shape[-1]:
        x = torch.cat([x[:, :shift], x[:, shift:] + x[:, :-shift]], dim=-1)
        shift *= 2
    return x


def test_negative_control_a_scan_that_follows_the_row_count_is_caught():
    logits = _logits(151936, "cpu")
    with kernels.invariant():
        sorted_probs = torch.sort(ops.softmax(logits), dim=-1, descending=True, stable=True).values
        mass = ops.cumsum(sorted_probs)
    # Each row's top_p is its own prefix mass at ~90% (as the sequential scan rounds it): the cut
    # then sits exactly on a prefix sum, so any other rounding of that sum moves it.
    top_p = [float(row[int((row < 0.9).sum())]) for row in mass]
    params = [(1.0, p, 0) for p in top_p]

    def full_and_one_by_one() -> tuple[torch.Tensor, torch.Tensor]:
        with kernels.invariant():
            one_by_one = [processed_logprobs(logits[i:i + 1], _params([params[i]])) for i in range(ROWS)]
            return processed_logprobs(logits, _params(params)), torch.cat(one_by_one)

    assert torch.equal(*full_and_one_by_one())
    with kernels.switch.replaced("softmax", "cumsum", "cpu", _scan_following_the_row_count):
        assert not torch.equal(*full_and_one_by_one())


def _noise_as_written(keys: list[tuple[int, int, int]], vocab: int) -> torch.Tensor:
    """The Gumbel noise formula on whole [N, vocab] tensors, one op per step (what `gumbel_noise`
    computes in cached row blocks and in place)."""
    state = sampler.key_state(keys, "cpu").unsqueeze(1)
    token = torch.arange(vocab, dtype=torch.int64)
    high = mix32(state ^ mix32(2 * token))
    low = mix32(state ^ mix32(2 * token + 1))
    uniform = (((high << 21) | (low >> 11)).to(torch.float64) + 0.5) / 2.0**53
    return pointwise(lambda u: -torch.log(-torch.log(u)), uniform)


@given(keys=st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 3), st.integers(0, 2**20)),
                     min_size=1, max_size=7),
       vocab=st.sampled_from([1, 63, 1000, 16385, 49152]), threads=st.sampled_from([1, 2]))
@settings(max_examples=25, deadline=None)
def test_gumbel_noise_is_the_formula_and_a_row_does_not_depend_on_the_batch(keys, vocab, threads):
    with bounded_threads(threads):
        noise = gumbel_noise(sampler.key_state(keys, "cpu"), vocab)
        assert torch.equal(noise, _noise_as_written(keys, vocab))
        for i, key in enumerate(keys):
            assert torch.equal(gumbel_noise(sampler.key_state([key], "cpu"), vocab), noise[i:i + 1])


def test_the_draw_is_a_pointwise_op_behind_the_switch():
    """With family "pointwise" on, `sample` runs the registered CPU draw (the noise above); with it off,
    the stock formula. Both draw the same tokens here; greedy rows (None keys) take the argmax."""
    g = torch.Generator().manual_seed(5)
    processed = torch.log_softmax(torch.randn(5, 3000, generator=g) * 3, dim=-1)
    keys = [(7, 0, 3), None, (2**40 + 7, 1, 9), (7, 0, 4), None]
    calls = []
    registered = kernels.switch.registrations("cpu")[("pointwise", "gumbel_argmax", "cpu")]

    def counting(*args: torch.Tensor) -> torch.Tensor:
        calls.append(len(args[0]))
        return registered(*args)

    with kernels.switch.replaced("pointwise", "gumbel_argmax", "cpu", counting):
        with kernels.invariant(["pointwise"]):
            invariant = sampler.sample(processed, keys)
        assert calls == [5]
        with kernels.native():
            stock = sampler.sample(processed, keys)
        assert calls == [5]
    noise = gumbel_noise(sampler.key_state([key or (0, 0, 0) for key in keys], "cpu"), 3000)
    noise[[1, 4]] = 0.0
    assert torch.equal(invariant, (processed.double() + noise).argmax(dim=-1))
    assert torch.equal(stock, invariant)
    assert invariant[1] == processed[1].argmax() and invariant[4] == processed[4].argmax()


def _state_as_written(keys: list[tuple[int, int, int]]) -> torch.Tensor:
    """The key state's definition on int64 tensors: the words folded by `mix32`, position first."""
    rows = torch.tensor([[s & 0xFFFFFFFF, (s >> 32) & 0xFFFFFFFF, a & 0xFFFFFFFF, p & 0xFFFFFFFF]
                         for s, a, p in keys], dtype=torch.int64).view(-1, 4)
    state = mix32(rows[:, 3])
    for column in (2, 1, 0):
        state = mix32(rows[:, column] ^ state)
    return state


@given(keys=st.lists(st.tuples(st.integers(-2**65, 2**70), st.integers(0, 2**33), st.integers(0, 2**33)),
                     max_size=40))
@settings(max_examples=60, deadline=None)
def test_the_key_state_folds_the_same_words_as_its_definition(keys):
    """`key_state` hashes in numpy; the integers are those of the int64 torch form, for seeds past
    64 bits or negative and indices past 32 bits (each word taken mod 2^32)."""
    assert torch.equal(sampler.key_state(keys, "cpu"), _state_as_written(keys))
