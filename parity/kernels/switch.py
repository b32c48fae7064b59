"""The one switch that turns batch-invariant ops on, per op family, and the per-device registry.
`impl(family, op, device_type)` returns the registered kernel when the family is on, None when
off; `register` plugs in a device, `replaced` swaps one for a block, `registrations` lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from parity.core.errors import BackendUnavailableError, ConfigError

#: the op families that can be switched independently (attribution turns them native one at a time).
FAMILIES: tuple[str, ...] = ("matmul", "attention", "rmsnorm", "softmax", "pointwise", "rotary", "moe")
#: the ops of each family that parity looks up (`impl`): a registration under any other name never runs.
OPS: dict[str, tuple[str, ...]] = {
    "matmul": ("linear", "linears"),
    "attention": ("attention", "write_kv"),
    "rmsnorm": ("rms_norm", "add_rms_norm"),
    "softmax": ("softmax", "log_softmax", "cumsum"),
    "pointwise": ("activation", "gated", "gumbel_argmax", "log_softmax_draw"),
    "rotary": ("rotary", "apply", "norm_apply"),
    "moe": ("topk", "experts"),
}

_enabled: frozenset[str] = frozenset()
#: (family, op name, device type) -> implementation.
_registry: dict[tuple[str, str, str], Callable[..., Any]] = {}


def _check_families(families: Iterable[str] | None) -> frozenset[str]:
    if families is None:
        return frozenset(FAMILIES)
    if isinstance(families, str):
        families = (families,)
    chosen = frozenset(families)
    unknown = sorted(chosen - set(FAMILIES))
    if unknown:
        raise ConfigError(f"kernels families: unknown {unknown}; choose from {list(FAMILIES)}")
    return chosen


def _set(families: frozenset[str]) -> None:
    global _enabled
    _enabled = families


def enable(families: Iterable[str] | None = None) -> None:
    """Switch batch-invariant ops on for `families` (None = all) and off for every other family."""
    _set(_check_families(families))


def disable() -> None:
    """Switch every family back to stock torch ops."""
    _set(frozenset())


def enabled_families() -> frozenset[str]:
    """The families whose batch-invariant ops are on right now."""
    return _enabled


@contextmanager
def invariant(families: Iterable[str] | None = None) -> Iterator[frozenset[str]]:
    """Batch-invariant ops on for `families` (None = all) inside the block; restores the previous state."""
    previous = _enabled
    _set(_check_families(families))
    try:
        yield _enabled
    finally:
        _set(previous)


@contextmanager
def native() -> Iterator[frozenset[str]]:
    """Stock torch ops for every family inside the block; restores the previous state."""
    with invariant(families=()) as chosen:
        yield chosen


def register(family: str, op: str, device_type: str, fn: Callable[..., Any]) -> None:
    """Make `fn` the batch-invariant implementation of `family`/`op` on `device_type` ("cpu", "cuda")."""
    if family not in FAMILIES:
        raise ConfigError(f"kernels.register: unknown family {family!r}; choose from {list(FAMILIES)}")
    if op not in OPS[family]:
        raise ConfigError(f"kernels.register: family {family!r} has no op {op!r} (parity never looks it up); "
                          f"choose from {list(OPS[family])}")
    # ops look kernels up by `tensor.device.type`: "cuda", never "cuda:0" or "CUDA"
    if not isinstance(device_type, str) or not device_type or device_type != device_type.strip().lower() \
            or ":" in device_type:
        raise ConfigError(f"kernels.register: device type {device_type!r} is no tensor's device.type; give "
                          "the bare lower-case type, e.g. 'cpu' or 'cuda' (no index)")
    if not callable(fn):
        raise ConfigError(f"kernels.register: the kernel for {family}/{op} must be callable, got {fn!r}")
    _registry[(family, op, device_type)] = fn


def registrations(device_type: str | None = None) -> dict[tuple[str, str, str], Callable[..., Any]]:
    """A copy of the registry, (family, op, device type) -> implementation; only `device_type`'s if given."""
    return {key: fn for key, fn in _registry.items() if device_type in (None, key[2])}


@contextmanager
def replaced(family: str, op: str, device_type: str, fn: Callable[..., Any]) -> Iterator[None]:
    """`fn` registered as `family`/`op` on `device_type` inside the block; the previous registration
    (or none) is restored when the block ends, failed or not."""
    key = (family, op, device_type)
    before = _registry.get(key)
    register(family, op, device_type, fn)
    try:
        yield
    finally:
        if before is None:
            del _registry[key]
        else:
            _registry[key] = before


def impl(family: str, op: str, device_type: str) -> Callable[..., Any] | None:
    """The invariant implementation to run now, or None when `family` is off; BackendUnavailableError
    when on with none for the device (a silent stock fallback would break invariance).
    """
    if family not in _enabled:
        if family not in FAMILIES:  # a misspelt family would otherwise run the stock op, silently
            raise ConfigError(f"kernels.impl: unknown family {family!r}; choose from {list(FAMILIES)}")
        return None
    fn = _registry.get((family, op, device_type))
    if fn is None:
        raise BackendUnavailableError(
            f"no batch-invariant {family!r} kernel {op!r} for device {device_type!r}; run on a device "
            f"parity has kernels for ({sorted({d for (_, _, d) in _registry})}) or switch the family "
            f"off with kernels.enable(families=...)"
        )
    return fn
