"""The engines of a nightly run: which engine each row uses, and the rows in engine order.

A row's `EngineKey` is the `shared_backend` cache key; an executor runs one engine's rows together
and closes it after the last (`PlannedRow.last`), so at most one engine per process is alive (31
engines of the built-in matrix, 15 vLLM at ~3 GiB, do not fit in 24 GiB).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from parity.nightly.execute import engine_options
from parity.nightly.memory import EngineNeed, engine_need
from parity.nightly.rows import RowKey
from parity.workload.cases import Case


@dataclass(frozen=True)
class EngineKey:
    """One engine: `shared_backend(backend, model, dtype=dtype, **dict(options))`; options sorted."""

    backend: str
    model: str
    dtype: str
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        """e.g. "vllm tiny-llama bfloat16 enable_prefix_caching=True"."""
        return " ".join([self.backend, self.model, self.dtype, *(f"{k}={v}" for k, v in self.options)])

    def need(self) -> EngineNeed:
        """Its estimated host memory (`parity.nightly.memory.engine_need`)."""
        return engine_need(self.backend, self.model)


def engine_key(key: RowKey, case: Case, device: str) -> EngineKey:
    """The engine row `key` of `case` runs on (its `engine_options` on `device`)."""
    return EngineKey(key.backend, str(case.model), key.dtype,
                     tuple(sorted(engine_options(key, case, device).items())))


@dataclass(frozen=True)
class PlannedRow:
    """A row to run, its engine, and whether it is the last row of that engine in its queue
    (the executor closes the engine right after it)."""

    key: RowKey
    case: Case
    engine: EngineKey
    last: bool


def by_engine(todo: Iterable[tuple[RowKey, Case]], device: str) -> dict[EngineKey, list[tuple[RowKey, Case]]]:
    """The rows grouped by engine: engines in the order their first row appears in `todo`, each
    engine's rows in matrix order."""
    groups: dict[EngineKey, list[tuple[RowKey, Case]]] = {}
    for key, case in todo:
        groups.setdefault(engine_key(key, case, device), []).append((key, case))
    return groups


def engine_order(rows: Iterable[tuple[RowKey, Case]], device: str) -> list[PlannedRow]:
    """`rows` to run in one process, one engine after another (`by_engine`), each engine's last
    row marked."""
    planned = []
    for engine, group in by_engine(rows, device).items():
        planned += [PlannedRow(key, case, engine, last=i == len(group) - 1)
                    for i, (key, case) in enumerate(group)]
    return planned
