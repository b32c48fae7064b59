"""Tensor parallelism: the same bits at every degree and in the training forward.

Rollouts of the reference engine at TP=2 and TP=4 (gloo ranks, spawned processes) equal the
in-process TP=1 rollouts and `train_forward(tensor_parallel_size=1)` in every layout, bit for bit,
over generated batch compositions, on a dense and an MoE checkpoint. The negative control runs
the same comparison with the stock all-reduce row-parallel sum and sees it fail. The launcher
tests check that a failing or dying rank, a closed group and Ctrl-C leave no process behind.
GPU: `python3 -m pytest -q -m gpu tests/test_parallel.py` on a host with two GPUs (NCCL).
"""

from __future__ import annotations

import signal
from pathlib import Path

import psutil
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parity.core.errors import ConfigError
from parity.core.types import Request, SamplingParams
from parity.engine import EngineConfig, ReferenceEngine, train_forward
from parity.engine.train import LAYOUTS
from parity.parallel import RankGroup, TensorParallelError
from parity.parallel.layers import block_tree_sum

#: engine settings of the TP=1 reference: a different batch composition from the TP=k engines'.
TP1_SETTINGS = {"max_num_seqs": 3, "chunk_size": 5}
TPK_SETTINGS = {"max_num_seqs": 8, "chunk_size": 16}


@st.composite
def workloads(draw: st.DrawFn) -> list[Request]:
    """1-4 requests, prompts of 1-12 tokens, 1-6 new tokens, greedy or sampled, 1-2 samples each."""
    requests = []
    for i in range(draw(st.integers(1, 4))):
        prompt = tuple(draw(st.lists(st.integers(3, 200), min_size=1, max_size=12)))
        sampling = SamplingParams(max_tokens=draw(st.integers(1, 6)),
                                  temperature=draw(st.sampled_from([0.0, 1.0])),
                                  seed=draw(st.integers(0, 1000)), n=draw(st.integers(1, 2)))
        requests.append(Request(request_id=f"r{i}", prompt_ids=prompt, sampling=sampling))
    return requests


def _equal(a: list, b: list) -> bool:
    return all(x.token_ids == y.token_ids and x.logprobs == y.logprobs for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def tp1_engines():
    """Each model's TP=1 engine, started once for both of its degrees (a rank start costs ~5 CPU-s)."""
    started: dict[str, ReferenceEngine] = {}

    def get(model: str) -> ReferenceEngine:
        if model not in started:
            started[model] = ReferenceEngine(model, tensor_parallel_size=1, **TP1_SETTINGS)
        return started[model]

    yield get
    for engine in started.values():
        engine.close()


@pytest.fixture(scope="module", params=[("tiny-qwen3", 2), ("tiny-qwen3", 4), ("tiny-qwen3-moe", 2),
                                        ("tiny-qwen3-moe", 4)], ids=lambda p: f"{p[0]}-tp{p[1]}")
def engines(request: pytest.FixtureRequest, tp1_engines):
    model, tp = request.param
    with ReferenceEngine(model, tensor_parallel_size=tp, **TPK_SETTINGS) as many:
        yield model, tp1_engines(model), many


@pytest.mark.slow
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=workloads(), layout=st.sampled_from(LAYOUTS), micro=st.integers(1, 3))
def test_tp_rollouts_equal_tp1_and_train_forward(engines, requests, layout, micro) -> None:
    model, one, many = engines
    rollouts = many.generate(requests)
    reference = one.generate(requests)
    assert _equal(rollouts, reference)
    trained = train_forward(model, rollouts, tensor_parallel_size=1, layout=layout, micro_batch_size=micro)
    for rollout, logprobs in zip(rollouts, trained.logprobs, strict=True):
        assert torch.equal(torch.tensor(rollout.logprobs, dtype=torch.float32), logprobs)


def _long_workload() -> list[Request]:
    return [Request(request_id=f"r{i}", prompt_ids=tuple(range(5, 5 + 3 * i + 2)),
                    sampling=SamplingParams(max_tokens=8, temperature=1.0, seed=i, n=2)) for i in range(4)]


@pytest.mark.slow
def test_negative_control_all_reduce_differs_across_degrees() -> None:
    """The stock row-parallel all-reduce at TP=2: its logprobs differ from TP=1's (so the test above,
    run with it, would fail)."""
    requests = _long_workload()
    canonical = ReferenceEngine("tiny-qwen3", tensor_parallel_size=1).generate(requests)
    stock_one = ReferenceEngine("tiny-qwen3", tensor_parallel_size=1,
                                tp_reduction="all_reduce").generate(requests)
    with ReferenceEngine("tiny-qwen3", tensor_parallel_size=2, tp_reduction="all_reduce") as engine:
        stock_two = engine.generate(requests)
    assert not _equal(stock_two, stock_one)
    assert not _equal(stock_two, canonical)


@pytest.mark.slow
def test_train_forward_on_two_ranks_equals_one() -> None:
    requests = _long_workload()
    rollouts = ReferenceEngine("tiny-qwen3-moe", tensor_parallel_size=1).generate(requests)
    one = train_forward("tiny-qwen3-moe", rollouts, tensor_parallel_size=1, layout="packed",
                        record_routes=True)
    two = train_forward("tiny-qwen3-moe", rollouts, tensor_parallel_size=2, layout="left", record_routes=True)
    for a, b, r in zip(one.logprobs, two.logprobs, rollouts, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(a, torch.tensor(r.logprobs, dtype=torch.float32))
    for a, b in zip(one.routes, two.routes, strict=True):
        assert torch.equal(a, b)


def _logprobs(rollouts: list) -> list[torch.Tensor]:
    return [torch.tensor(r.logprobs, dtype=torch.float32) for r in rollouts]


@pytest.fixture(scope="module")
def two_groups_tp2():
    """A float32 TP=2 reference backend of tiny-qwen3 summing in 2 K groups: its engine serves the
    reduction-groups test, the backend itself the compare test (one rank group for both)."""
    from parity.backends.reference import ReferenceBackend

    backend = ReferenceBackend("tiny-qwen3", dtype="float32", tensor_parallel_size=2, reduction_groups=2)
    yield backend
    backend.close()


@pytest.mark.slow
def test_reduction_groups_give_the_same_bits_at_every_degree_for_one_value(two_groups_tp2) -> None:
    """reduction_groups=2: TP=2 equals TP=1 bit for bit, and the rollouts record the value; the
    default 8 groups at TP=1 give other bits (each group count is its own sum: the trade is real)."""
    requests = _long_workload()
    one = ReferenceEngine("tiny-qwen3", tensor_parallel_size=1, reduction_groups=2).generate(requests)
    eight = ReferenceEngine("tiny-qwen3", tensor_parallel_size=1).generate(requests)
    engine = two_groups_tp2._engine  # the engine's own rollouts: the backend adds its meta
    assert engine.config == EngineConfig(tensor_parallel_size=2, reduction_groups=2)
    two = engine.generate(requests)
    assert [r.token_ids for r in two] == [r.token_ids for r in one]
    assert all(torch.equal(a, b) for a, b in zip(_logprobs(two), _logprobs(one), strict=True))
    assert {r.meta["reduction_groups"] for r in two} == {2}
    assert {r.meta["reduction_groups"] for r in eight} == {8}
    # the negative control: the same comparison between 2 and 8 groups fails
    assert not _equal(eight, one)


@pytest.mark.parametrize("groups", [8, 6, 4, 2])
def test_a_ranks_block_sums_then_the_ranks_sum_is_the_whole_tree(groups) -> None:
    # what RowParallelLinear relies on to gather one partial per rank: fp32 partials [groups, 3, 5] of
    # very different magnitudes (so the order of additions shows in the bits)
    x = torch.randn(groups, 3, 5, generator=torch.Generator().manual_seed(groups)) * torch.logspace(
        -6, 6, groups).view(-1, 1, 1)
    whole = block_tree_sum(x)
    for size in (s for s in (2, 4, 8) if groups % s == 0 and (groups // s) & (groups // s - 1) == 0):
        assert torch.equal(block_tree_sum(torch.stack([block_tree_sum(b) for b in x.chunk(size)])), whole)
    # the control: groups handed out round-robin are not subtrees, and the bits move
    y = torch.tensor([1e8, 1.0, -1e8, 1.0])
    round_robin = torch.stack([block_tree_sum(y[r::2]) for r in range(2)])
    assert block_tree_sum(y) == 0.0 and block_tree_sum(round_robin) == 2.0


@pytest.mark.parametrize("groups,size,match", [(2, 4, "not divisible by tensor_parallel_size=4"),
                                               (0, 1, "positive integer"), (True, 1, "positive integer"),
                                               (2.0, 1, "positive integer")])
def test_bad_reduction_groups_is_a_config_error(groups, size, match) -> None:
    with pytest.raises(ConfigError, match=f"reduction_groups.*{match}"):
        EngineConfig(tensor_parallel_size=size, reduction_groups=groups)
    with pytest.raises(ConfigError, match=f"reduction_groups.*{match}"):
        train_forward("tiny-qwen3", [([5, 6], [7])], tensor_parallel_size=size, reduction_groups=groups)


@pytest.mark.parametrize("size", [3, 0, True])
def test_unsupported_degree_is_a_config_error(size) -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size must be one of"):
        ReferenceEngine("tiny-qwen3", tensor_parallel_size=size)


def test_degree_that_does_not_divide_the_heads_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="does not divide"):
        ReferenceEngine("tiny-qwen3", tensor_parallel_size=8)


# ---- the launcher ----

def _gone(pids: list[int]) -> bool:
    return not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


@pytest.mark.slow
def test_group_runs_collectives_and_closes(probe_path) -> None:
    group = RankGroup(2, "cpu", probe_path)
    pids = group.pids
    assert group.call("gather") == [0, 1]
    group.close()
    assert _gone(pids)
    with pytest.raises(TensorParallelError, match="closed"):
        group.call("gather")


@pytest.mark.slow
def test_failing_rank_stops_the_group_with_its_traceback(probe_path) -> None:
    group = RankGroup(2, "cpu", probe_path)
    pids = group.pids
    expected = r"rank 1 of 2 failed in fail_on(?s:.*)probe failure on rank 1"
    with pytest.raises(TensorParallelError, match=expected):
        group.call("fail_on", 1)
    assert _gone(pids)


@pytest.mark.slow
def test_dying_rank_stops_the_group(probe_path) -> None:
    group = RankGroup(2, "cpu", probe_path)
    pids = group.pids
    with pytest.raises(TensorParallelError, match="rank 0 of 2 died in exit_on"):
        group.call("exit_on", 0)
    assert _gone(pids)


@pytest.mark.slow
def test_sigint_in_the_caller_kills_the_ranks(probe_path) -> None:
    group = RankGroup(2, "cpu", probe_path)
    pids = group.pids

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        with pytest.raises(KeyboardInterrupt):
            group.call("sleep", 60.0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert _gone(pids)


@pytest.mark.slow
def test_failing_factory_is_reported() -> None:
    with pytest.raises(TensorParallelError, match="failed in start"):
        RankGroup(2, "cpu", list)  # list(Comm) raises TypeError in every rank


# ---- two GPUs (NCCL) ----

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not TWO_GPUS, reason="needs two NVIDIA GPUs (CUDA not available or fewer than 2 devices)")
@pytest.mark.parametrize("shape,layers", [("qwen3-1.7b", 4), ("moe-64x8", 2)])
def test_gpu_tp2_equals_tp1_and_train_forward(tmp_path: Path, shape: str, layers: int) -> None:
    from parity.models.shaped import save_random_model, shaped_config

    path = str(save_random_model(shaped_config(shape, layers), tmp_path / shape, device="cuda",
                                 dtype="bfloat16"))
    vocab = shaped_config(shape, layers).vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (5 + 7 * i,), generator=g).tolist() for i in range(12)]
    requests = [Request(request_id=f"r{i}", prompt_ids=tuple(p),
                        sampling=SamplingParams(max_tokens=24, temperature=1.0, seed=i, n=2, ignore_eos=True))
                for i, p in enumerate(prompts)]
    settings = {"dtype": "bfloat16", "device": "cuda"}
    one = ReferenceEngine(path, tensor_parallel_size=1, max_num_seqs=24, chunk_size=64, **settings)
    reference = one.generate(requests)
    with ReferenceEngine(path, tensor_parallel_size=2, max_num_seqs=7, chunk_size=16, **settings) as engine:
        rollouts = engine.generate(requests)
    assert _equal(rollouts, reference)
    stock = ReferenceEngine(path, tensor_parallel_size=1, tp_reduction="all_reduce", **settings)
    with ReferenceEngine(path, tensor_parallel_size=2, tp_reduction="all_reduce", **settings) as engine:
        assert not _equal(engine.generate(requests), stock.generate(requests))  # the negative control
    trained = train_forward(path, rollouts, tensor_parallel_size=1, layout="left", micro_batch_size=5,
                            **settings)
    for rollout, logprobs in zip(rollouts, trained.logprobs, strict=True):
        assert torch.equal(torch.tensor(rollout.logprobs, dtype=torch.float32), logprobs.cpu())


@pytest.mark.slow
def test_compare_with_a_tp2_reference_backend_has_zero_drift() -> None:
    from parity.backends.reference import ReferenceBackend
    from parity.compare import compare

    backend = ReferenceBackend("tiny-qwen3-moe", dtype="float32", tensor_parallel_size=2, record_routes=True)
    try:
        report = compare("tiny-qwen3-moe", backend, prompts=[[5, 6, 7], [9, 10, 11, 12, 13]],
                         sampling={"max_tokens": 6, "n": 2}, dtype="float32", tensor_parallel=2)
    finally:
        backend.close()
    assert report.summary["max_abs_logprob_diff"] == 0.0
    assert report.passed


@pytest.mark.slow
def test_compare_scores_with_the_backends_reduction_groups(two_groups_tp2) -> None:
    """A TP=2 reference backend with reduction_groups=2: the training forward sums in 2 groups too
    (zero drift; with the default 8 it would not match), and the provenance says so."""
    from parity.compare import compare

    report = compare("tiny-qwen3", two_groups_tp2, prompts=[[5, 6, 7], [9, 10, 11, 12, 13]],
                     sampling={"max_tokens": 6, "n": 2}, dtype="float32", tensor_parallel=2)
    assert report.summary["max_abs_logprob_diff"] == 0.0
    assert report.provenance["train_tensor_parallel"] == {"tensor_parallel_size": 1, "reduction_groups": 2}
    assert report.provenance["backend_meta"]["reduction_groups"] == 2
