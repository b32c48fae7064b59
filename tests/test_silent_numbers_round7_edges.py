"""Round 7 edges: top-k logprobs on trajectories run turn by turn, the distribution summary of rollouts
with no generated position, and command-line flags given empty that fell back to their default."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from parity.assess.distribution import distribution_section
from parity.audit import lifecycle_command
from parity.backends.base import Backend
from parity.backends.sglang import SGLangBackend
from parity.backends.turns import generate
from parity.backends.vllm import VLLMBackend
from parity.backends.vllm_server import VLLMServerBackend
from parity.core.errors import ConfigError
from parity.core.turns import Generate, Inject
from parity.core.types import Pair, Request, Rollout, SamplingParams
from parity.drift.distribution import TrainerView, position_drift, summarize_distribution
from parity.nightly import command as nightly_command
from parity.rollouts import command as replay_command
from parity.rollouts.record import write_record

# -- 1. top_k_logprobs on a trajectory run turn by turn ------------------------------------------------

TOP_K_TURNS = r"request 'traj': top_k_logprobs does not run with multi-turn trajectories yet; set it to 0"


class _TopKTurns(Backend):
    """A turn-by-turn backend: one token, with a top-k row where asked for; counts its calls."""

    name = "top-k-turns"

    def __init__(self) -> None:
        super().__init__("tiny-llama", dtype="float32")
        self.calls = 0

    def generate(self, requests: Sequence[Request]) -> list[Rollout]:
        self.calls += 1
        return [Rollout(r.request_id, 0, r.prompt_ids, (5,), (-0.5,), "length", self.name, "processed",
                        sampling=r.sampling, **({"top_k_ids": np.array([[5, 6]]),
                                                 "top_k_logprobs": np.array([[-0.5, -1.0]])}
                                                if r.sampling.top_k_logprobs else {})) for r in requests]

    def _score(self, pairs: list[Pair], sampling: SamplingParams) -> list[torch.Tensor]:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _trajectory(top_k: int) -> Request:
    return Request((1, 2), SamplingParams(top_k_logprobs=top_k, max_tokens=8),
                   turns=(Generate(1), Inject((7, 8)), Generate(1)), request_id="traj")


def test_top_k_on_a_trajectory_is_refused_before_any_turn_runs() -> None:
    """It ran every turn, then failed with a TopKError (the last turn's 1 row for 4 tokens)."""
    backend = _TopKTurns()
    with pytest.raises(ConfigError, match=TOP_K_TURNS):
        generate(backend, [_trajectory(2)])
    assert backend.calls == 0
    out = generate(backend, [_trajectory(0)])  # without top-k the trajectory runs as before
    assert out[0].token_ids == (5, 7, 8, 5) and backend.calls == 2


@pytest.mark.parametrize("adapter", [VLLMServerBackend, SGLangBackend, VLLMBackend])
def test_the_engine_backends_refuse_top_k_on_a_trajectory_before_they_start(adapter: type[Backend]) -> None:
    with pytest.raises(ConfigError, match=TOP_K_TURNS):
        adapter.check_requests([_trajectory(2)], {})
    # top-k on a single-turn request, and a trajectory without top-k, stay accepted
    adapter.check_requests([Request((1, 2), SamplingParams(top_k_logprobs=2, max_tokens=8)), _trajectory(0)],
                           {})


# -- 2. the distribution summary of rollouts with no generated position -------------------------------

def _empty_view(k: int) -> TrainerView:
    return TrainerView(np.zeros((0, k)), np.zeros((0, k), np.int64), np.zeros((0, k)), np.zeros(0),
                       np.zeros(0, np.int64), np.zeros(0, np.int64))


def _empty_rollout(k: int, sampling: SamplingParams | None) -> Rollout:
    return Rollout("a", 0, (1, 2), (), (), "length", "x", "processed", top_k_ids=np.zeros((0, k), np.int64),
                   top_k_logprobs=np.zeros((0, k)), sampling=sampling)


def test_no_generated_position_reads_as_unmeasured_not_as_agreement() -> None:
    """Every response empty: top_k was 0 and sampled_rank_max 0 (the best possible rank)."""
    summary, section = distribution_section([_empty_rollout(4, SamplingParams(top_k_logprobs=4))],
                                            [_empty_view(4)])
    assert summary["distribution/num_positions"] == 0
    assert summary["distribution/top_k"] == 4 and section["top_k"] == 4  # the k the rollouts asked for
    assert math.isnan(summary["distribution/sampled_rank_max"])
    assert math.isnan(summary["distribution/sampled_rank_mean"])


def test_an_unknown_k_with_no_position_is_nan_not_zero() -> None:
    """Read back from JSON without sampling, an empty response's top-k is [0, 0]: no k is known."""
    empty = Rollout.from_dict(json.loads(json.dumps(_empty_rollout(4, None).to_dict())))
    summary, _ = distribution_section([empty], [_empty_view(4)])
    assert math.isnan(summary["distribution/top_k"]) and math.isnan(summary["distribution/sampled_rank_max"])
    direct = summarize_distribution(position_drift(np.zeros((0, 4)), _empty_view(4)), 4)
    assert direct["distribution/top_k"] == 4 and math.isnan(direct["distribution/sampled_rank_max"])


# -- 3. flags given empty ----------------------------------------------------------------------------

class _Started(Exception):
    """Raised by the stand-in get_backend: the command got as far as starting an engine."""


@pytest.fixture
def no_engine(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    @contextlib.contextmanager
    def start(name: str, model: Any, *, dtype: str, **options: Any) -> Iterator[None]:
        seen.update(model=model, dtype=dtype, **options)
        raise _Started
        yield  # pragma: no cover

    monkeypatch.setattr(lifecycle_command, "get_backend", start)
    monkeypatch.setattr(replay_command, "get_backend", start)
    return seen


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--dtype", "", r"--dtype is empty; give a dtype"),
    ("--checks", "", r"--checks names no check; give some of repeat,"),
    ("--checks", " , ", r"--checks names no check"),
])
def test_lifecycle_refuses_an_empty_flag(no_engine: dict[str, Any], flag: str, value: str,
                                         message: str) -> None:
    """--dtype "" ran bfloat16 (or the case's dtype); --checks "" ran no check and passed (exit 0)."""
    args = lifecycle_command._parser().parse_args(["--backend", "reference", "--model", "tiny-llama",
                                                   flag, value])
    with pytest.raises(ConfigError, match=message):
        lifecycle_command._run(args)
    assert no_engine == {}
    with pytest.raises(_Started):  # a dtype given runs in it
        lifecycle_command._run(lifecycle_command._parser().parse_args(
            ["--backend", "reference", "--model", "tiny-llama", "--dtype", "float32"]))
    assert no_engine["dtype"] == "float32"


@pytest.mark.parametrize(("flag", "message"), [
    ("--model", r"--model is empty; give a built-in checkpoint"),
    ("--lora", r"--lora is empty; give a peft adapter directory"),
])
def test_replay_refuses_an_empty_model_or_lora(no_engine: dict[str, Any], tmp_path: Path, flag: str,
                                               message: str) -> None:
    """Both fell back to the record's: --lora "" applied the recorded adapter."""
    record = write_record(tmp_path / "rec.jsonl", [Request((1, 2), request_id="a")],
                          [Rollout("a", 0, (1, 2), (5,), (-0.5,), "length", "reference", "processed")],
                          model="tiny-llama", meta={"lora": {"path": "/recorded/adapter"}})
    argv = [str(record), "--backend", "reference", "--out", str(tmp_path / "out.jsonl")]
    with pytest.raises(ConfigError, match=message):
        replay_command._run(replay_command._parser().parse_args([*argv, flag, ""]))
    assert no_engine == {}
    with pytest.raises(_Started):  # without the flag: the record's model and adapter
        replay_command._run(replay_command._parser().parse_args(argv))
    assert no_engine["model"] == "tiny-llama" and no_engine["lora"] == "/recorded/adapter"


@pytest.mark.parametrize(("flag", "value"), [("--backends", ""), ("--backends", " , "), ("--dtypes", "")])
def test_nightly_refuses_a_list_flag_that_names_nothing(tmp_path: Path, flag: str, value: str) -> None:
    """--backends "" ran every installed backend ('auto'); --dtypes "" each case's own dtypes."""
    argv = ["--cases", "cases/smoke.toml", "--out", str(tmp_path), "--device", "cpu"]
    with pytest.raises(ConfigError, match=rf"{flag} names nothing"):
        nightly_command.config_from_args(nightly_command.build_parser().parse_args([*argv, flag, value]))
    config = nightly_command.config_from_args(nightly_command.build_parser().parse_args(
        [*argv, "--backends", "reference", "--dtypes", "float32"]))
    assert config.backends == ("reference",) and config.dtypes == ("float32",)
