"""MoE routes captured inside a running vLLM engine, where vLLM does not return them itself.

vLLM's CPU build refuses `enable_return_routed_experts`. `RouteCaptureExtension`, mixed into the
worker (`worker_extension_cls`), binds each MoE router's `set_capture_fn` (logical expert ids, before
any expert-parallel remapping) and splits each step's rows among requests in `input_batch.req_ids`
order. Limits: prefix caching off (cached prompt tokens are never routed), one worker.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch

from parity.core.errors import BackendError, ConfigError

#: `vllm.LLM` keyword arguments route capture needs.
ENGINE_KWARGS: dict[str, Any] = {
    "worker_extension_cls": "parity.backends.vllm_routes.RouteCaptureExtension",
    "enable_prefix_caching": False,
}


def capture_engine_kwargs(engine_kwargs: dict[str, Any], *, return_routed_experts: bool = False
                          ) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments for an engine whose routes parity captures; refuses vLLM's own
    route return, prefix caching and another worker extension."""
    if return_routed_experts:
        raise ConfigError("vllm options capture_routes and return_routed_experts both ask for routes; "
                          "choose one (return_routed_experts where vLLM supports it, capture_routes on CPU)")
    if engine_kwargs.get("enable_prefix_caching"):
        raise ConfigError("vLLM route capture needs enable_prefix_caching=False: cached prompt tokens are "
                          "never recomputed, so never routed")
    other = engine_kwargs.get("worker_extension_cls")
    if other not in (None, ENGINE_KWARGS["worker_extension_cls"]):
        raise ConfigError(f"vLLM route capture installs its own worker_extension_cls; {other!r} was given")
    return {**engine_kwargs, **ENGINE_KWARGS}


def moe_runners(model: torch.nn.Module) -> list[torch.nn.Module]:
    """vLLM's MoE runner modules of `model` in layer order. Ordered by the index in the module's
    name: vLLM 0.23 (the GPU build) has no `layer_id` on its runners, later builds derive it so."""
    # vllm only inside the engine's worker: this module imports without it
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.models.utils import extract_layer_index

    return sorted((m for m in model.modules() if isinstance(m, MoERunner)),
                  key=lambda m: extract_layer_index(m.layer_name))


class RouteCaptureExtension:
    """Methods mixed into vLLM's worker class; called through `LLM.collective_rpc` by name."""

    def parity_start_route_capture(self) -> int:
        """Hook every MoE layer (once) and clear what was captured; returns the MoE layer count."""
        if not hasattr(self, "_parity_step"):
            self._parity_install()
        self._parity_rows: dict[str, list[np.ndarray]] = defaultdict(list)
        self._parity_skipped: dict[str, int] = {}
        return len(self._parity_step)

    def parity_take_routes(self) -> dict[str, dict[str, Any]]:
        """Captured routes by vLLM request id: {"shape", "data" (int32 bytes), "skipped" positions}."""
        out = {}
        for req_id, parts in self._parity_rows.items():
            routes = np.ascontiguousarray(np.concatenate(parts), dtype=np.int32)
            out[req_id] = {"shape": list(routes.shape), "data": routes.tobytes(),
                           "skipped": self._parity_skipped.get(req_id, 0)}
        self._parity_rows.clear()
        self._parity_skipped.clear()
        return out

    def _parity_install(self) -> None:
        runner = self.model_runner
        if not hasattr(runner, "input_batch"):
            raise RuntimeError(f"parity route capture needs vLLM's V1 model runner, not "
                               f"{type(runner).__name__} (set VLLM_USE_V2_MODEL_RUNNER=0)")
        moe = moe_runners(runner.get_model())
        self._parity_step: list[list[torch.Tensor]] = [[] for _ in moe]
        for index, module in enumerate(moe):
            if not hasattr(module.router, "set_capture_fn"):
                raise RuntimeError(f"vLLM MoE router {type(module.router).__name__} has no capture hook")
            module.router.set_capture_fn(lambda ids, index=index: self._parity_step[index].append(
                ids.detach().to("cpu", torch.int32, copy=True)))
        execute = runner.execute_model

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            self._parity_begin_step()
            output = execute(scheduler_output, *args, **kwargs)
            self._parity_assign(scheduler_output)
            return output

        runner.execute_model = execute_model

    def _parity_begin_step(self) -> None:
        for calls in self._parity_step:
            calls.clear()

    def _parity_assign(self, scheduler_output: Any) -> None:
        """Split one step's captured rows among its requests."""
        scheduled = scheduler_output.num_scheduled_tokens
        if not scheduled or not self._parity_step or not self._parity_step[0]:
            return
        for new in scheduler_output.scheduled_new_reqs:
            if new.num_computed_tokens:  # prompt tokens served from the prefix cache, never routed
                self._parity_skipped[new.req_id] = int(new.num_computed_tokens)
        order = [(req_id, scheduled[req_id]) for req_id in self.model_runner.input_batch.req_ids
                 if req_id in scheduled]
        total = sum(n for _, n in order)
        # Rows past `total` are padding of the step's batch.
        rows = torch.stack([torch.cat(calls)[:total] for calls in self._parity_step], dim=1).numpy()
        start = 0
        for req_id, n in order:
            self._parity_rows[req_id].append(rows[start:start + n])
            start += n


def start_route_capture(llm: Any) -> int:
    """Clear the capture of an engine started with `ENGINE_KWARGS`; returns its MoE layer count."""
    try:
        counts = llm.collective_rpc("parity_start_route_capture")
    except Exception as e:
        raise BackendError(f"vLLM route capture could not start: {e}") from e
    if len(counts) != 1:
        raise BackendError(f"vLLM route capture supports one worker, this engine has {len(counts)}")
    return int(counts[0])


def take_routes(llm: Any) -> dict[str, np.ndarray]:
    """Routes captured since the last take, int32 `[positions, moe_layers, top_k]` by the request id
    `LLM.generate` reports (vLLM's internal id without its random suffix)."""
    (captured,) = llm.collective_rpc("parity_take_routes")
    out = {}
    for internal_id, item in captured.items():
        request_id = internal_id.rsplit("-", 1)[0]
        if item["skipped"]:
            raise BackendError(f"vLLM request {request_id!r}: {item['skipped']} prompt tokens came from "
                               "the prefix cache and were never routed; start vLLM with "
                               "enable_prefix_caching=False")
        out[request_id] = np.frombuffer(item["data"], dtype=np.int32).reshape(item["shape"])
    return out
