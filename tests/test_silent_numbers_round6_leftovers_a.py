"""Round 6 leftovers (a) of "no silent wrong numbers": shards, TP devices, bf16 provenance, tool replies.

Each test failed on the code before its fix: a TP=1 shard cut with the "all_reduce" sum ran under a
"canonical" config (and a shard ran as "the whole model"); device="cuda:1" with tensor_parallel_size=2
put the ranks on GPUs 0 and 1; float32 and float16 reference runs recorded `cpu_bf16_gemm` (no bf16
product ran) while a bf16 run with kernels=("matmul",) did not; and the turn-by-turn path sent a
tool's out-of-vocabulary reply (or a fixed one) to the engine as a prompt id.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from parity.backends import reference as reference_module
from parity.backends.base import Backend
from parity.backends.reference import ReferenceBackend
from parity.backends.turns import generate
from parity.core.errors import ConfigError, InputError
from parity.core.turns import Generate, Inject
from parity.core.types import Pair, Request, Rollout, SamplingParams
from parity.engine import EngineConfig, ReferenceEngine, TrainConfig, train_forward
from parity.engine import engine as engine_module
from parity.engine import train as train_module
from parity.kernels import cpu_bf16
from parity.parallel import Comm, shard_model

PAIRS = [((1, 2, 3), (4, 5))]


@pytest.fixture(scope="module")
def all_reduce_shard():
    return shard_model("tiny-qwen3", Comm.single(), reduction="all_reduce")


def test_a_shard_of_another_reduction_is_not_run_under_the_configs_label(all_reduce_shard) -> None:
    with pytest.raises(ConfigError, match=r"shard.*tp_reduction='all_reduce'.*checkpoint path"):
        ReferenceEngine(all_reduce_shard, tensor_parallel_size=1)  # tp_reduction defaults to canonical
    with pytest.raises(ConfigError, match="tensor-parallel shard"):
        train_forward(all_reduce_shard, PAIRS, tensor_parallel_size=1, tp_reduction="canonical")
    # the shard's own settings still run it as it is
    engine = ReferenceEngine(all_reduce_shard, tensor_parallel_size=1, tp_reduction="all_reduce")
    assert engine.lm is all_reduce_shard
    out = train_forward(all_reduce_shard, PAIRS, tensor_parallel_size=1, tp_reduction="all_reduce")
    assert out.logprobs[0].shape == (2,)


def test_a_shard_is_not_run_as_the_whole_model(all_reduce_shard) -> None:
    with pytest.raises(ConfigError, match=r"whole model \(tensor_parallel_size=None\)"):
        ReferenceEngine(all_reduce_shard)
    with pytest.raises(ConfigError, match="whole model"):
        train_forward(all_reduce_shard, PAIRS)


@pytest.fixture
def four_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """This CPU machine shows four CUDA devices to the config checks; any rank start fails the test."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)

    def no_ranks(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a rank started before the device was refused")

    monkeypatch.setattr(engine_module, "RankGroup", no_ranks)
    monkeypatch.setattr(train_module, "RankGroup", no_ranks)


def test_an_explicit_gpu_index_with_tp_is_refused_before_any_rank_starts(four_gpus) -> None:
    with pytest.raises(ConfigError, match=r"device='cuda:1'.*CUDA_VISIBLE_DEVICES=1,2"):
        ReferenceEngine("tiny-qwen3", device="cuda:1", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match=r"device='cuda:0'.*device='cuda'"):
        EngineConfig(device="cuda:0", tensor_parallel_size=4)
    with pytest.raises(ConfigError, match="device='cuda:2'"):
        train_forward("tiny-qwen3", PAIRS, device="cuda:2", tensor_parallel_size=2)
    # what still runs: the index without TP, or the plain "cuda" with TP
    assert EngineConfig(device="cuda:1").device == "cuda:1"
    assert EngineConfig(device="cuda:1", tensor_parallel_size=1).tensor_parallel_size == 1
    assert EngineConfig(device="cuda", tensor_parallel_size=4).tensor_parallel_size == 4
    assert TrainConfig(device="cuda", tensor_parallel_size=2).device == "cuda"


def test_more_ranks_than_visible_gpus_is_refused(four_gpus) -> None:
    with pytest.raises(ConfigError, match=r"needs 8 visible GPUs.*shows 4"):
        EngineConfig(device="cuda", tensor_parallel_size=8)
    with pytest.raises(ConfigError, match="needs 8 visible GPUs"):
        TrainConfig(device="cuda", tensor_parallel_size=8)


class _NoEngine:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.lm = SimpleNamespace(eos_token_ids=(2,))  # the backend's eos ids are its engine's model's


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_no_bf16_gemm_is_recorded_where_no_bf16_product_runs(monkeypatch: pytest.MonkeyPatch,
                                                               dtype: str) -> None:
    monkeypatch.setattr(reference_module, "ReferenceEngine", _NoEngine)
    assert "cpu_bf16_gemm" not in ReferenceBackend("tiny-llama", dtype=dtype).meta


def test_the_bf16_gemm_is_recorded_wherever_the_invariant_matmul_runs_bf16(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reference_module, "ReferenceEngine", _NoEngine)
    assert ReferenceBackend("tiny-llama", dtype="bfloat16").meta["cpu_bf16_gemm"] == cpu_bf16.choice()
    assert ReferenceBackend("tiny-llama", dtype="bfloat16",
                            kernels=("matmul",)).meta["cpu_bf16_gemm"] == cpu_bf16.choice()
    assert "cpu_bf16_gemm" not in ReferenceBackend("tiny-llama", dtype="bfloat16", kernels="native").meta


class _TurnByTurn(Backend):
    """A backend driven turn by turn: every generated turn is token 5; the prompts it got are kept."""

    name = "turn-by-turn"

    def __init__(self) -> None:
        super().__init__("tiny-llama", dtype="float32")
        self.prompts: list[tuple[int, ...]] = []

    def generate(self, requests: Sequence[Request]) -> list[Rollout]:
        self.prompts.extend(r.prompt_ids for r in requests)
        return [Rollout(r.request_id, 0, r.prompt_ids, (5,), (-0.5,), "length", self.name, "processed")
                for r in requests]

    def _score(self, pairs: list[Pair], sampling: SamplingParams) -> list[torch.Tensor]:
        raise NotImplementedError

    def close(self) -> None:
        pass


def test_a_tool_reply_past_the_vocabulary_never_reaches_the_engine() -> None:
    backend = _TurnByTurn()
    tool = Inject(fn=lambda ids: (10**6,), name="far")
    with pytest.raises(ConfigError, match=r"injection 'far'.*token id 1000000.*vocabulary \[0, 512\)"):
        generate(backend, [Request((1, 2), turns=(Generate(1), tool, Generate(1)))])
    assert backend.prompts == [(1, 2)]  # the first turn ran; no prompt held the id


def test_a_fixed_reply_past_the_vocabulary_is_refused_before_any_turn() -> None:
    backend = _TurnByTurn()
    with pytest.raises(InputError, match=r"request '0': turns\[1\] token_ids has token id 1000000"):
        generate(backend, [Request((1, 2), turns=(Generate(1), Inject((10**6,)), Generate(1)))])
    assert backend.prompts == []
    # replies inside the vocabulary run as before
    ok = generate(backend, [Request((1, 2), turns=(Generate(1), Inject(fn=lambda ids: (7, 8)), Generate(1)))])
    assert ok[0].token_ids == (5, 7, 8, 5) and ok[0].response_mask == (1, 0, 0, 1)
