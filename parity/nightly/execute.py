"""One row's work, wherever it runs: start (or reuse) the backend, run the case, return the row.

Both executors call `execute_row`: the local one in the driver's process, the Ray one inside a
worker actor on any node. It reads no history and writes none: the row comes back unjudged
(no baseline verdict) and the driver judges it (`runner.judge_row`) and stores it. An exception
becomes an error row here, so one broken backend never ends the night.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from dataclasses import asdict
from typing import Any

import numpy as np

from parity.backends import close_dead_backends, prefix_cache_options, route_capture_options, shared_backend
from parity.cases import Case
from parity.compare import compare
from parity.nightly.history import now
from parity.nightly.rows import RowKey, RowResult, row_status
from parity.schema import NO_REPLAY

#: backends whose engine takes a `device` option; the others run where their build runs.
DEVICE_BACKENDS = ("reference", "hf")


PREFIX_CACHE = "prefix-cache-"


def prefix_cache_variant(enabled: bool) -> str:
    """A trajectory row's variant (`RowKey.router_replay`) for a prefix-cache setting."""
    return PREFIX_CACHE + ("on" if enabled else "off")


def replay_mode(key: RowKey) -> str | None:
    """The router-replay mode `compare` runs a row with (None: no replay)."""
    if key.router_replay.startswith(PREFIX_CACHE) or key.router_replay in ("", NO_REPLAY):
        return None
    return key.router_replay


def tensor_parallel(key: RowKey, case: Case) -> int | None:
    """The row's tensor-parallel degree: the case's `reference_tensor_parallel_size` on a reference
    row when above 1, else None (one process, the whole model)."""
    tp = case.reference_tensor_parallel_size
    return tp if key.backend == "reference" and tp > 1 else None


def engine_options(key: RowKey, case: Case, device: str) -> dict[str, Any]:
    """The `shared_backend` options of a row: prefix caching for a prefix-cache variant, route
    capture for a replay mode that needs it, the device for backends that take one (only when it
    is not the CPU default, so CPU rows share today's engines), the tensor-parallel degree."""
    if key.router_replay.startswith(PREFIX_CACHE):
        options = prefix_cache_options(key.backend, key.router_replay == prefix_cache_variant(True))
    else:
        options = route_capture_options(key.backend, replay_mode(key))
    options = dict(options)
    if device != "cpu" and key.backend in DEVICE_BACKENDS:
        options["device"] = device
    tp = tensor_parallel(key, case)
    if tp is not None:
        options["tensor_parallel_size"] = tp
    return options


def local_placement() -> dict[str, Any]:
    """Where a row of the local executor ran: this host and process."""
    return {"executor": "local", "host": socket.gethostname(), "pid": os.getpid()}


def execute_row(run_id: str, key: RowKey, case: Case, *, reference: str, device: str = "cpu",
                gold: bool | None = None, placement: dict[str, Any] | None = None) -> RowResult:
    """Run one cell: its status reflects the tolerance limits only (`verdict` None).

    gold: the gold forward of a compare row (`parity.compare`'s `gold`; None: where it is cheap).
    placement: where it ran (executor, host or Ray node, process, GPUs), kept in the row's
        provenance under "ran_on"; None = `local_placement()`.
    """
    provenance: dict[str, Any] = {
        "case": case.name, "case_hash": case.hash, "case_file": str(case.path or ""), "model": case.model,
        "seeds": case.seeds, "reference_kernels": reference,
        "ran_on": placement if placement is not None else local_placement(),
    }
    timing: dict[str, float] = {}
    stage = "backend failed to start"
    try:
        t0 = time.perf_counter()
        options = engine_options(key, case, device)
        engine = shared_backend(key.backend, case.model, dtype=key.dtype, **options)
        timing["start_s"] = round(time.perf_counter() - t0, 3)
        stage = "case failed"
        t0 = time.perf_counter()
        if case.kind == "lifecycle":
            return lifecycle_row(run_id, key, case, engine, provenance, timing)
        tp = options.get("tensor_parallel_size")
        report = compare(None, engine, case=case, dtype=key.dtype, tolerance=case.tolerance_for(key.backend),
                         reference=reference, device=device, router_replay=replay_mode(key), gold=gold,
                         **({"tensor_parallel": tp} if tp is not None else {}))
        timing["case_s"] = round(time.perf_counter() - t0, 3)
    except Exception as exc:  # an error row, by design: one broken backend must not end the night
        trace = "".join(traceback.format_exception(exc))[-4000:]
        dead = close_dead_backends()  # an engine this row killed must not fail every later row
        note = "".join(f"; the {name} engine died and was closed; the next row starts a new one"
                       for name in dead)
        return error_row(run_id, key, f"{stage}: {type(exc).__name__}: {exc}{note}",
                         {**provenance, "traceback": trace}, timing)
    return RowResult(
        run_id=run_id, key=key, status=row_status(report.violations, None), summary=dict(report.summary),
        violations=[v._asdict() for v in report.violations], provenance={**report.provenance, **provenance},
        timing=timing, abs_diff=np.abs(report.log_ratio()), report_json=report.to_json(), finished_at=now(),
    )


def error_row(run_id: str, key: RowKey, error: str, provenance: dict[str, Any],
              timing: dict[str, float] | None = None) -> RowResult:
    """A row that did not run to the end; `error` is the one-line cause."""
    return RowResult(run_id=run_id, key=key, status="error", error=error, provenance=provenance,
                     timing=timing or {}, finished_at=now())


def lifecycle_row(run_id: str, key: RowKey, case: Case, engine: Any, provenance: dict[str, Any],
                  timing: dict[str, float]) -> RowResult:
    """A lifecycle case's row: `parity.lifecycle` on the case's prompts. Each failed check is a
    violation (a "fail" row); skipped checks (transitions the backend refuses) do not fail it.
    Lifecycle rows have no per-token drift, so no regression test against a baseline."""
    # the checks drive a running engine and load torch; importing nightly stays light
    from parity.lifecycle import run_lifecycle

    t0 = time.perf_counter()
    report = run_lifecycle(engine, case.requests)
    timing["case_s"] = round(time.perf_counter() - t0, 3)
    counts = {status: sum(r.status == status for r in report.results) for status in ("pass", "fail", "skip")}
    violations = [{"metric": f"lifecycle {r.name}: {r.violation[0]}", "value": r.violation[1],
                   "limit": r.violation[2]} for r in report.results if r.violation is not None]
    return RowResult(
        run_id=run_id, key=key, status="pass" if report.passed else "fail",
        summary={f"lifecycle_checks_{status}": float(n) for status, n in counts.items()},
        violations=violations,
        provenance={**provenance, "kind": "lifecycle", "backend_meta": dict(engine.meta),
                    "lifecycle": [asdict(r) for r in report.results]},
        timing=timing, finished_at=now())
