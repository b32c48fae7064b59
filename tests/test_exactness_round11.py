"""Round 11 exactness: batch compositions and engine states the other engine tests do not draw, each
with a negative control that shows its check fails when invariance is off.

Covered here: a KV slot reused after a sequence whose float16 values overflowed (the defect fixed in
`ReferenceEngine._clear`: stale inf/NaN keys past a token's position reached the slot's next
sequence as 0 * inf, on CPU only in steps whose span covered them, so as a function of the batch);
n > 1 samples, multi-turn trajectories with injections at the 32-position blocks, stop ids that end
a request in the step others continue, raw and processed rows, plain rows beside processed ones (the
sampler's two paths), top-k logprobs, float16, a LoRA adapter and MoE routes, in one batch.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
import variant_gemm
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_controls import examples_until_failure

from parity import Request, SamplingParams
from parity.core.turns import Generate, Inject
from parity.engine import ReferenceEngine, train_forward
from parity.kernels import switch
from parity.models.loading import LoadedModel, copy_model, load_model

pytestmark = pytest.mark.usefixtures("one_thread")

# --- a reused KV slot after a float16 overflow ---------------------------------------------------

#: the token whose layer-0 value overflows float16 in the `overflowing` model.
HOT = 7
#: a healthy request, and one whose 41st token overflows (prefilled in 32-position chunks, its stale
#: cache is finite below position 32 and non-finite from 32 on).
VICTIM = Request(tuple(range(20, 30)), SamplingParams(max_tokens=3, seed=1, ignore_eos=True), request_id="v")
POISON = Request((*range(20, 60), HOT), SamplingParams(max_tokens=2, seed=2, ignore_eos=True), request_id="p")
#: a companion whose prefill takes the step's span past position 32 while VICTIM decodes (within
#: the cache POISON left: a longer one would allocate a fresh cache).
LONG = Request(tuple(range(100, 150)), SamplingParams(max_tokens=2, seed=3, ignore_eos=True), request_id="l")


@pytest.fixture(scope="module")
def overflowing() -> LoadedModel:
    """tiny-llama in float16 whose layer-0 v_proj row 0 points along token HOT's normed embedding with
    norm 1e5: HOT's value is inf (past 65504), every other token's stays finite."""
    lm = copy_model(load_model("tiny-llama", dtype="float16"))
    layer = lm.model.model.layers[0]
    with torch.no_grad():
        h = lm.model.model.embed_tokens.weight[HOT].float()
        h = h / h.pow(2).mean().sqrt() * layer.input_layernorm.weight.float()
        layer.self_attn.v_proj.weight[0] = (1e5 * h / h.pow(2).sum()).half()
    return lm


def _victim(engine: ReferenceEngine, requests: list[Request]) -> tuple:
    rollout = next(r for r in engine.generate(requests) if r.request_id == VICTIM.request_id)
    return rollout.token_ids, rollout.logprobs


def _slot_reuse_check(lm: LoadedModel) -> None:
    fresh = ReferenceEngine(lm, dtype="float16", max_num_seqs=1)
    alone, = fresh.generate([VICTIM])
    assert all(math.isfinite(x) for x in alone.logprobs)
    expected = (alone.token_ids, alone.logprobs)
    # after the overflowing request in the one slot, within one generate
    assert _victim(ReferenceEngine(lm, dtype="float16", max_num_seqs=1), [POISON, VICTIM]) == expected
    # a slot left by it in an earlier generate, alone and beside a long prefill
    engine = ReferenceEngine(lm, dtype="float16", max_num_seqs=2, chunk_size=32)
    engine.generate([POISON])
    assert _victim(engine, [VICTIM]) == expected
    assert _victim(engine, [VICTIM, LONG]) == expected
    score, = train_forward(lm, [alone], dtype="float16").logprobs
    assert torch.equal(score, torch.tensor(alone.logprobs, dtype=torch.float32))


def test_a_sequence_in_a_slot_reused_after_a_float16_overflow_keeps_its_bits(overflowing):
    """The overflowing request's own rollout is NaN; the healthy one in its slot after it equals
    itself alone and the training forward."""
    poisoned, = ReferenceEngine(overflowing, dtype="float16").generate([POISON])
    assert any(math.isnan(x) for x in poisoned.logprobs)
    _slot_reuse_check(overflowing)


def test_without_clearing_stopped_slots_the_stale_overflow_depends_on_the_batch(overflowing, monkeypatch):
    """Negative control (the engine before round 11): in the dirty slot the victim alone is still
    right (its steps read 32 positions), beside LONG it turns NaN once a step reads 64 (reproduced:
    tokens (62, 0, 0), logprobs (-2.638, nan, nan) against (62, 68, 125)); after the overflowing
    request within one generate it is NaN throughout."""
    monkeypatch.setattr(ReferenceEngine, "_clear", lambda self, stopped: None)
    expected = _victim(ReferenceEngine(overflowing, dtype="float16"), [VICTIM])
    engine = ReferenceEngine(overflowing, dtype="float16", max_num_seqs=2, chunk_size=32)
    engine.generate([POISON])
    assert _victim(engine, [VICTIM]) == expected
    beside = _victim(engine, [VICTIM, LONG])
    assert beside[1][0] == expected[1][0] and math.isnan(beside[1][-1])
    with pytest.raises(AssertionError):
        _slot_reuse_check(overflowing)


# --- n > 1, trajectories, stop ids, modes, paths, top-k, adapters, routes in one batch -------------

#: (model, dtype, adapter) the compositions run on.
SETUPS = [("tiny-llama", "float16", None), ("tiny-llama", "bfloat16", "tiny-llama-lora-r8"),
          ("tiny-qwen3-moe", "float32", None), ("tiny-qwen3-moe", "bfloat16", None)]


@st.composite
def requests_of(draw, count: int) -> list[Request]:
    """`count` requests mixing n, trajectories, stop ids, modes, sampling paths and top-k."""
    out = []
    for i in range(count):
        rng = random.Random(draw(st.integers(0, 2**16)))
        prompt = tuple(rng.randrange(3, 512) for _ in range(draw(st.sampled_from([1, 5, 31, 33, 40]))))
        turns: tuple = ()
        max_tokens = draw(st.sampled_from([1, 2, 4]))
        if draw(st.booleans()):  # a tool reply ending at a block edge (prompt + injection)
            reply = tuple(rng.randrange(3, 512) for _ in range(draw(st.sampled_from([1, 31, 32, 33]))))
            first = Generate(max_tokens=draw(st.sampled_from([1, 2])))
            turns = (first, Inject(reply), Generate(max_tokens=2))
            max_tokens = 40
        plain = draw(st.booleans())
        sampling = SamplingParams(
            n=draw(st.sampled_from([1, 2, 3])), max_tokens=max_tokens, seed=draw(st.integers(0, 9)),
            temperature=1.0 if plain else draw(st.sampled_from([0.0, 0.7, 1.3])),
            top_k=0 if plain else draw(st.sampled_from([0, 3])),
            top_p=1.0 if plain else draw(st.sampled_from([1.0, 0.9])),
            # ~a tenth of the vocabulary stops: some samples end in the step their companions go on
            stop_token_ids=tuple(rng.sample(range(3, 512), draw(st.sampled_from([0, 50])))),
            ignore_eos=draw(st.booleans()), logprobs_mode=draw(st.sampled_from(["processed", "raw"])),
            top_k_logprobs=0 if turns else draw(st.sampled_from([0, 0, 4])))
        out.append(Request(prompt, sampling, request_id=f"q{i}", turns=turns))
    return out


def _fields(rollout) -> tuple:
    arrays = (rollout.top_k_ids, rollout.top_k_logprobs, rollout.routed_experts)
    return (rollout.sample_index, rollout.token_ids, rollout.logprobs, rollout.finish_reason,
            rollout.response_mask, *(None if a is None else a.tolist() for a in arrays))


def _mixed_equal(setup: tuple, requests: list[Request], max_num_seqs: int, chunk_size: int) -> None:
    model, dtype, lora = setup
    options = dict(dtype=dtype, lora=lora, record_routes=True)
    rollouts = ReferenceEngine(model, max_num_seqs=max_num_seqs, chunk_size=chunk_size, **options
                               ).generate(requests)
    alone = ReferenceEngine(model, max_num_seqs=1, chunk_size=64, **options)
    for request in requests:
        mine = [_fields(r) for r in rollouts if r.request_id == request.request_id]
        assert mine == [_fields(r) for r in alone.generate([request])], request.request_id
    scored = train_forward(model, rollouts, dtype=dtype, record_routes=True, layout="packed")
    for rollout, score, routes in zip(rollouts, scored.logprobs, scored.routes):
        sampled = torch.tensor(rollout.response_mask or [1] * len(rollout.logprobs), dtype=torch.bool)
        assert torch.equal(score[sampled], torch.tensor(rollout.logprobs, dtype=torch.float32)[sampled])
        if rollout.routed_experts is not None:
            assert np.array_equal(routes.numpy(), rollout.routed_experts)


MIXED = dict(setup=st.sampled_from(SETUPS), requests=st.integers(2, 4).flatmap(requests_of),
             max_num_seqs=st.sampled_from([1, 2, 16]), chunk_size=st.sampled_from([1, 32, 33]))


@settings(max_examples=8, deadline=None)
@given(**MIXED)
def test_mixed_compositions_equal_alone_and_train_forward(setup, requests, max_num_seqs, chunk_size):
    """n samples, trajectories, stop ids, raw and processed rows, plain rows beside processed ones,
    top-k logprobs, float16, LoRA and MoE routes in one batch: every sample, its top-k, routes, mask
    and finish reason equal the request alone, and its sampled logprobs the training forward."""
    _mixed_equal(setup, requests, max_num_seqs, chunk_size)


MIXED_CONTROL = [
    Request(tuple(range(3, 43)), SamplingParams(n=2, max_tokens=3, seed=1, ignore_eos=True), request_id="a"),
    Request(tuple(range(50, 90)), SamplingParams(max_tokens=40, seed=2, temperature=0.7, logprobs_mode="raw"),
            request_id="b",
            turns=(Generate(max_tokens=1), Inject(tuple(range(200, 232))), Generate(max_tokens=2))),
]


def test_mixed_check_fails_on_a_row_count_dependent_gemm():
    """Negative control: the invariant matmul swapped for one that splits K in two from 64 rows up."""
    variant = variant_gemm.split_k_linear(variant_gemm.by_rows)
    with switch.replaced("matmul", "linear", "cpu", variant), pytest.raises(AssertionError):
        _mixed_equal(("tiny-llama", "float32", None), MIXED_CONTROL, 16, 64)


def _plain_beside_processed() -> None:
    plain = Request(tuple(range(3, 20)), SamplingParams(max_tokens=3, seed=5, ignore_eos=True),
                    request_id="p")
    other = Request((9, 10), SamplingParams(max_tokens=3, seed=6, temperature=0.0, top_k_logprobs=2),
                    request_id="o")
    engine = ReferenceEngine("tiny-llama", max_num_seqs=4)
    alone, = engine.generate([plain])  # the fused draw (`sampler.sample_plain`)
    beside = next(r for r in engine.generate([other, plain]) if r.request_id == "p")  # the processed path
    assert (alone.token_ids, alone.logprobs) == (beside.token_ids, beside.logprobs)


def test_a_plain_row_gets_one_result_on_either_sampler_path():
    """A temperature-1 request alone takes the fused draw, beside a greedy top-k row the processed
    table: the same tokens and logprobs."""
    _plain_beside_processed()


def test_plain_row_check_fails_when_the_two_paths_differ():
    """Negative control: the processed path's log-softmax computed in float64 then rounded (another
    rounding than the fused draw's) changes the plain request's logprobs beside the greedy row."""
    def wide(x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x.double(), dim=-1).to(x.dtype)

    with switch.replaced("softmax", "log_softmax", "cpu", wide), pytest.raises(AssertionError):
        _plain_beside_processed()


def test_the_mixed_examples_catch_a_row_count_dependent_gemm():
    """Negative control of the property's own 8 examples: with that matmul one of them fails (the
    3rd when written)."""
    variant = variant_gemm.split_k_linear(variant_gemm.by_rows)

    def broken(setup, requests, max_num_seqs, chunk_size):
        with switch.replaced("matmul", "linear", "cpu", variant):
            _mixed_equal(setup, requests, max_num_seqs, chunk_size)

    assert examples_until_failure(test_mixed_compositions_equal_alone_and_train_forward, None, MIXED,
                                  broken) <= 8
