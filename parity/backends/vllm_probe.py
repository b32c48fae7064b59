"""Hidden states captured inside a running vLLM engine, stage by stage, for chosen requests.

`ProbeExtension`, mixed into vLLM's worker (`worker_extension_cls`), hooks the embedding, each
layer's attention, router and MLP, the final norm and the logits processor. vLLM leaves a layer's
residual add to the next layer's fused add-RMSNorm, so a layer's output is read as the residual the
next `input_layernorm` (or the final norm) returns. A chosen request carries
`extra_args["parity_probe"]`; the V1 runner lays a step's tokens out request by request in
`input_batch.req_ids` order, so each hook copies only the chosen rows, in vLLM's dtype, and writes
nothing back. A prefill chunk short of the prompt keeps no logits row (the engine drops its sample);
a preempted request's recomputed rows replace the ones kept past where it resumes. On an MoE model
it keeps their routes too (R3). Limits: one worker, the V1 runner, eager execution (hooks do not run
in a CUDA graph), no speculative decoding. docs/BACKENDS.md, "Inside the engine", has more.
"""

from __future__ import annotations

import base64
import os
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from parity.backends.vllm_routes import moe_runners
from parity.backends.vllm_weights import WeightDigestExtension
from parity.core.errors import BackendError, ConfigError

#: the worker extension class of an engine started with `probe=True`.
PROBE_EXTENSION = "parity.backends.vllm_probe.ProbeExtension"
#: the `SamplingParams.extra_args` key that marks a request whose rows the probe keeps.
PROBE_KEY = "parity_probe"
#: vLLM's switch between its V1 and V2 model runners (unset: V2 wherever V2 supports the model).
V2_RUNNER = "VLLM_USE_V2_MODEL_RUNNER"


@contextmanager
def v1_runner() -> Iterator[None]:
    """The environment a probed engine starts in: vLLM's V1 model runner, whose input batch the probe
    reads (vLLM 0.23 takes V2 where it can); ConfigError when the user asks for V2."""
    raw = os.environ.get(V2_RUNNER)
    if raw is not None and raw.strip().lower() in ("1", "true"):
        raise ConfigError(f"vllm option probe needs vLLM's V1 model runner, but the environment's "
                          f"{V2_RUNNER}={raw} asks for V2; unset it (or set it to 0) to probe the engine")
    os.environ[V2_RUNNER] = "0"
    try:
        yield
    finally:
        if raw is None:
            os.environ.pop(V2_RUNNER, None)
        else:
            os.environ[V2_RUNNER] = raw


def probe_engine_kwargs(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments of an engine the probe can look into; refuses another worker
    extension and compiled execution (hooks do not run inside CUDA graphs)."""
    other = engine_kwargs.get("worker_extension_cls")
    if other not in (None, PROBE_EXTENSION):
        raise ConfigError(f"vllm option probe installs its own worker_extension_cls; {other!r} was given")
    if engine_kwargs.get("enforce_eager") is False:
        raise ConfigError("vllm option probe needs enforce_eager=True: a CUDA graph or compiled model "
                          "replays its kernels without calling the probe's hooks")
    if engine_kwargs.get("speculative_config") is not None:
        raise ConfigError("vllm option probe maps one logits row and the scheduled tokens of each request "
                          "per step; speculative decoding (engine_kwargs speculative_config) scores draft "
                          "tokens it may reject, so rows would land on other positions: drop it")
    return {**engine_kwargs, "worker_extension_cls": PROBE_EXTENSION, "enforce_eager": True}


class ProbeExtension(WeightDigestExtension):
    """Methods mixed into vLLM's worker class; called through `LLM.collective_rpc` by name."""

    def parity_probe_start(self, kinds: list[str] | str) -> dict[str, Any]:
        """Hook the model (once), clear the capture and capture `kinds` (a list or a comma-separated
        string: the server's `/collective_rpc` passes strings only); returns {"layers", "moe_layers"}."""
        if not hasattr(self, "_parity_hooks"):
            self._parity_install()
        self._parity_kinds = frozenset(kinds.split(",") if isinstance(kinds, str) else kinds)
        self._parity_index: dict[str, int] = {}
        self._parity_skipped: dict[str, int] = {}
        self._parity_prompt: dict[str, int] = {}  # prompt length of each probed request
        self._parity_fed: dict[str, int] = {}  # token rows kept so far
        self._parity_sampled: dict[str, int] = {}  # logits rows kept so far (one per sampled token)
        self._parity_data: dict[str, dict[str, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        self._parity_routes: dict[str, list[torch.Tensor]] = defaultdict(list)
        return {"layers": len(self._parity_layers), "moe_layers": self._parity_moe}

    def parity_probe_take(self, encoding: str = "bytes") -> dict[str, dict[str, Any]]:
        """What was captured, by vLLM request id: {"index", "skipped", "stages": {name: packed},
        "routes": packed int32 [rows, moe_layers, top_k] or None}; packed is {"dtype", "shape", "data"},
        data base64 with encoding="base64" (for JSON); stops capturing."""
        def pack(parts: list[torch.Tensor]) -> dict[str, Any]:
            packed = _pack(torch.cat(parts))
            if encoding == "base64":
                packed["data"] = base64.b64encode(packed["data"]).decode("ascii")
            return packed

        out = {}
        for req_id, index in self._parity_index.items():
            stages = self._parity_data.get(req_id, {})
            routes = self._parity_routes.get(req_id)
            out[req_id] = {"index": index, "skipped": self._parity_skipped.get(req_id, 0),
                           "stages": {name: pack(parts) for name, parts in stages.items()},
                           "routes": pack(routes) if routes else None}
        self._parity_kinds = frozenset()
        self._parity_data.clear()
        self._parity_routes.clear()
        return out

    def _parity_install(self) -> None:
        runner = self.model_runner  # type: ignore[attr-defined]
        if not hasattr(runner, "input_batch"):
            raise RuntimeError(f"parity's probe needs vLLM's V1 model runner, not {type(runner).__name__} "
                               "(set VLLM_USE_V2_MODEL_RUNNER=0)")
        model = runner.get_model()
        inner = model.model
        self._parity_layers = list(inner.layers)
        self._parity_moe = [i for i, layer in enumerate(self._parity_layers)
                            if hasattr(getattr(layer, "mlp", None), "gate")]
        self._parity_kinds = frozenset()
        self._parity_step: dict[str, Any] | None = None
        # (kind, stage name, module, which item of a tuple output is the stage)
        hooks: list[tuple[str, str, torch.nn.Module, int]] = [("embed", "embed", inner.embed_tokens, 0)]
        for i, layer in enumerate(self._parity_layers):
            hooks.append(("attn", f"layer.{i}.attn", layer.self_attn, 0))
            if i in self._parity_moe:
                hooks.append(("router", f"layer.{i}.router", layer.mlp.gate, 0))
            hooks.append(("mlp", f"layer.{i}.mlp", layer.mlp, 0))
            if i + 1 < len(self._parity_layers):  # the next layer's fused add returns this layer's residual
                hooks.append(("layer", f"layer.{i}", self._parity_layers[i + 1].input_layernorm, 1))
        last = f"layer.{len(self._parity_layers) - 1}"
        hooks += [("layer", last, inner.norm, 1), ("norm", "norm", inner.norm, 0),
                  ("logits", "logits", model.logits_processor, 0)]
        self._parity_hooks = [module.register_forward_hook(self._parity_hook(kind, name, item))
                              for kind, name, module, item in hooks]
        execute = runner.execute_model

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            self._parity_step = {"scheduled": scheduler_output, "rows": None} if self._parity_kinds else None
            for parts in self._parity_route_calls:
                parts.clear()
            try:
                output = execute(scheduler_output, *args, **kwargs)
                self._parity_keep_routes()
                return output
            finally:
                self._parity_step = None

        runner.execute_model = execute_model
        self._parity_route_calls = self._parity_bind_routers(runner.get_model())

    def _parity_bind_routers(self, model: torch.nn.Module) -> list[list[torch.Tensor]]:
        """Bind a capture callback to every MoE router; returns the per-layer lists they fill."""
        moe = moe_runners(model)
        calls: list[list[torch.Tensor]] = [[] for _ in moe]

        def capture(index: int) -> Any:
            def keep(ids: torch.Tensor) -> None:
                if self._parity_step is not None:
                    calls[index].append(ids.detach().to("cpu", torch.int32, copy=True))
            return keep

        for index, module in enumerate(moe):
            if not hasattr(module.router, "set_capture_fn"):
                raise RuntimeError(f"vLLM MoE router {type(module.router).__name__} has no capture hook")
            module.router.set_capture_fn(capture(index))
        return calls

    def _parity_keep_routes(self) -> None:
        """Keep the chosen requests' rows of the routes this step's MoE layers picked."""
        calls = self._parity_route_calls
        if self._parity_step is None or not calls or not calls[0]:
            return
        routes = torch.stack([torch.cat(parts) for parts in calls], dim=1)  # [step rows, moe_layers, top_k]
        for req_id, rows in self._parity_rows()["tokens"]:
            self._parity_routes[req_id].append(routes[rows])

    def _parity_hook(self, kind: str, name: str, item: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if self._parity_step is None or kind not in self._parity_kinds:
                return
            if item and not isinstance(output, tuple):  # a norm without the residual add: not this stage
                return  # (left uncaptured, so the comparison names it missing instead of reading the norm)
            out = output[item] if isinstance(output, tuple) else output
            rows = self._parity_rows()
            for req_id, index in (rows["logits"] if kind == "logits" else rows["tokens"]):
                self._parity_data[req_id][name].append(out[index].detach().to("cpu", copy=True))
        return hook

    def _parity_rows(self) -> dict[str, list[tuple[str, torch.Tensor]]]:
        """This step's chosen rows: {"tokens": [(req_id, rows)], "logits": [(req_id, row)]}, worked out
        at the step's first hook, when the batch order is final."""
        step = self._parity_step
        if step["rows"] is not None:
            return step["rows"]
        scheduled = step["scheduled"]
        for new in scheduled.scheduled_new_reqs:
            extra = getattr(new.sampling_params, "extra_args", None) or {}
            if PROBE_KEY in extra:
                self._parity_index[new.req_id] = int(extra[PROBE_KEY])
                if new.num_computed_tokens:  # prompt tokens served from the prefix cache, never computed
                    self._parity_skipped[new.req_id] = int(new.num_computed_tokens)
                self._parity_prompt[new.req_id] = len(getattr(new, "prompt_token_ids", None) or ())
                self._parity_fed[new.req_id] = int(new.num_computed_tokens)
        cached = getattr(scheduled, "scheduled_cached_reqs", None)
        resumed = getattr(cached, "resumed_req_ids", None) or ()
        computed_tokens = getattr(cached, "num_computed_tokens", ())
        for req_id, computed in zip(getattr(cached, "req_ids", ()), computed_tokens):
            if req_id in resumed and req_id in self._parity_index:  # preempted, recomputed from `computed`
                self._parity_resume(req_id, int(computed))
        counts = scheduled.num_scheduled_tokens
        order = [req_id for req_id in self.model_runner.input_batch.req_ids  # type: ignore[attr-defined]
                 if req_id in counts]
        tokens, logits, start = [], [], 0
        for position, req_id in enumerate(order):
            n = counts[req_id]
            if req_id in self._parity_index:
                tokens.append((req_id, torch.arange(start, start + n)))
                self._parity_fed[req_id] = fed = self._parity_fed.get(req_id, 0) + n
                sampled = self._parity_sampled.get(req_id, 0)
                # a prefill chunk short of the prompt (chunked prefill) gets a logits row the engine
                # drops: keep a row only where the step reaches the request's last known token
                if fed >= self._parity_prompt.get(req_id, 0) + sampled:
                    logits.append((req_id, torch.tensor([position])))
                    self._parity_sampled[req_id] = sampled + 1
            start += n
        step["rows"] = {"tokens": tokens, "logits": logits}
        return step["rows"]

    def _parity_resume(self, req_id: str, computed: int) -> None:
        """A preempted request resumes by recomputing its tokens from `computed`: its token rows (and
        routes) from there on are captured again, so the rows kept past it go."""
        for name, parts in self._parity_data.get(req_id, {}).items():
            if name != "logits" and parts:
                parts[:] = [torch.cat(parts)[:computed]]
        routes = self._parity_routes.get(req_id)
        if routes:
            routes[:] = [torch.cat(routes)[:computed]]
        self._parity_fed[req_id] = computed


def start_probe(llm: Any, kinds: list[str]) -> dict[str, Any]:
    """Clear the probe of an engine started with `probe_engine_kwargs` and capture `kinds`; returns
    its layer facts ({"layers", "moe_layers"})."""
    try:
        workers = llm.collective_rpc("parity_probe_start", args=(kinds,))
    except Exception as e:
        raise BackendError(f"vLLM probe could not start: {e}") from e
    if len(workers) != 1:
        raise BackendError(f"vLLM's probe supports one worker, this engine has {len(workers)}")
    return dict(workers[0])


def take_probe(llm: Any) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, np.ndarray]]:
    """(stages, routes) by probed request index: {stage: [rows, width]} in vLLM's dtype, and on an MoE
    model int32 [rows, moe_layers, top_k]."""
    try:
        (captured,) = llm.collective_rpc("parity_probe_take")
    except Exception as e:
        raise BackendError(f"vLLM probe could not return its capture: {e}") from e
    return unpack_probe(captured)


def unpack_probe(captured: dict[str, dict[str, Any]]) -> tuple[dict[int, dict[str, torch.Tensor]],
                                                                 dict[int, np.ndarray]]:
    """`take_probe`'s (stages, routes) from what `parity_probe_take` returned (bytes or base64)."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    routes: dict[int, np.ndarray] = {}
    for item in captured.values():
        if item["skipped"]:
            raise BackendError(f"probed request {item['index']}: {item['skipped']} prompt tokens came from "
                               "the prefix cache and were never computed")
        out[item["index"]] = {name: _tensor(t) for name, t in item["stages"].items()}
        if item["routes"] is not None:
            routes[item["index"]] = _tensor(item["routes"]).numpy()
    return out, routes


def _pack(tensor: torch.Tensor) -> dict[str, Any]:
    """{"dtype", "shape", "data"} of a tensor, its bytes as they are (what `_tensor` reads back)."""
    whole = tensor.contiguous()
    return {"dtype": str(whole.dtype).removeprefix("torch."), "shape": list(whole.shape),
            "data": whole.view(torch.uint8).numpy().tobytes()}


def _tensor(packed: dict[str, Any]) -> torch.Tensor:
    """A tensor from the worker's {"dtype", "shape", "data"}, bit for bit."""
    dtype = getattr(torch, packed["dtype"])
    data = packed["data"]
    if isinstance(data, str):
        data = base64.b64decode(data)
    if not data:
        return torch.empty(packed["shape"], dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(packed["shape"])
