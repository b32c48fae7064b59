"""Round 17, compare's checks before an engine starts: batch/layout attribution of a single rollout
refused before sampling (not after), a running backend measured in its own dtype when none is asked
for and the case lists it, else refused with a fix that works, and R3 given as a
`RouterReplay` object on a backend that cannot record routes refused before it starts."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
from conftest import EngineStarted

from parity.backends import get_backend
from parity.backends.borrowed import check_borrowed
from parity.core.errors import ConfigError
from parity.core.types import Request, SamplingParams
from parity.models.routing import RouterReplay
from parity.workload.cases import Case

compare_module = importlib.import_module("parity.compare")


@pytest.fixture
def no_engine(no_compare_engine):
    return no_compare_engine


def _case(requests: int, n: int = 1, model: str = "tiny-llama") -> Case:
    s = SamplingParams(max_tokens=4, n=n)
    return Case(name="c", model=model, requests=tuple(
        Request((5, 6, 7 + i), s.replace(seed=i), request_id=f"r{i}") for i in range(requests)))


@pytest.mark.parametrize("axes", [["batch"], ["layout"], ["dtype", "layout", "batch"]])
def test_one_rollout_with_a_batch_or_layout_axis_is_refused_before_the_engine_starts(no_engine, axes):
    # old: the engine started and sampled, then attribution_section raised the same refusal
    with pytest.raises(ConfigError, match=r"attribute \[.*\]: the case samples 1 rollout.*at least 2 "):
        compare_module.compare(None, "reference", case=_case(1), dtype="float32", gold=False, attribute=axes)


@pytest.mark.parametrize(("requests", "n", "axes"),
                         [(1, 2, ["batch"]), (2, 1, ["layout"]), (1, 1, ["dtype"])])
def test_two_rollouts_or_an_axis_without_the_rule_still_run(no_engine, requests, n, axes):
    with pytest.raises(EngineStarted):
        compare_module.compare(None, "reference", case=_case(requests, n), dtype="float32", gold=False,
                               attribute=axes)


def test_a_running_backend_without_dtype_runs_in_its_dtype_where_the_case_lists_it(monkeypatch):
    engine = get_backend("reference", "tiny-llama", dtype="float32")
    seen: dict[str, object] = {}

    def checked(backend, **kwargs):
        seen["dtype"] = kwargs["dtype"]
        return check_borrowed(backend, **kwargs)

    def sampled(*args, **kwargs):
        raise EngineStarted

    monkeypatch.setattr(compare_module, "check_borrowed", checked)
    monkeypatch.setattr(compare_module, "generate", sampled)
    listed = dataclasses.replace(_case(2), dtypes=("bfloat16", "float32"))
    try:
        with pytest.raises(EngineStarted):
            compare_module.compare(None, engine, case=listed, gold=False)
        assert seen["dtype"] == "float32"
        # a case of bfloat16 alone contradicts the float32 engine: refused, with a fix that works
        # (old: "... or leave dtype unset", which it was)
        with pytest.raises(ConfigError, match=r"uses dtype 'float32' but dtype='bfloat16' was asked for; "
                                              r"start the backend with dtype='bfloat16', or pass "
                                              r"dtype='float32'"):
            compare_module.compare(None, engine, case=_case(2), gold=False)
    finally:
        engine.close()


def test_the_dtype_refusal_names_a_fix_that_works():
    engine = get_backend("reference", "tiny-llama", dtype="float32")
    try:
        with pytest.raises(ConfigError) as info:
            check_borrowed(engine, model="tiny-llama", dtype="bfloat16")
        assert "leave dtype unset" not in str(info.value)
        assert "pass dtype='float32'" in str(info.value)
    finally:
        engine.close()


def test_r3_as_a_router_replay_object_on_a_backend_without_routes_is_refused_before_it_starts(no_engine):
    # old: the string "R3" was refused here, RouterReplay("R3") only after sampling found no routes
    with pytest.raises(ConfigError, match="backend 'hf' cannot record MoE routes"):
        compare_module.compare(None, "hf", case=_case(1, model="tiny-qwen3-moe"), dtype="float32", gold=False,
                               router_replay=RouterReplay("R3"))


@pytest.mark.parametrize("replay", [RouterReplay("R2"), RouterReplay("R3")])
def test_router_replay_objects_still_run_where_they_can(no_engine, monkeypatch, replay):
    started: dict[str, object] = {}

    def resolve(backend, model, dtype, options, *args, **kwargs):
        started.update(options)
        raise EngineStarted

    monkeypatch.setattr(compare_module, "_resolve_backend", resolve)
    backend = "hf" if replay.mode == "R2" else "reference"
    with pytest.raises(EngineStarted):
        compare_module.compare(None, backend, case=_case(1, model="tiny-qwen3-moe"), dtype="float32",
                               gold=False, router_replay=replay)
    if backend == "reference":  # R3 starts the backend recording routes, as the string does
        assert started.get("record_routes") is True
