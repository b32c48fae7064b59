"""The reference engine: rollout logprobs == train_forward logprobs bitwise, batch-independent sampling."""

import random

import numpy as np
import pytest
import torch
import variant_gemm
from hypothesis import given
from hypothesis import strategies as st
from hypothesis_controls import ci_examples, examples_until_failure

from parity import Request, Rollout, SamplingParams
from parity.core.errors import ConfigError, InputError
from parity.engine import LAYOUTS, ReferenceEngine, train_forward
from parity.engine.sampler import key_state, sample
from parity.kernels import switch
from parity.kernels.cpu_sampling import gumbel_noise
from parity.models import EOS_ID
from parity.monitor.summary import bounded_threads

MODELS = ["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe", "tiny-mixtral"]
DTYPES = ["float32", "bfloat16"]


pytestmark = pytest.mark.usefixtures("one_thread")


@st.composite
def workloads(draw, max_requests=4):
    """Requests plus the engine and trainer settings that must not change any token's numbers."""
    requests = []
    for i in range(draw(st.integers(1, max_requests))):
        rng = random.Random(draw(st.integers(0, 2**16)))
        prompt = tuple(rng.randrange(3, 512) for _ in range(draw(st.integers(1, 90))))
        sampling = SamplingParams(
            n=draw(st.integers(1, 3)), temperature=draw(st.sampled_from([0.0, 0.6, 1.0, 1.2, 1.5])),
            top_k=draw(st.sampled_from([0, 1, 7, 40, 64])), top_p=draw(st.sampled_from([1.0, 0.9, 0.5])),
            max_tokens=draw(st.integers(1, 10)), seed=draw(st.integers(0, 2**16)),
            stop_token_ids=draw(st.sampled_from([(), (EOS_ID,), (100, 200)])),
            ignore_eos=draw(st.booleans()), logprobs_mode=draw(st.sampled_from(["processed", "raw"])))
        requests.append(Request(prompt, sampling, request_id=f"r{i}"))
    return {
        "requests": draw(st.permutations(requests)),
        "max_num_seqs": draw(st.integers(1, 6)),
        "chunk_size": draw(st.integers(1, 48)),
        "micro_batch_size": draw(st.integers(1, 8)),
        "layout": draw(st.sampled_from(LAYOUTS)),
    }


def _rollouts_and_scores(model, dtype, kernels, work):
    engine = ReferenceEngine(model, dtype=dtype, kernels=kernels, max_num_seqs=work["max_num_seqs"],
                             chunk_size=work["chunk_size"], record_routes=True)
    rollouts = engine.generate(work["requests"])
    # no sampling arguments: each rollout is scored under the sampling it records
    scored = train_forward(model, rollouts, dtype=dtype, kernels=kernels,
                           micro_batch_size=work["micro_batch_size"], layout=work["layout"],
                           record_routes=True)
    return rollouts, scored.logprobs, scored.routes


def _rollouts_equal_scores(model, dtype, kernels, work):
    rollouts, scores, routes = _rollouts_and_scores(model, dtype, kernels, work)
    assert len(rollouts) == sum(r.sampling.n for r in work["requests"])
    for rollout, score, route in zip(rollouts, scores, routes):
        assert torch.equal(score, torch.tensor(rollout.logprobs, dtype=torch.float32))
        if rollout.routed_experts is not None:
            assert np.array_equal(route.numpy(), rollout.routed_experts)


#: the rollout property's examples per model and dtype (the `ci` profile's 25 before): stock kernels
#: fail within them for every model and dtype (test_stock_kernels_fail_within_the_rollout_examples)
ROLLOUT_EXAMPLES = 10
ROLLOUT_WORK = {"work": workloads()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", MODELS)
@ci_examples(ROLLOUT_EXAMPLES)
@given(**ROLLOUT_WORK)
@pytest.mark.slow
def test_rollout_logprobs_equal_train_forward_bitwise(model, dtype, work):
    _rollouts_equal_scores(model, dtype, "invariant", work)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.slow
def test_stock_kernels_fail_within_the_rollout_examples(model, dtype, request, monkeypatch):
    """Negative control of the example count: the property's own examples, on stock kernels whose
    linear layers sum K in two parts from 64 rows up (as a BLAS may; this host's bf16 GEMM alone
    passes them), find a difference for every model and dtype."""
    variant_gemm.use(monkeypatch, variant_gemm.by_rows)
    test = test_rollout_logprobs_equal_train_forward_bitwise
    nodeid = request.node.nodeid.replace(request.node.originalname, test.__name__)
    first = examples_until_failure(test, nodeid, ROLLOUT_WORK,
                                   lambda work: _rollouts_equal_scores(model, dtype, "native", work))
    print(f"{nodeid}: stock kernels fail at example {first} of {ROLLOUT_EXAMPLES}")


def test_native_kernels_break_parity_on_some_workload():
    """Negative control: the same comparison with stock kernels finds a difference."""
    found = False
    for seed in range(6):
        rng = random.Random(seed)
        requests = [Request(tuple(rng.randrange(3, 512) for _ in range(rng.randrange(5, 40))),
                            SamplingParams(n=2, max_tokens=6, seed=i), request_id=str(i)) for i in range(4)]
        work = {"requests": requests, "max_num_seqs": 3, "chunk_size": 7, "micro_batch_size": 8,
                "layout": "right"}
        rollouts, scores, _ = _rollouts_and_scores("tiny-llama", "float32", "native", work)
        found = any(not torch.equal(s, torch.tensor(r.logprobs, dtype=torch.float32))
                    for r, s in zip(rollouts, scores))
        if found:
            break
    assert found


def _alone_equals_in_batch(model, dtype, kernels, work, target):
    requests = work["requests"]
    request = requests[target % len(requests)]
    crowd = ReferenceEngine(model, dtype=dtype, kernels=kernels, max_num_seqs=work["max_num_seqs"],
                            chunk_size=work["chunk_size"])
    alone = ReferenceEngine(model, dtype=dtype, kernels=kernels, max_num_seqs=1, chunk_size=64)
    in_batch = [r for r in crowd.generate(requests) if r.request_id == request.request_id]
    by_itself = alone.generate([request])
    assert [(r.token_ids, r.logprobs, r.finish_reason) for r in in_batch] == \
        [(r.token_ids, r.logprobs, r.finish_reason) for r in by_itself]


#: the batch property's examples (the `ci` profile's 25 before): stock kernels fail within them
#: (test_stock_kernels_fail_within_the_batch_examples)
BATCH_EXAMPLES = 10
BATCH_WORK = {"work": workloads(max_requests=3), "target": st.integers(0, 2)}
BATCH_CASES = [("tiny-qwen3-moe", "bfloat16"), ("tiny-llama", "float32")]


@pytest.mark.parametrize("model,dtype", BATCH_CASES)
@ci_examples(BATCH_EXAMPLES)
@given(**BATCH_WORK)
@pytest.mark.slow
def test_request_alone_equals_request_in_any_batch(model, dtype, work, target):
    _alone_equals_in_batch(model, dtype, "invariant", work, target)


@pytest.mark.parametrize("model,dtype", BATCH_CASES)
@pytest.mark.slow
def test_stock_kernels_fail_within_the_batch_examples(model, dtype, request, monkeypatch):
    """Negative control of the example count, as for the rollout property above."""
    variant_gemm.use(monkeypatch, variant_gemm.by_rows)
    test = test_request_alone_equals_request_in_any_batch
    nodeid = request.node.nodeid.replace(request.node.originalname, test.__name__)
    first = examples_until_failure(test, nodeid, BATCH_WORK, lambda work, target: _alone_equals_in_batch(
        model, dtype, "native", work, target))
    print(f"{nodeid}: stock kernels fail at example {first} of {BATCH_EXAMPLES}")


@pytest.mark.parametrize("model,dtype", [("tiny-qwen3-moe", "float32"), ("tiny-llama", "bfloat16")])
@pytest.mark.slow
def test_thread_count_does_not_change_bits(model, dtype):
    requests = [Request(tuple(range(3, 3 + n)), SamplingParams(n=2, max_tokens=6, seed=n), request_id=str(n))
                for n in (5, 33, 70)]
    engine = ReferenceEngine(model, dtype=dtype, max_num_seqs=4, chunk_size=16)
    single = engine.generate(requests)
    with bounded_threads(2):
        double = engine.generate(requests)
        scores = train_forward(model, single, dtype=dtype, layout="packed").logprobs
    assert [(r.token_ids, r.logprobs) for r in single] == [(r.token_ids, r.logprobs) for r in double]
    for rollout, score in zip(single, scores):
        assert torch.equal(score, torch.tensor(rollout.logprobs, dtype=torch.float32))


def test_native_request_alone_differs_from_request_in_batch():
    """Negative control: with stock kernels, batch companions change a request's logprob bits."""
    rng = random.Random(3)
    requests = [Request(tuple(rng.randrange(3, 512) for _ in range(rng.randrange(5, 40))),
                        SamplingParams(max_tokens=6, seed=i), request_id=str(i)) for i in range(8)]
    crowd = ReferenceEngine("tiny-llama", kernels="native").generate(requests)
    alone = ReferenceEngine("tiny-llama", kernels="native", max_num_seqs=1)
    assert any(alone.generate([r])[0].logprobs != c.logprobs for r, c in zip(requests, crowd))


def test_rollout_contract_fields_order_and_routes():
    requests = [Request((5, 6, 7), SamplingParams(n=2, max_tokens=4, seed=1), request_id="a"),
                Request((9,) * 10, SamplingParams(n=1, max_tokens=3, seed=2), request_id="b")]
    with ReferenceEngine("tiny-qwen3-moe", record_routes=True, chunk_size=4, max_num_seqs=2) as engine:
        rollouts = engine.generate(requests)
    assert [r.key for r in rollouts] == [("a", 0), ("a", 1), ("b", 0)]
    for r in rollouts:
        assert isinstance(r, Rollout) and r.backend == "reference"
        assert r.meta["dtype"] == "float32" and r.meta["kernels"] == "invariant"
        assert r.meta["chunk_size"] == 4 and r.meta["max_num_seqs"] == 2 and r.meta["device"] == "cpu"
        assert r.routed_experts.shape == (len(r.prompt_ids) + len(r.token_ids) - 1, 2, 2)
        assert r.routed_experts.dtype == np.int32
        assert ((r.routed_experts >= 0) & (r.routed_experts < 8)).all()
        assert len(set(map(tuple, r.routed_experts.reshape(-1, 2).tolist())) - {(0, 0)}) > 1


def test_routes_recorded_in_fixed_size_steps_equal_the_eager_ones():
    """With graphs on, routes are recorded inside the padded fixed-size forward (on CUDA: inside the
    graph, overwritten by each replay); the rollouts and their routes equal the eager engine's."""
    requests = [Request((5, 6, 7), SamplingParams(n=2, max_tokens=5, seed=1), request_id="a"),
                Request((9,) * 10, SamplingParams(n=1, max_tokens=4, seed=2), request_id="b")]
    got = {}
    for graphs in (False, True):
        with ReferenceEngine("tiny-qwen3-moe", record_routes=True, chunk_size=4, max_num_seqs=3,
                             graphs=graphs) as engine:
            got[graphs] = engine.generate(requests)
    for eager, padded in zip(got[False], got[True]):
        assert padded.token_ids == eager.token_ids and padded.logprobs == eager.logprobs
        assert np.array_equal(padded.routed_experts, eager.routed_experts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")
def test_routes_recorded_inside_cuda_graphs_equal_the_eager_ones():
    """On CUDA the routes are written by the captured graph and overwritten by every replay: each
    step reads its own, the same as an eager engine's."""
    requests = [Request(tuple(range(3, 3 + n)), SamplingParams(n=2, max_tokens=6, seed=n), request_id=str(n))
                for n in (3, 11, 30)]
    got = {}
    for graphs in (False, True):
        with ReferenceEngine("tiny-qwen3-moe", device="cuda", dtype="bfloat16", record_routes=True,
                             max_num_seqs=4, chunk_size=8, graphs=graphs) as engine:
            got[graphs] = engine.generate(requests)
            if graphs:
                assert engine._graphs.status == "cuda graphs"
    for eager, replayed in zip(got[False], got[True]):
        assert replayed.token_ids == eager.token_ids and replayed.logprobs == eager.logprobs
        assert np.array_equal(replayed.routed_experts, eager.routed_experts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")
def test_decode_graphs_take_the_one_token_attention_launch_and_keep_the_bits():
    """Decode steps replay a graph captured with max_run=1 (the attention's one-token launch), mixed
    steps one with the run kernel; the rollout still equals the training forward bit for bit."""
    seen = set()
    launch = switch.registrations("cuda")[("attention", "attention", "cuda")]

    def recording(*args, max_run=None, **kwargs):
        seen.add(max_run)
        return launch(*args, max_run=max_run, **kwargs)

    requests = [Request(tuple(range(3, 3 + n)), SamplingParams(max_tokens=6, seed=n), request_id=str(n))
                for n in (3, 11, 30)]
    with (switch.replaced("attention", "attention", "cuda", recording),
          ReferenceEngine("tiny-qwen3", device="cuda", dtype="bfloat16", max_num_seqs=4,
                          chunk_size=8) as engine):
        rollouts = engine.generate(requests)
        assert engine._graphs.status == "cuda graphs"
    assert 1 in seen and seen - {1}
    scored = train_forward("tiny-qwen3", rollouts, device="cuda", dtype="bfloat16")
    for rollout, score in zip(rollouts, scored.logprobs):
        assert torch.equal(score.cpu(), torch.tensor(rollout.logprobs, dtype=torch.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")
def test_warm_up_captures_every_graph_before_the_generate_and_keeps_the_bits():
    """After warm_up the generate captures nothing (every bucket exists, graphs replayed) and its
    rollouts still equal the training forward bit for bit; without warm-up (the control) the
    generate captures its buckets as it goes."""
    requests = [Request(tuple(range(3, 3 + n)), SamplingParams(n=2, max_tokens=8, seed=n), request_id=str(n))
                for n in (3, 40)]
    settings = dict(device="cuda", dtype="bfloat16", max_num_seqs=4, chunk_size=8)
    with ReferenceEngine("tiny-qwen3", **settings) as engine:
        assert engine.warm_up(48) > 0
        before = set(engine._graphs._buckets)
        rollouts = engine.generate(requests)
        assert set(engine._graphs._buckets) == before and engine._graphs.status == "cuda graphs"
    with ReferenceEngine("tiny-qwen3", **settings) as cold:
        cold.generate(requests)
        assert cold._graphs._buckets
    scored = train_forward("tiny-qwen3", rollouts, device="cuda", dtype="bfloat16")
    for rollout, score in zip(rollouts, scored.logprobs):
        assert torch.equal(score.cpu(), torch.tensor(rollout.logprobs, dtype=torch.float32))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")])])
def test_plain_rows_take_the_fused_draw_with_the_bits_of_the_two_ops(device):
    """Rows at temperature 1 without top-k/top-p draw through `ops.log_softmax_draw` (one pass over the
    bf16 logits on CUDA); a batch with one other row takes log-softmax then the draw. The plain
    requests' rollouts are the same either way and equal the training forward bit for bit."""
    calls = []
    fused = switch.registrations(device)[("pointwise", "log_softmax_draw", device)]

    def counting(*args):
        calls.append(args[0].dtype)
        return fused(*args)

    plain = [Request(tuple(range(3, 3 + n)), SamplingParams(max_tokens=6, seed=n), request_id=str(n))
             for n in (3, 17)]
    other = Request((40, 41), SamplingParams(max_tokens=6, seed=1, temperature=0.7), request_id="t")
    settings = dict(device=device, dtype="bfloat16", max_num_seqs=4, chunk_size=8)
    with (switch.replaced("pointwise", "log_softmax_draw", device, counting),
          ReferenceEngine("tiny-qwen3", **settings) as engine):
        alone = engine.generate(plain)
        assert calls and set(calls) == {torch.bfloat16}
        calls.clear()
        mixed = engine.generate([*plain, other])
        assert not calls
    scored = train_forward("tiny-qwen3", alone, device=device, dtype="bfloat16")
    for a, m, score in zip(alone, mixed, scored.logprobs):
        assert a.token_ids == m.token_ids and a.logprobs == m.logprobs
        assert torch.equal(score.cpu(), torch.tensor(a.logprobs, dtype=torch.float32))


def test_dense_model_records_no_routes():
    rollout, = ReferenceEngine("tiny-llama", record_routes=True).generate(
        [Request((5, 6), SamplingParams(max_tokens=2))])
    assert rollout.routed_experts is None


def test_greedy_processed_logprob_is_zero_and_raw_is_log_softmax():
    prompt = (10, 11, 12, 13)
    engine = ReferenceEngine("tiny-qwen3")
    greedy, = engine.generate([Request(prompt, SamplingParams(temperature=0.0, max_tokens=5))])
    assert greedy.logprobs == (0.0,) * 5
    raw_params = SamplingParams(temperature=0.0, max_tokens=5, logprobs_mode="raw")
    raw, = engine.generate([Request(prompt, raw_params)])
    assert raw.token_ids == greedy.token_ids and raw.logprobs_mode == "raw"
    assert all(lp < 0 for lp in raw.logprobs)


def test_stop_tokens_eos_and_ignore_eos():
    engine = ReferenceEngine("tiny-llama")
    free, = engine.generate([Request((20, 21, 22), SamplingParams(max_tokens=8, seed=3, ignore_eos=True))])
    stop = free.token_ids[2]
    stopped, = engine.generate([Request((20, 21, 22), SamplingParams(max_tokens=8, seed=3, ignore_eos=True,
                                                                      stop_token_ids=(stop,)))])
    first = free.token_ids.index(stop)
    assert stopped.token_ids == free.token_ids[:first + 1] and stopped.finish_reason == "stop"
    assert free.finish_reason == "length" and len(free.token_ids) == 8


def test_same_seed_same_tokens_different_seed_differs():
    engine = ReferenceEngine("tiny-llama")
    make = lambda seed: Request((30, 31), SamplingParams(n=2, max_tokens=8, seed=seed, temperature=1.5))  # noqa: E731
    a, b = engine.generate([make(1)]), engine.generate([make(1)])
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert a[0].token_ids != a[1].token_ids  # another sample index, other noise
    assert a[0].token_ids != engine.generate([make(2)])[0].token_ids  # another seed, other noise


def test_score_is_train_forward():
    engine = ReferenceEngine("tiny-llama", dtype="bfloat16")
    rollouts = engine.generate([Request((4, 5, 6), SamplingParams(max_tokens=4, seed=9))])
    assert torch.equal(engine.score(rollouts)[0], torch.tensor(rollouts[0].logprobs, dtype=torch.float32))


@pytest.mark.parametrize("model", ["tiny-qwen2", "tiny-mixtral"])
def test_other_architectures_are_bitwise_too(model):
    requests = [Request(tuple(range(3, 3 + n)), SamplingParams(n=2, max_tokens=5, seed=n, top_p=0.9),
                        request_id=str(n)) for n in (3, 17, 40)]
    rollouts = ReferenceEngine(model, max_num_seqs=2, chunk_size=8).generate(requests)
    scores = train_forward(model, rollouts, top_p=0.9, layout="packed").logprobs
    for rollout, score in zip(rollouts, scores):
        assert torch.equal(score, torch.tensor(rollout.logprobs, dtype=torch.float32))


def test_bad_requests_and_settings_are_parity_errors():
    engine = ReferenceEngine("tiny-llama")
    with pytest.raises(InputError, match="outside the vocabulary"):
        engine.generate([Request((5, 512), SamplingParams())])
    with pytest.raises(InputError, match="exceed the context"):
        engine.generate([Request((5,) * 500, SamplingParams(max_tokens=13))])
    with pytest.raises(InputError, match=r"not a parity\.Request"):
        engine.generate([(5, 6)])
    with pytest.raises(InputError, match="empty"):
        Request((), SamplingParams())
    with pytest.raises(ConfigError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ConfigError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ConfigError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ConfigError, match="max_num_seqs"):
        ReferenceEngine("tiny-llama", max_num_seqs=0)
    with pytest.raises(ConfigError, match="chunk_size"):
        ReferenceEngine("tiny-llama", chunk_size=0)
    with pytest.raises(ConfigError, match="kernels"):
        ReferenceEngine("tiny-llama", kernels="fast")
    with pytest.raises(ConfigError, match="dtype"):
        ReferenceEngine("tiny-llama", dtype="float64")


def test_gumbel_noise_depends_on_its_key_only():
    keys = [(7, 0, 3), (7, 1, 3), (2**40 + 7, 0, 3), (7, 0, 4)]
    together = gumbel_noise(key_state(keys, "cpu"), 512)
    for i, key in enumerate(keys):
        assert torch.equal(gumbel_noise(key_state([key], "cpu"), 512)[0], together[i])
    assert all(not torch.equal(together[0], together[i]) for i in range(1, 4))


def test_sampling_follows_the_processed_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    processed = torch.log(probs).expand(4000, 4)
    tokens = sample(processed, [(11, 0, position) for position in range(4000)])
    freq = torch.bincount(tokens, minlength=4).double() / 4000
    torch.testing.assert_close(freq, probs.double(), rtol=0, atol=0.03)
    assert torch.equal(sample(processed[:2], [None, None]), torch.tensor([0, 0]))
