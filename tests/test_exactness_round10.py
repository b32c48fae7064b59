"""Round 10 exactness: batch compositions the other engine tests do not draw, each with a negative
control that shows its check fails when invariance is off.

Covered here: top-k logprob ids beside companions asking another k (the defect fixed in
`sampler.top_k_rows`), prompts of 1 and around the 32-position KV/attention blocks with chunk sizes
and token budgets that cut them there, max_tokens 1 (a request finishing in the step another one
starts, with one KV slot), temperature 1e-3 and 10, top-k/top-p cutoffs on ties, MoE experts tied
in the router, and 1 vs 2 threads on those compositions.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import variant_gemm
from hypothesis import given, settings
from hypothesis import strategies as st

from parity import Request, SamplingParams
from parity.engine import ReferenceEngine, sampler, train_forward
from parity.kernels import switch
from parity.models.loading import copy_model, load_model
from parity.monitor.summary import bounded_threads

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny-llama"


def _old_top_k_rows(table: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """The top-k rows before round 10: `torch.topk`'s own order of ties (it follows k)."""
    values, ids = torch.topk(table, min(k, table.shape[1]), dim=-1)
    return ids.tolist(), values.double().tolist()


# --- top-k logprob ids ---------------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 5), vocab=st.integers(1, 300),
       k=st.integers(1, 40), levels=st.integers(1, 4))
def test_top_k_rows_ties_go_to_the_lower_id_whatever_k(seed, rows, vocab, k, levels):
    """Every row's ids are its stable descending sort's first k: ties (few distinct values, -inf)
    to the lower id, and the first j of k are the ids asked with j."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(0, levels, (rows, vocab), generator=gen).float().neg()
    table[table == -(levels - 1)] = float("-inf")
    ids, values = sampler.top_k_rows(table, k)
    expected_values, expected_ids = torch.sort(table, dim=1, descending=True, stable=True)
    width = min(k, vocab)
    assert ids == expected_ids[:, :width].tolist()
    assert values == expected_values[:, :width].double().tolist()
    fewer, _ = sampler.top_k_rows(table, max(1, width // 2))
    assert fewer == [row[:max(1, width // 2)] for row in ids]


def test_old_top_k_rows_ties_follow_k():
    """Negative control: torch.topk's tie order changes with k (a partial sort below V / 64, a
    selection above), so the prefix of a larger k is not the smaller k's answer."""
    table = torch.full((1, 512), float("-inf"))
    table[0, 489] = 0.0
    small, _ = _old_top_k_rows(table, 3)
    large, _ = _old_top_k_rows(table, 20)
    assert small[0] != large[0][:3]


def _top_k_alone_and_beside(k_a: int, k_b: int, temperature: float, top_k: int, dtype: str):
    a = Request((5, 6, 7, 8), SamplingParams(max_tokens=2, seed=1, temperature=temperature, top_k=top_k,
                                             top_k_logprobs=k_a), request_id="a")
    b = Request((9, 10), SamplingParams(max_tokens=2, seed=2, top_k_logprobs=k_b), request_id="b")
    engine = ReferenceEngine(MODEL, dtype=dtype, max_num_seqs=4, chunk_size=16)
    alone, = engine.generate([a])
    beside = next(r for r in engine.generate([b, a]) if r.request_id == "a")
    assert alone.token_ids == beside.token_ids and alone.logprobs == beside.logprobs
    assert np.array_equal(alone.top_k_ids, beside.top_k_ids)
    assert np.array_equal(alone.top_k_logprobs, beside.top_k_logprobs)


@settings(max_examples=6, deadline=None)
@given(k_a=st.integers(1, 6), k_b=st.sampled_from([9, 20, 64]), temperature=st.sampled_from([0.0, 1.0]),
       top_k=st.sampled_from([0, 1, 2]), dtype=st.sampled_from(["float32", "bfloat16"]))
def test_top_k_ids_do_not_depend_on_the_companions_k(k_a, k_b, temperature, top_k, dtype):
    """A request's top-k ids and logprobs alone equal those beside a request asking a larger k; a
    greedy or top-k row's dropped ids are -inf ties, which the larger k used to order otherwise."""
    _top_k_alone_and_beside(k_a, k_b, temperature, top_k, dtype)


def test_top_k_ids_follow_the_companions_k_with_the_old_rows(monkeypatch):
    """Negative control: with topk's own tie order the greedy request's ids change beside k=20
    (reproduced: [489, 1, 0] alone, [489, 343, 325] beside)."""
    monkeypatch.setattr(sampler, "top_k_rows", _old_top_k_rows)
    with pytest.raises(AssertionError):
        _top_k_alone_and_beside(3, 20, 0.0, 0, "float32")


# --- block edges, budgets, extremes --------------------------------------------------------------

EDGE_LENGTHS = [1, 2, 31, 32, 33, 63, 64, 65]


@st.composite
def edge_workloads(draw):
    """Up to 3 requests with prompts at the block edges, and engine settings that cut them there."""
    requests = []
    for i in range(draw(st.integers(1, 3))):
        rng = random.Random(draw(st.integers(0, 2**16)))
        length = draw(st.sampled_from(EDGE_LENGTHS))
        sampling = SamplingParams(
            max_tokens=draw(st.sampled_from([1, 1, 2, 3])), seed=draw(st.integers(0, 99)),
            temperature=draw(st.sampled_from([0.0, 1e-3, 1.0, 10.0])),
            top_k=draw(st.sampled_from([0, 1, 2])), top_p=draw(st.sampled_from([1.0, 0.3, 1e-6])),
            ignore_eos=True, logprobs_mode=draw(st.sampled_from(["processed", "raw"])))
        requests.append(Request(tuple(rng.randrange(3, 512) for _ in range(length)), sampling,
                                request_id=f"r{i}"))
    return {"requests": draw(st.permutations(requests)),
            "max_num_seqs": draw(st.sampled_from([1, 2, 16])),
            "chunk_size": draw(st.sampled_from([1, 31, 32, 33, 64])),
            "budget": draw(st.sampled_from([1, 32, 33, 8192])),
            "layout": draw(st.sampled_from(["packed", "right", "left"]))}


def _edges_equal(work, dtype: str, kernels: str = "invariant", threads: int = 1) -> None:
    engine = ReferenceEngine(MODEL, dtype=dtype, kernels=kernels, max_num_seqs=work["max_num_seqs"],
                             chunk_size=work["chunk_size"], max_num_batched_tokens=work["budget"])
    with bounded_threads(threads):
        rollouts = engine.generate(work["requests"])
    alone = ReferenceEngine(MODEL, dtype=dtype, kernels=kernels, max_num_seqs=1, chunk_size=64)
    for rollout, request in zip(sorted(rollouts, key=lambda r: r.request_id),
                                sorted(work["requests"], key=lambda r: r.request_id)):
        by_itself, = alone.generate([request])
        assert (rollout.token_ids, rollout.logprobs) == (by_itself.token_ids, by_itself.logprobs)
    scores = train_forward(MODEL, rollouts, dtype=dtype, kernels=kernels, layout=work["layout"]).logprobs
    for rollout, score in zip(rollouts, scores):
        assert torch.equal(score, torch.tensor(rollout.logprobs, dtype=torch.float32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@settings(max_examples=5, deadline=None)
@given(work=edge_workloads(), threads=st.sampled_from([1, 2]))
def test_block_edge_compositions_equal_alone_and_train_forward(dtype, work, threads):
    """Prompts of 1 and at 31/32/33 and 63/64/65 positions, chunks and budgets that split them at
    the 32-position blocks, one KV slot (a request starts the step the last one finished) or many,
    temperature 1e-3 and 10, top-k/top-p cutoffs, 1 or 2 threads: each request equals itself alone
    and the training forward, bit for bit."""
    _edges_equal(work, dtype, threads=threads)


EDGE_CONTROL = {
    "requests": [Request(tuple(range(3, 3 + n)), SamplingParams(max_tokens=2, seed=n, ignore_eos=True),
                         request_id=f"r{n}") for n in (1, 33, 65)],
    "max_num_seqs": 16, "chunk_size": 33, "budget": 8192, "layout": "packed"}


def test_block_edge_check_fails_on_a_row_count_dependent_gemm(monkeypatch):
    """Negative control: stock kernels whose GEMM sums K in two parts from 64 rows up (as a BLAS
    may) break the same check on an edge workload."""
    variant_gemm.use(monkeypatch, variant_gemm.by_rows)
    with pytest.raises(AssertionError):
        _edges_equal(EDGE_CONTROL, "float32", kernels="native")


def test_thread_check_fails_on_a_thread_count_dependent_gemm(monkeypatch):
    """Negative control of the 2-thread draws: a stock GEMM that splits K per thread differs
    between 1 and 2 threads on the same edge workload."""
    variant_gemm.use(monkeypatch, variant_gemm.by_threads)
    engine = ReferenceEngine(MODEL, kernels="native", max_num_seqs=16, chunk_size=33)
    single = engine.generate(EDGE_CONTROL["requests"])
    with bounded_threads(2):
        double = engine.generate(EDGE_CONTROL["requests"])
    assert [r.logprobs for r in single] != [r.logprobs for r in double]


# --- MoE experts tied in the router --------------------------------------------------------------

@pytest.fixture(scope="module")
def tied_moe():
    """tiny-qwen3-moe whose router rows 0, 1 and 2 are equal and dominant: every token's top-2 cuts
    through a three-way tie of router logits."""
    lm = copy_model(load_model("tiny-qwen3-moe"))
    with torch.no_grad():
        for layer in lm.model.model.layers:
            weight = layer.mlp.gate.weight
            weight[1:3] = weight[0]
            weight[3:] *= 0.01
    return lm


def _tied_routes_check(lm, requests, max_num_seqs: int, chunk_size: int) -> None:
    engine = ReferenceEngine(lm, max_num_seqs=max_num_seqs, chunk_size=chunk_size, record_routes=True)
    rollouts = engine.generate(requests)
    picked = {tuple(sorted(pair)) for r in rollouts for pair in r.routed_experts.reshape(-1, 2).tolist()}
    assert not picked & {(0, 2), (1, 2)}  # a tie of 0, 1, 2 goes to the lower ids
    alone = ReferenceEngine(lm, max_num_seqs=1, record_routes=True)
    for rollout, request in zip(rollouts, requests):
        by_itself, = alone.generate([request])
        assert by_itself.logprobs == rollout.logprobs
        assert np.array_equal(by_itself.routed_experts, rollout.routed_experts)
    scored = train_forward(lm, rollouts, record_routes=True)
    for rollout, score, routes in zip(rollouts, scored.logprobs, scored.routes):
        assert torch.equal(score, torch.tensor(rollout.logprobs, dtype=torch.float32))
        assert np.array_equal(routes.numpy(), rollout.routed_experts)


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**16), max_num_seqs=st.sampled_from([1, 3]),
       chunk_size=st.sampled_from([1, 8, 33]))
def test_tied_experts_route_alike_alone_in_batch_and_in_training(tied_moe, seed, max_num_seqs, chunk_size):
    """Tied experts go to the lower ids; rollouts and routes equal alone, in a batch and in training."""
    rng = random.Random(seed)
    requests = [Request(tuple(rng.randrange(3, 512) for _ in range(rng.choice([1, 32, 33]))),
                        SamplingParams(max_tokens=2, seed=i), request_id=str(i)) for i in range(3)]
    _tied_routes_check(tied_moe, requests, max_num_seqs, chunk_size)


def test_tied_expert_check_fails_with_topk_tie_order(tied_moe):
    """Negative control: the "moe" top-k as torch.topk (ties unordered) picks expert 2 of the tie."""
    def unordered(scores, k, normalize):
        values, indices = torch.topk(scores, k, dim=-1)
        return (values / values.sum(dim=-1, keepdim=True) if normalize else values), indices

    requests = [Request(tuple(range(3, 40)), SamplingParams(max_tokens=2, seed=0), request_id="0")]
    with switch.replaced("moe", "topk", "cpu", unordered), pytest.raises(AssertionError):
        _tied_routes_check(tied_moe, requests, 3, 8)
