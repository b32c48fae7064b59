"""How much memory a nightly engine needs, how many may live at once, and what a failed start
for want of memory looks like.

`EngineNeed` (bytes): KV cache (vLLM-CPU's `VLLM_CPU_KVCACHE_SPACE`), weight files as stored, and
`PROCESS_BYTES` (docs/PERF.md, "Nightly"). `MemoryBudget` admits starts against psutil's
`available`; with nothing held the next engine always starts, and a failed start
(`memory_failure`) is an error row naming need and free memory.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from parity.core.errors import BackendError, ConfigError, ModelNotFoundError
from parity.models.checkpoints import resolve_model

GIB = 1 << 30
MIB = 1 << 20
#: vLLM-CPU's KV-cache size variable (GiB) and the value parity's adapters give it when unset.
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
DEFAULT_KV_CACHE_GIB = 1
#: backends whose engine allocates `KV_CACHE_ENV` GiB at start.
KV_CACHE_BACKENDS = ("vllm", "vllm-server")
#: measured resident memory of each backend's processes beyond KV cache and weights (bytes);
#: a backend not listed (sglang, trtllm: not measurable here) gets `UNKNOWN_PROCESS_BYTES`.
#: Measured unique memory (USS): vLLM's EngineCore 0.45 GiB and worker 0.5 GiB besides the KV
#: cache; the server adds its API process, 0.45 GiB; reference and hf grow a fresh Python process
#: by 0.27-0.37 GiB, torch's import included. Each with about half again as margin.
PROCESS_BYTES: dict[str, int] = {
    "reference": 384 * MIB,
    "hf": 384 * MIB,
    "vllm": 3 * GIB // 2,
    "vllm-server": 2 * GIB,
}
UNKNOWN_PROCESS_BYTES = 4 * GIB
WEIGHT_SUFFIXES = (".safetensors", ".bin")
#: vLLM-CPU's refusal when the KV cache does not fit (vllm/v1/worker/cpu_worker.py), and the OS's.
MEMORY_MESSAGES = ("less than requested memory for kv", "Cannot allocate memory", "out of memory")


@dataclass(frozen=True)
class EngineNeed:
    """An engine's estimated host memory, in bytes, by what holds it."""

    kv_cache: int
    weights: int
    processes: int

    @property
    def total(self) -> int:
        return self.kv_cache + self.weights + self.processes

    def describe(self) -> str:
        """e.g. "3.0 GiB (KV cache 1.0 + weights 0.0 + processes 2.0)"."""
        return (f"{gib(self.total)} GiB (KV cache {gib(self.kv_cache)} + weights {gib(self.weights)} "
                f"+ processes {gib(self.processes)})")


def gib(n: int) -> str:
    """Bytes as GiB with one decimal, the unit of every memory message here."""
    return f"{n / GIB:.1f}"


def kv_cache_bytes(backend: str) -> int:
    """The KV cache a `backend` engine allocates at start (0 for those that allocate per request)."""
    if backend not in KV_CACHE_BACKENDS:
        return 0
    text = os.environ.get(KV_CACHE_ENV, "") or str(DEFAULT_KV_CACHE_GIB)
    try:
        return int(text) * GIB
    except ValueError:
        raise ConfigError(f"{KV_CACHE_ENV}={text!r}: vLLM reads it as whole GiB, e.g. 1") from None


def weight_bytes(model: str | Path) -> int:
    """The stored size of a model's weight files (a built-in name or a checkpoint directory); 0 for
    a checkpoint that is not on this machine (only on a Ray cluster's nodes)."""
    try:
        path = resolve_model(model)
    except ModelNotFoundError:
        return 0
    return sum(p.stat().st_size for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def engine_need(backend: str, model: str | Path) -> EngineNeed:
    """The estimate of one `backend` engine on `model` (see the module doc)."""
    return EngineNeed(kv_cache=kv_cache_bytes(backend), weights=weight_bytes(model),
                      processes=PROCESS_BYTES.get(backend, UNKNOWN_PROCESS_BYTES))


def available_bytes() -> int:
    """Memory the machine can give without swapping now (psutil's `available`)."""
    return int(psutil.virtual_memory().available)


def memory_failure(exc: BaseException, *, free_before: int, need: EngineNeed) -> bool:
    """Whether an engine start failed for want of memory: a MemoryError or out-of-memory message in the
    chain, or an engine failure of a start with less free than the estimate (vLLM only says "Engine
    core initialization failed").
    """
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, MemoryError) or any(m in str(link) for m in MEMORY_MESSAGES):
            return True
        link = link.__cause__ or link.__context__
    return isinstance(exc, BackendError) and free_before < need.total


class MemoryBudget:
    """Which engines may start now: reservations plus the need must fit in the starting available
    memory, today's available plus what ours hold, and `limit`; with nothing reserved, always.
    """

    def __init__(self, limit: int | None = None, available: Callable[[], int] = available_bytes) -> None:
        self._available = available
        self.start = available()
        self.limit = limit
        self.held: dict[Hashable, EngineNeed] = {}

    @property
    def reserved(self) -> int:
        return sum(need.total for need in self.held.values())

    def budget(self) -> int:
        """The bytes the held engines and the next one may take together, as of now."""
        budget = min(self.start, self._available() + self.reserved)
        return budget if self.limit is None else min(budget, self.limit)

    def fits(self, need: EngineNeed) -> bool:
        return not self.held or self.reserved + need.total <= self.budget()

    def reserve(self, holder: Hashable, need: EngineNeed) -> None:
        if holder in self.held:
            raise ValueError(f"{holder!r} already holds an engine; release it first")
        self.held[holder] = need

    def release(self, holder: Hashable) -> None:
        self.held.pop(holder, None)

    def describe(self) -> dict[str, Any]:
        """The budget's numbers in GiB, for provenance and messages."""
        return {"start_gib": gib(self.start), "limit_gib": None if self.limit is None else gib(self.limit),
                "reserved_gib": gib(self.reserved)}
