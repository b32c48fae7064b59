"""Backends by name, their options, a process-wide engine cache, and availability.

Adapter modules are imported only when their backend is asked for, so `import parity` never pays
for (or fails on) an engine package; an option the adapter does not list is refused before any start.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import importlib.util
import json
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from parity.backends.base import Backend
from parity.core.backend_table import BACKEND_TABLE, BackendSpec
from parity.core.errors import AdapterError, BackendUnavailableError, ConfigError, ParityError
from parity.core.schema import NO_REPLAY
from parity.core.types import Request
from parity.models.checkpoints import checkpoint_stamp, files_stamp, model_text, resolve_model
from parity.models.lora import resolve_adapter

#: the table's rows by name, in its order (`parity.core.backend_table`).
BACKENDS: dict[str, BackendSpec] = {spec.name: spec for spec in BACKEND_TABLE}


def route_recording_backends() -> list[str]:
    """The backends that can record MoE routes (a `route_option`), in registry order."""
    return [name for name, spec in BACKENDS.items() if spec.route_option is not None]


def prefix_cache_backends() -> list[str]:
    """The backends whose prefix cache can be switched on and off, in registry order."""
    return [name for name, spec in BACKENDS.items() if spec.prefix_cache is not None]


def lora_backends() -> list[str]:
    """The backends that apply LoRA adapters, in registry order."""
    return [name for name, spec in BACKENDS.items() if spec.lora]


def lora_options(backend: str, lora: str | None) -> dict[str, str]:
    """The start option that makes `backend` apply LoRA adapter `lora`; AdapterError where it cannot."""
    if lora is None or backend not in BACKENDS:
        return {}  # an unknown backend name is get_backend's error, with the list of names
    if not BACKENDS[backend].lora:
        raise AdapterError(f"backend {backend!r} cannot apply a LoRA adapter; the backends that can: "
                           f"{', '.join(lora_backends())}")
    return {"lora": lora}


def route_capture_options(backend: str, router_replay: str | None) -> dict[str, bool]:
    """The start option that makes `backend` record MoE routes when `router_replay` asks for them;
    ConfigError for R3 (which replays the rollout's routes) on a backend that cannot record them."""
    if router_replay in (None, NO_REPLAY) or backend not in BACKENDS:
        return {}  # an unknown backend name is get_backend's error, with the list of names
    option = BACKENDS[backend].route_option
    if option is not None:
        return {option: True}
    if router_replay == "R3":
        raise ConfigError(f"backend {backend!r} cannot record MoE routes, and R3 replays the routes the "
                          f"rollout backend recorded; use a backend that records them "
                          f"({', '.join(route_recording_backends())}) or R2, which replays the trainer's "
                          "own first pass")
    return {}


def prefix_cache_options(backend: str, enabled: bool) -> dict[str, Any]:
    """The start option that turns `backend`'s prefix cache on or off."""
    spec = _spec(backend)
    if spec.prefix_cache is None:
        raise ConfigError(f"backend {backend!r} has no prefix cache to turn on or off; "
                          f"the backends with one are {prefix_cache_backends()}")
    name, value = spec.prefix_cache[enabled]
    return {name: value}


def _spec(name: str) -> BackendSpec:
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return BACKENDS[name]


def _missing(spec: BackendSpec, options: dict[str, Any] | None = None) -> str | None:
    """Why `spec` cannot run here with `options`, or None. Looks the package up without importing it."""
    if spec.attach_option is not None and (options or {}).get(spec.attach_option) is not None:
        return None
    if spec.launch_option is not None and (options or {}).get(spec.launch_option):
        return None  # the server's own Python has the package; a missing one fails its start, named
    if importlib.util.find_spec(spec.requires) is None:
        return f"backend {spec.name!r} needs the {spec.requires!r} package: {spec.install}"
    return None


def available_backends() -> dict[str, str | None]:
    """Backend name -> None if its package is installed here, else the reason it is not usable."""
    return {name: _missing(spec) for name, spec in BACKENDS.items()}


def backend_options(name: str) -> list[str]:
    """The option names backend `name` accepts (its adapter's `option_names`)."""
    return _adapter(_spec(name)).option_names()


def weight_sync_missing(name: str) -> str | None:
    """Why backend `name` cannot push and verify weights, or None; read off its adapter class."""
    return _adapter(_spec(name)).weight_sync_missing()


def check_requests(name: str, requests: Sequence[Request], options: dict[str, Any]) -> None:
    """`Backend.check_requests` of backend `name` with `options`, before it starts; a missing package
    is refused first, as `get_backend` would."""
    spec = _spec(name)
    reason = _missing(spec, options)
    if reason is not None:
        raise BackendUnavailableError(reason)
    _adapter(spec).check_requests(requests, options)


def check_probe(name: str, requests: Sequence[Request], capture: Sequence[int], kinds: Sequence[str],
                options: dict[str, Any]) -> None:
    """`Backend.check_probe` of backend `name` with `options`, before it starts."""
    _adapter(_spec(name)).check_probe(requests, capture, kinds, options)


def top_k_limit(name: str, options: dict[str, Any]) -> int | None:
    """`Backend.top_k_limit` of backend `name` with `options`, read off its adapter class."""
    return _adapter(_spec(name)).top_k_limit(options)


def get_backend(name: str, model: str | Path, *, dtype: str = "bfloat16", **options: Any) -> Backend:
    """Start backend `name` on `model` (built-in name or HF checkpoint directory) with the adapter's
    `options`; an unknown option or a missing package (but for a server attached by URL) is refused first."""
    spec = _spec(name)
    valid = backend_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(f"backend {name!r} has no option {', '.join(map(repr, unknown))}; "
                          f"its options: {', '.join(valid)}")
    reason = _missing(spec, options)
    if reason is not None:
        raise BackendUnavailableError(reason)
    return _adapter(spec)(model, dtype=dtype, **options)


def _adapter(spec: BackendSpec) -> type[Backend]:
    """The adapter class of `spec`. Adapter modules import without their engine's package."""
    module_name, cls_name = spec.adapter.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise BackendUnavailableError(f"backend {spec.name!r} could not be imported ({e}); "
                                      f"{spec.install}") from e
    return getattr(module, cls_name)


def parse_option(text: str) -> tuple[str, Any]:
    """One command-line `KEY=VALUE` backend option -> (key, value); VALUE is read as JSON when it
    parses (true, 4, 0.5, {"max_model_len": 512}), else kept as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise ConfigError(f"--option {text!r}: expected KEY=VALUE with KEY a Python identifier, "
                          "e.g. --option record_routes=true")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def parse_options(texts: Sequence[str], refused: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Command-line `KEY=VALUE` texts -> backend options: a key given twice with two values is a
    ConfigError (the last would win unsaid), and so is a key of `refused` (key -> why and what to use)."""
    options: dict[str, Any] = {}
    for text in texts:
        key, value = parse_option(text)
        if key in options and options[key] != value:
            raise ConfigError(f"--option {key} is given twice ({key}={options[key]!r} and {key}={value!r}); "
                              "give it once")
        if refused and key in refused:
            raise ConfigError(f"--option {key}: {refused[key]}")
        options[key] = value
    return options


_SHARED: dict[str, Backend] = {}
#: the files each shared backend started on (`_stamp`): one whose files changed since is replaced
_STAMPS: weakref.WeakKeyDictionary[Backend, Any] = weakref.WeakKeyDictionary()
#: where `shared_backend` looks first (`route_shared_backends`); None: this process's cache only
_ROUTE: Callable[..., Backend | None] | None = None


def route_shared_backends(route: Callable[..., Backend | None] | None) -> None:
    """Send `shared_backend` calls to `route(name, model, dtype, options)` first (None: this process's
    cache); a test session routes its vLLM engines to shared engine hosts (tests/engine_host.py)."""
    global _ROUTE
    _ROUTE = route


def _key(name: str, model: str | Path, dtype: str, options: dict[str, Any]) -> str:
    """The cache key: the checkpoint by its resolved directory (a relative path names another one from
    another working directory; Path("tiny-llama") is a directory, "tiny-llama" the built-in model)."""
    try:
        where = str(resolve_model(model).resolve())
    except ParityError:  # not a model here: get_backend refuses it, close_shared_backend finds none
        where = model_text(model) if isinstance(model, (str, os.PathLike)) else repr(model)
    return repr((name, where, dtype, sorted(options.items())))


def _stamp(model: str | Path, options: dict[str, Any]) -> tuple[Any, ...]:
    """What a started backend's numbers depend on besides its cache key: its checkpoint files'
    `checkpoint_stamp` (weights, config, eos), and a LoRA adapter's directory and files."""
    path = resolve_model(model)
    stamp: tuple[Any, ...] = (checkpoint_stamp(path),)
    if options.get("lora") is not None:
        adapter = resolve_adapter(options["lora"]).resolve()
        stamp += (str(adapter), files_stamp(adapter, Path.is_file))
    return stamp


def shared_is_stale(backend: Backend) -> bool:
    """Whether shared `backend`'s checkpoint (or adapter) files changed since it started, or no longer
    resolve; False for one this process's cache did not stamp."""
    started = _STAMPS.get(backend)
    if started is None:
        return False
    lora = (backend.meta.get("lora") or {}).get("path")
    try:
        return _stamp(getattr(backend, "model_dir", backend.model_path), {"lora": lora}) != started
    except ParityError:
        return True


def shared_backend(name: str, model: str | Path, *, dtype: str = "bfloat16", **options: Any) -> Backend:
    """A process-wide backend for these exact arguments, started on first use, closed at exit (vLLM
    CPU takes ~10-25 s to start); callers must not close it. A dead one is replaced, and so is one
    whose checkpoint (or adapter) files changed since it started (`_stamp`): it would serve the old
    weights and stop on the old eos ids."""
    if _ROUTE is not None and (routed := _ROUTE(name, model, dtype, options)) is not None:
        return routed
    key = _key(name, model, dtype, options)
    if key in _SHARED and (not _SHARED[key].alive or _STAMPS.get(_SHARED[key]) != _stamp(model, options)):
        _close(_SHARED.pop(key))
    if key not in _SHARED:
        try:  # taken before the start: files rewritten meanwhile start it again next time
            stamp: tuple[Any, ...] | None = _stamp(model, options)
        except ParityError:
            stamp = None  # a model or adapter that does not resolve: get_backend refuses it, in its order
        backend = get_backend(name, model, dtype=dtype, **options)
        backend.shared = True
        _SHARED[key] = backend
        if stamp is not None:
            _STAMPS[backend] = stamp
    return _SHARED[key]


def close_shared_backend(name: str, model: str | Path, *, dtype: str = "bfloat16", **options: Any) -> bool:
    """Close and forget the shared backend of these exact arguments now, so its memory is free for the
    next engine; False when none is open. A failure to close is raised after it is forgotten."""
    backend = _SHARED.pop(_key(name, model, dtype, options), None)
    if backend is None:
        return False
    backend.close()
    return True


def close_dead_backends() -> list[str]:
    """Close and forget every shared backend whose engine has died; returns their names."""
    dead = [key for key, backend in _SHARED.items() if not backend.alive]
    names = []
    for key in dead:
        backend = _SHARED.pop(key)
        names.append(backend.name)
        _close(backend)
    return names


def _close(backend: Backend) -> None:
    """Close a backend whose engine may already be gone (closing a dead engine may itself fail)."""
    with contextlib.suppress(Exception):
        backend.close()


def close_shared_backends() -> None:
    """Close every shared backend (registered to run at interpreter exit)."""
    while _SHARED:
        _, backend = _SHARED.popitem()
        backend.close()


atexit.register(close_shared_backends)
