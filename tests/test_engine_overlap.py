"""Overlapped steps (`overlap`): step N+1 planned and launched before step N's tokens reach the host
must give every rollout the same tokens, logprobs and finish reasons as steps run one by one."""

import random

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis_controls import ci_examples, examples_until_failure

from parity import Request, SamplingParams
from parity.core.errors import InputError
from parity.core.turns import Generate, Inject
from parity.engine import ReferenceEngine, train_forward
from parity.engine import overlap as overlap_module
from parity.engine.scheduler import Scheduler, Sequence

pytestmark = pytest.mark.usefixtures("one_thread")


@st.composite
def stopping_workloads(draw):
    """Requests that stop early and often (stop-token sets hit every few tokens), sampled and greedy,
    in engines whose slots and budgets make sequences wait for each other."""
    requests = []
    for i in range(draw(st.integers(1, 5))):
        rng = random.Random(draw(st.integers(0, 2**16)))
        every = draw(st.sampled_from([0, 3, 5, 11]))
        sampling = SamplingParams(
            n=draw(st.integers(1, 3)), temperature=draw(st.sampled_from([0.0, 1.0, 1.3])),
            max_tokens=draw(st.integers(1, 12)), seed=draw(st.integers(0, 2**16)),
            stop_token_ids=tuple(range(draw(st.integers(3, 9)), 512, every)) if every else (),
            ignore_eos=draw(st.booleans()))
        prompt = tuple(rng.randrange(3, 512) for _ in range(draw(st.integers(1, 40))))
        requests.append(Request(prompt, sampling, request_id=f"r{i}"))
    return {"requests": requests, "max_num_seqs": draw(st.integers(1, 5)),
            "chunk_size": draw(st.integers(1, 24)), "budget": draw(st.integers(1, 30))}


def _generate(work, overlap):
    engine = ReferenceEngine("tiny-llama", max_num_seqs=work["max_num_seqs"], chunk_size=work["chunk_size"],
                             max_num_batched_tokens=work["budget"], overlap=overlap)
    return engine.generate(work["requests"])


def _same_rollouts(work):
    steady, overlapped = _generate(work, False), _generate(work, True)
    for a, b in zip(steady, overlapped, strict=True):
        assert (a.token_ids, a.logprobs, a.finish_reason) == (b.token_ids, b.logprobs, b.finish_reason)


@ci_examples(12)
@given(work=stopping_workloads())
def test_overlapped_steps_give_the_same_rollouts(work):
    _same_rollouts(work)


def test_the_property_fails_when_a_row_takes_another_sequences_token(request, monkeypatch):
    """Negative control: a fill that hands each decode row the next sequence's pending token."""
    real = overlap_module.Draw.fill

    def shifted(self, fills):
        fill = real(self, fills)
        return overlap_module.Fill(fill.rows, fill.tokens.roll(1))

    monkeypatch.setattr(overlap_module.Draw, "fill", shifted)
    examples_until_failure(test_overlapped_steps_give_the_same_rollouts, None,
                           {"work": stopping_workloads()}, _same_rollouts)


def _same_routes(work):
    """With recorded routes (MoE): the same rollouts and routes [positions, layers, k], each
    sequence's covering exactly its computed positions (not the row computed in vain)."""
    got = {}
    for overlap in (False, True):
        engine = ReferenceEngine("tiny-qwen3-moe", max_num_seqs=work["max_num_seqs"],
                                 chunk_size=work["chunk_size"],
                                 max_num_batched_tokens=work["budget"], overlap=overlap, record_routes=True)
        got[overlap] = engine.generate(work["requests"])
    for a, b in zip(got[False], got[True], strict=True):
        assert (a.token_ids, a.logprobs, a.finish_reason) == (b.token_ids, b.logprobs, b.finish_reason)
        assert b.routed_experts.shape[0] == len(b.prompt_ids) + len(b.token_ids) - 1
        assert np.array_equal(a.routed_experts, b.routed_experts)


@ci_examples(8)
@given(work=stopping_workloads())
def test_overlapped_steps_record_the_same_routes(work):
    _same_routes(work)


def test_the_routes_property_fails_when_a_row_computed_in_vain_is_kept(monkeypatch):
    """Negative control: routes that keep the row of a sequence stopped the step before (the
    rollout's own check refuses routes longer than its positions: counted as the failure)."""
    monkeypatch.setattr(overlap_module.Routes, "live", lambda self: self)

    def broken(work):
        try:
            _same_routes(work)
        except InputError as exc:
            raise AssertionError(str(exc)) from exc

    examples_until_failure(test_overlapped_steps_record_the_same_routes, None,
                           {"work": stopping_workloads()}, broken)


def test_routes_are_written_in_place_and_grow_past_the_expected_length():
    """A step's rows land after the sequence's earlier ones in one buffer that doubles up to
    max_tokens' positions (prompt 3 + 4 tokens - 1 = 6), not sized for them up front; a seventh row
    (a trajectory's injected tokens) grows it past them and keeps what was written."""
    seq = Sequence(Request((3, 4, 5), SamplingParams(max_tokens=4)), 0)
    steps = [np.full((n, 2, 3), i, dtype=np.int32) for i, n in enumerate((3, 1, 2, 1))]
    overlap_module.append_routes(seq, steps[0])
    assert seq.routes.shape == (3, 2, 3) and seq.routes_len == 3
    overlap_module.append_routes(seq, steps[1])
    overlap_module.append_routes(seq, steps[2])
    assert seq.routes.shape == (6, 2, 3) and seq.routes_len == 6
    overlap_module.append_routes(seq, steps[3])
    assert seq.routes.shape[0] >= 7 and seq.routes_len == 7
    assert np.array_equal(seq.routes[:7], np.concatenate(steps))


def test_a_sequence_stopped_by_its_token_drops_the_row_planned_after_it():
    """The scheduler alone, overlapped: a sequence sampled in step 1 decodes its pending token in
    step 2 (a fill row) before step 1's tokens are read; it stops on that token (EOS), so step 2's
    token for it is dropped and its slot goes to the waiting sequence."""
    sequences = [Sequence(Request((3, 4), SamplingParams(max_tokens=5)), 0),
                 Sequence(Request((5,), SamplingParams(max_tokens=5)), 0)]
    scheduler = Scheduler(sequences, max_num_seqs=1, chunk_size=4, max_num_batched_tokens=8,
                          eos_token_ids=(2,), overlap=True)
    scheduler.admit()
    first = scheduler.plan()
    assert first.ids == [3, 4] and first.fills == () and sequences[0].pending == 1
    scheduler.admit()
    second = scheduler.plan()  # planned before the first step's token is known
    assert second.ids == [0] and second.positions == [2] and second.fills == ((0, sequences[0]),)
    assert [span.seq for span in second.ready] == [sequences[0]] and sequences[0].pending == 2
    scheduler.finish(first.ready, [2], [-0.25])  # EOS
    assert sequences[0].finish_reason == "stop" and sequences[0].tokens == [2]
    assert scheduler.free_slots == [0]
    scheduler.admit()
    assert sequences[1].slot == 0
    scheduler.finish(second.ready, [7], [-1.0])  # the row computed in vain
    assert sequences[0].tokens == [2] and sequences[0].logprobs == [-0.25] and sequences[0].pending == 0


def test_a_pending_last_token_is_not_planned_again():
    """A sequence whose pending token fills max_tokens has nothing left to compute."""
    seq = Sequence(Request((3, 4), SamplingParams(max_tokens=1)), 0)
    scheduler = Scheduler([seq], max_num_seqs=1, chunk_size=4, max_num_batched_tokens=8, eos_token_ids=(),
                          overlap=True)
    scheduler.admit()
    scheduler.plan()
    assert seq.pending == 1 and seq.to_compute == 0 and scheduler.plan().spans == ()


def test_overlap_is_off_where_a_token_decides_the_next_step_on_the_host():
    """On by default on CUDA only; never with trajectories or top-k logprobs (recorded routes are
    read a step late like the tokens)."""
    plain = [Request((3, 4), SamplingParams(max_tokens=2))]
    engine = ReferenceEngine("tiny-llama", overlap=True)
    assert engine._overlaps(plain)
    assert not engine._overlaps([Request((3, 4), SamplingParams(max_tokens=2, top_k_logprobs=2))])
    turns = (Generate(max_tokens=2), Inject((5, 6)), Generate(max_tokens=2))
    assert not engine._overlaps([Request((3, 4), SamplingParams(max_tokens=8), turns=turns)])
    assert not ReferenceEngine("tiny-llama")._overlaps(plain)
    assert ReferenceEngine("tiny-qwen3-moe", overlap=True, record_routes=True)._overlaps(plain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")
def test_overlapped_cuda_graph_steps_equal_steady_steps_and_the_training_forward():
    """On CUDA (on by default there) decode rows read the last step's tokens on the device inside the
    replayed graphs' inputs; sequences stop early on a stop-token set."""
    got = _overlapped_and_steady_on_cuda("tiny-qwen3", (3, 11, 30, 64), 24, max_num_seqs=5, chunk_size=16)
    scored = train_forward("tiny-qwen3", got[None], device="cuda", dtype="bfloat16")
    for rollout, score in zip(got[None], scored.logprobs):
        assert torch.equal(score.cpu(), torch.tensor(rollout.logprobs, dtype=torch.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")
def test_overlapped_cuda_graph_steps_record_the_routes_of_steady_steps():
    """Routes written by the replayed graphs reach the host a step late; a sequence stopped on a
    stop token keeps none of the row computed after it."""
    got = _overlapped_and_steady_on_cuda("tiny-qwen3-moe", (3, 11, 30), 16, record_routes=True,
                                         max_num_seqs=4, chunk_size=8, graphs=True)
    for a, b in zip(got[None], got[False], strict=True):
        assert np.array_equal(a.routed_experts, b.routed_experts)


def _overlapped_and_steady_on_cuda(model, prompt_lengths, max_tokens, **options):
    """Rollouts of CUDA-graph engines overlapped (None: the default there) and step by step (False),
    checked equal; sequences stop early on a stop-token set."""
    requests = [Request(tuple(range(3, 3 + n)), SamplingParams(n=2, max_tokens=max_tokens, seed=n,
                                                               stop_token_ids=tuple(range(5, 512, 13))),
                        request_id=str(n)) for n in prompt_lengths]
    got = {}
    for overlap in (None, False):
        with ReferenceEngine(model, device="cuda", dtype="bfloat16", overlap=overlap, **options) as engine:
            assert engine._overlaps(requests) == (overlap is None)
            got[overlap] = engine.generate(requests)
            assert engine._graphs.status == "cuda graphs"
    assert any(r.finish_reason == "stop" for r in got[None])
    for a, b in zip(got[None], got[False], strict=True):
        assert (a.token_ids, a.logprobs, a.finish_reason) == (b.token_ids, b.logprobs, b.finish_reason)
    return got
