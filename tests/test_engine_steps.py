"""Engine step shapes that must not change any token's numbers: fixed-size padded steps (the shapes
CUDA graphs replay) and the per-step token budget that bounds prefill steps."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine import workloads

from parity import Request, SamplingParams
from parity.backends.reference import ReferenceBackend
from parity.core.errors import ConfigError, InputError
from parity.engine import EngineConfig, ReferenceEngine, train_forward
from parity.engine.graphs import bucket_sizes
from parity.engine.scheduler import Scheduler, Sequence

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bucket_sizes_pad_a_step_to_at_most_twice_its_tokens():
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(12) == (1, 2, 4, 8, 12)
    assert bucket_sizes(16) == (1, 2, 4, 8, 16)
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        ReferenceEngine("tiny-llama", max_num_batched_tokens=0)


@pytest.mark.slow
def test_native_attention_steps_read_power_of_two_spans():
    """Stock attention gathers `span` cached positions per token: graphs are bucketed by span too."""
    requests = [Request(tuple(range(3, 3 + n)), SamplingParams(n=1, max_tokens=40, seed=n), request_id=str(n))
                for n in (5, 100)]
    engine = ReferenceEngine("tiny-llama", kernels="native", max_num_seqs=2, graphs=True)
    engine.generate(requests)
    block, capacity = engine._cache.block, engine._cache.capacity
    assert capacity == 5 * block  # decode positions 100..139: 4 blocks, then 5 (8, capped)
    assert sorted({span for _, span, _ in engine._graphs._buckets}) == [block * 4, capacity]
    invariant = ReferenceEngine("tiny-llama", max_num_seqs=2, graphs=True)
    invariant.generate(requests)
    assert {span for _, span, _ in invariant._graphs._buckets} == {invariant._cache.capacity}


@pytest.mark.parametrize("model,dtype", [("tiny-qwen3", "bfloat16"), ("tiny-qwen3-moe", "float32"),
                                         ("tiny-llama", "float32")])
@settings(max_examples=8, deadline=None)
@given(work=workloads(), budget=st.integers(1, 40))
@pytest.mark.slow
def test_padded_budgeted_steps_equal_train_forward_bitwise(model, dtype, work, budget):
    """graphs=True on CPU runs every step of up to max_num_seqs tokens padded to a bucket size, with
    pad tokens in the spare KV slot; a small token budget splits steps further."""
    engine = ReferenceEngine(model, dtype=dtype, max_num_seqs=work["max_num_seqs"],
                             chunk_size=work["chunk_size"], max_num_batched_tokens=budget, graphs=True)
    rollouts = engine.generate(work["requests"])
    if any(len(rollout.token_ids) > 1 for rollout in rollouts):  # one token each: prefill only, no decode
        assert engine._graphs is not None and engine._graphs._buckets  # decode steps ran padded
    scores = train_forward(model, rollouts, dtype=dtype, micro_batch_size=work["micro_batch_size"],
                           layout=work["layout"]).logprobs
    plain = ReferenceEngine(model, dtype=dtype, max_num_seqs=3, chunk_size=64, graphs=False)
    expected = plain.generate(work["requests"])
    for rollout, score, other in zip(rollouts, scores, expected):
        assert torch.equal(score, torch.tensor(rollout.logprobs, dtype=torch.float32))
        assert (rollout.token_ids, rollout.logprobs, rollout.finish_reason) == \
            (other.token_ids, other.logprobs, other.finish_reason)


@pytest.mark.slow
def test_budget_bounds_every_step():
    """No forward packs more than max_num_batched_tokens tokens, and routes still line up (recorded
    inside the padded fixed-size steps that graphs run)."""
    requests = [Request(tuple(range(3, 3 + n)), SamplingParams(n=2, max_tokens=5, seed=n), request_id=str(n))
                for n in (9, 40, 70)]
    engine = ReferenceEngine("tiny-qwen3-moe", max_num_seqs=6, chunk_size=32, max_num_batched_tokens=10,
                             record_routes=True, graphs=True)
    seen = []
    forward = engine._forward

    def spy(step, pending=None):
        seen.append(len(step.ids))
        return forward(step, pending)

    engine._forward = spy
    rollouts = engine.generate(requests)
    assert max(seen) == 10 and engine._graphs is not None
    scored = train_forward("tiny-qwen3-moe", rollouts, layout="packed", record_routes=True)
    for rollout, score, route in zip(rollouts, scored.logprobs, scored.routes):
        assert torch.equal(score, torch.tensor(rollout.logprobs, dtype=torch.float32))
        assert np.array_equal(route.numpy(), rollout.routed_experts)


def test_scheduler_admits_fifo_packs_within_budget_and_frees_slots():
    """The scheduler alone: FIFO admission into the lowest free slots, prefill chunks then decode
    tokens under the step budget, and slots freed by finished sequences go to waiting ones."""
    sequences = [Sequence(Request(tuple(range(3, 3 + n)), SamplingParams(max_tokens=m, ignore_eos=True)), 0)
                 for n, m in ((5, 1), (3, 2), (4, 1))]
    scheduler = Scheduler(sequences, max_num_seqs=2, chunk_size=4, max_num_batched_tokens=6,
                          eos_token_ids=(2,))
    scheduler.admit()
    assert [s.slot for s in scheduler.running] == [0, 1] and list(scheduler.waiting) == [sequences[2]]
    step = scheduler.plan()  # 4 prompt tokens of the first, then 2 of the second: the budget is spent
    assert [(sp.seq, sp.offset, sp.count) for sp in step.spans] == \
        [(sequences[0], 0, 4), (sequences[1], 4, 2)]
    assert step.ids == [3, 4, 5, 6, 3, 4] and step.positions == [0, 1, 2, 3, 0, 1]
    assert step.slots == [0, 0, 0, 0, 1, 1] and step.ready == ()
    scheduler.finish(step.ready, [], [])
    step = scheduler.plan()
    assert [(sp.offset, sp.count) for sp in step.spans] == [(0, 1), (1, 1)]
    assert [sp.seq for sp in step.ready] == sequences[:2] and [sp.last_row for sp in step.ready] == [0, 1]
    scheduler.finish(step.ready, [9, 2], [-0.5, -1.5])  # 2 is EOS, ignored; the first hits max_tokens
    assert sequences[0].finish_reason == "length" and sequences[1].finish_reason is None
    assert sequences[1].tokens == [2] and sequences[1].logprobs == [-1.5]
    scheduler.admit()
    assert sequences[2].slot == 0 and scheduler.running == [sequences[1], sequences[2]]
    step = scheduler.plan()  # the second's sampled token, then the third's whole prompt
    assert step.ids == [2, 3, 4, 5, 6] and step.positions == [3, 0, 1, 2, 3]
    assert [sp.seq for sp in step.ready] == [sequences[1], sequences[2]]
    scheduler.finish(step.ready, [7, 8], [0.0, 0.0])
    assert scheduler.done and [s.finish_reason for s in sequences] == ["length"] * 3


def test_engine_and_reference_backend_take_one_engine_config():
    config = EngineConfig(max_num_seqs=3, chunk_size=5, max_num_batched_tokens=7, graphs=True)
    assert ReferenceEngine("tiny-llama", config).config == config
    assert ReferenceEngine("tiny-llama", config, chunk_size=9).config == config.replace(chunk_size=9)
    with ReferenceBackend("tiny-llama", dtype="float32", max_num_seqs=3, chunk_size=5,
                          max_num_batched_tokens=7, graphs=True) as backend:
        assert backend.config == config
        rollout, = backend.generate([Request((5, 6), SamplingParams(max_tokens=2))])
    assert rollout.meta["max_num_batched_tokens"] == 7 and rollout.meta["step_graphs"] == "eager (cpu)"
    with pytest.raises(ConfigError, match=r"unknown engine setting\(s\) \['chunksize'\].*'chunk_size'"):
        ReferenceEngine("tiny-llama", chunksize=8)
    with pytest.raises(ConfigError, match="unknown engine setting"):
        ReferenceBackend("tiny-llama", max_batched_tokens=8)
    with pytest.raises(ConfigError, match="record_routes"):
        EngineConfig(record_routes="yes")
    with pytest.raises(ConfigError, match="graphs"):
        EngineConfig(graphs=1)


@pytest.mark.parametrize("kernels", ["invariant", "native"])
@pytest.mark.slow
def test_warm_up_prepares_every_step_shape_and_changes_no_bits(kernels):
    """After warm_up(max_length) a generate within it makes no new graph bucket (nothing compiled or
    captured while timed) and gives the bits of an engine that was not warmed; the control: without
    warm-up the same generate makes its buckets as it goes."""
    requests = [Request(tuple(range(3, 3 + n)), SamplingParams(n=2, max_tokens=12, seed=n), request_id=str(n))
                for n in (5, 30)]
    longest = 30 + 12
    warmed = ReferenceEngine("tiny-qwen3", dtype="bfloat16", kernels=kernels, max_num_seqs=4,
                             max_num_batched_tokens=48, graphs=True)
    assert warmed.warm_up(longest) > 0
    before = set(warmed._graphs._buckets)
    rollouts = warmed.generate(requests)
    assert set(warmed._graphs._buckets) == before
    cold = ReferenceEngine("tiny-qwen3", dtype="bfloat16", kernels=kernels, max_num_seqs=4,
                           max_num_batched_tokens=48, graphs=True)
    expected = cold.generate(requests)
    assert len(cold._graphs._buckets) > 0  # the control: an unwarmed engine makes them while it runs
    with pytest.raises(InputError, match="warm_up max_length"):
        warmed.warm_up(10**9)
    for rollout, other in zip(rollouts, expected):
        assert rollout.token_ids == other.token_ids
        assert np.array_equal(np.asarray(rollout.logprobs), np.asarray(other.logprobs))
    scores = train_forward("tiny-qwen3", rollouts, dtype="bfloat16", kernels=kernels).logprobs
    if kernels == "invariant":
        for rollout, score in zip(rollouts, scores):
            assert torch.equal(score, torch.tensor(rollout.logprobs, dtype=torch.float32))
