"""One row's work, wherever it runs: start (or reuse) the backend, run the case, return the row.

Both executors call `execute_row`; it reads and writes no history (the driver judges and stores).
An exception becomes an error row; the engine is closed after its last row (`close_engine`).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import socket
import time
import traceback
from dataclasses import asdict
from typing import Any

import numpy as np

from parity.backends import (
    close_dead_backends,
    close_shared_backend,
    lora_options,
    prefix_cache_options,
    route_capture_options,
    shared_backend,
)
from parity.compare import compare
from parity.core.errors import ConfigError
from parity.core.schema import NO_REPLAY, REFERENCE
from parity.core.types import SamplingParams
from parity.drift.tolerance import Tolerance
from parity.nightly.history import now
from parity.nightly.memory import available_bytes, engine_need, gib, memory_failure
from parity.nightly.noise import AUDIT, ENGINE_OPTIONS, audit_row
from parity.nightly.rows import RowKey, RowResult, row_status
from parity.workload.cases import Case

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
    """The `shared_backend` options of a row: prefix caching, route capture, device (only off the CPU
    default), tensor-parallel degree, the case's adapter.
    """
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
    options.update(lora_options(key.backend, case.lora))
    return options


def recorded_options(key: RowKey, case: Case, device: str) -> dict[str, Any] | None:
    """A row's engine options as `execute_row` records them (`ENGINE_OPTIONS`); None where they cannot
    be made (that row fails to start: an error row, which judges nothing)."""
    try:
        return dict(sorted(engine_options(key, case, device).items()))
    except Exception:  # execute_row turns the same exception into the row's error
        return None


def local_placement() -> dict[str, Any]:
    """Where a row of the local executor ran: this host and process."""
    return {"executor": "local", "host": socket.gethostname(), "pid": os.getpid()}


def execute_row(run_id: str, key: RowKey, case: Case, *, reference: str, device: str = "cpu",
                gold: bool | None = None, placement: dict[str, Any] | None = None,
                close_engine: bool = False) -> RowResult:
    """Run one cell, its status from the tolerance only (`verdict` None); `placement` and `close_engine`
    go into provenance ("ran_on", "engine_closed"), and the engine's start options (`ENGINE_OPTIONS`).
    """
    provenance: dict[str, Any] = {
        "case": case.name, "case_hash": case.hash, "case_file": str(case.path or ""), "model": case.model,
        "seeds": case.seeds, "reference_kernels": reference,
        "ran_on": placement if placement is not None else local_placement(), "engine_closed": close_engine,
    }
    try:
        options = engine_options(key, case, device)
    except Exception as exc:  # no engine to start, so none to close
        return error_row(run_id, key, f"backend failed to start: {type(exc).__name__}: {exc}", provenance)
    provenance[ENGINE_OPTIONS] = dict(sorted(options.items()))  # which audit's noise is this engine's
    row = _run_row(run_id, key, case, options, provenance, reference=reference, device=device, gold=gold)
    if close_engine:
        try:
            close_shared_backend(key.backend, case.model, dtype=key.dtype, **options)
        except Exception as exc:  # the row's numbers stand; the engine is forgotten either way
            row = dataclasses.replace(row, provenance={**row.provenance,
                                                       "engine_close_error": f"{type(exc).__name__}: {exc}"})
    return row


def _run_row(run_id: str, key: RowKey, case: Case, options: dict[str, Any], provenance: dict[str, Any], *,
             reference: str, device: str, gold: bool | None = None) -> RowResult:
    timing: dict[str, float] = {}
    stage = "backend failed to start"
    try:
        t0 = time.perf_counter()
        engine = _start(key, case, options)
        timing["start_s"] = round(time.perf_counter() - t0, 3)
        stage = "case failed"
        t0 = time.perf_counter()
        if case.kind == "lifecycle":
            return lifecycle_row(run_id, key, case, engine, provenance, timing)
        if case.kind == "loop":
            return loop_row(run_id, key, case, engine, provenance, timing, device)
        if case.kind == AUDIT:
            return audit_row(run_id, key, case, engine, provenance, timing, device)
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


class EngineMemoryError(MemoryError):
    """An engine could not start for want of memory; the message says what it needed and what was free."""


def _start(key: RowKey, case: Case, options: dict[str, Any]) -> Any:
    """The row's shared engine; a start failing for want of memory is an EngineMemoryError with the
    estimate and free memory, its leftovers collected first.
    """
    free_before = available_bytes()
    try:
        return shared_backend(key.backend, case.model, dtype=key.dtype, **options)
    except Exception as exc:
        need = engine_need(key.backend, case.model)
        if not memory_failure(exc, free_before=free_before, need=need):
            raise
        gc.collect()
        raise EngineMemoryError(
            f"not enough memory to start the {key.backend} engine: it needs about {need.describe()}, "
            f"{gib(free_before)} GiB was free when it started ({gib(available_bytes())} GiB after it failed "
            f"and was closed); the run goes on: {type(exc).__name__}: {exc}") from exc


def error_row(run_id: str, key: RowKey, error: str, provenance: dict[str, Any],
              timing: dict[str, float] | None = None) -> RowResult:
    """A row that did not run to the end; `error` is the one-line cause."""
    return RowResult(run_id=run_id, key=key, status="error", error=error, provenance=provenance,
                     timing=timing or {}, finished_at=now())


def lifecycle_row(run_id: str, key: RowKey, case: Case, engine: Any, provenance: dict[str, Any],
                  timing: dict[str, float]) -> RowResult:
    """A lifecycle case's row: `parity.audit.lifecycle` on the case's prompts. Each failed check is a
    violation (a "fail" row); skipped checks (transitions the backend refuses) do not fail it.
    Lifecycle rows have no per-token drift, so no regression test against a baseline."""
    # the checks drive a running engine and load torch; importing nightly stays light
    from parity.audit.lifecycle import run_lifecycle

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


def loop_row(run_id: str, key: RowKey, case: Case, engine: Any, provenance: dict[str, Any],
             timing: dict[str, float], device: str) -> RowResult:
    """A loop case's row: `parity.loop` with the reference and the row's backend, summarised by the
    worst and mean step; the tolerance judges each figure's worst step; out of sync or non-bitwise
    reference steps, and updates whose training forward was not bitwise, are violations (no baseline
    test). ConfigError when the case's requests ask for sampling the loop does not do.
    """
    # the loop trains a model and loads torch; importing nightly stays light
    from parity.loop import loop

    t0 = time.perf_counter()
    sampling = _loop_sampling(case)
    backends = [engine] if key.backend == REFERENCE else [REFERENCE, engine]
    record = loop(case.model, backends, steps=case.loop_steps, case=case, lr=case.loop_lr,
                  seed=sampling.seed, n=sampling.n, max_tokens=sampling.max_tokens,
                  temperature=sampling.temperature, dtype=key.dtype, device=device)
    timing["case_s"] = round(time.perf_counter() - t0, 3)
    rows = record.rows(key.backend)
    summary = {
        "max_abs_logprob_diff": _worst(rows, "max_abs_logprob_diff"),
        "mean_abs_logprob_diff": float(np.mean([r["mean_abs_logprob_diff"] for r in rows])),
        "is_ratio_mean": float(np.mean([r["is_ratio_mean"] for r in rows])),
        "k3_kl": _worst(rows, "k3_kl"),
        "loop_steps": float(len(rows)), "loop_steps_in_sync": float(sum(r["weights_in_sync"] for r in rows)),
        "loop_steps_bitwise": float(sum(r["bitwise"] for r in rows)),
        "loop_policy_kl_final": rows[-1]["policy_kl_from_start"],
        "loop_reward_first": rows[0]["reward_mean"], "loop_reward_last": rows[-1]["reward_mean"],
    }
    # the limits the case does not name (all of them without a [tolerance]): the row's backend and
    # dtype defaults, as a compare row of the case gets; judged on the worst step, not the mean one
    tolerance = Tolerance.resolve(case.tolerance_for(key.backend), key.backend, key.dtype)
    worst, at = _worst_step(rows)
    violations = [v._asdict() for v in tolerance.violations(worst)]
    # a violation names the worst step's value; the row shows the mean step for these two: the worst
    # beside them, and at which step each judged figure is worst (new keys: readers skip unknown ones)
    for name in ("mean_abs_logprob_diff", "is_ratio_mean"):
        summary[f"loop_worst_step_{name}"] = worst[name]
    if "frac_tokens_ratio_gt_2" in worst:  # a tolerance limit too: shown, and judged, at its worst step
        summary["frac_tokens_ratio_gt_2"] = worst["frac_tokens_ratio_gt_2"]
    summary["loop_worst_steps"] = "; ".join(f"{name} {value:.6g} at step {at[name]}"
                                            for name, value in worst.items())
    document = record.to_dict()
    # per step row, and per update: the differentiable training forward against the no-grad one the
    # rows measure (`parity loop` exits 1 on each of the three)
    updates = document.get("updates", [])
    for name, where, failed in (
            ("weights out of sync", record.steps, lambda r: not r["weights_in_sync"]),
            ("reference not bitwise", record.steps, lambda r: r["backend"] == REFERENCE and not r["bitwise"]),
            ("training forward not bitwise", updates, lambda u: not u["forward_bitwise"])):
        bad = sorted({r["step"] for r in where if failed(r)})
        if bad:
            violations.append({"metric": f"loop {name} at steps {bad[:5]}", "value": float(len(bad)),
                               "limit": 0.0})
    return RowResult(run_id=run_id, key=key, status="fail" if violations else "pass", summary=summary,
                     violations=violations,
                     provenance={**provenance, "kind": "loop", "loop": document},
                     timing=timing, finished_at=now())


def _loop_sampling(case: Case) -> SamplingParams:
    """The first request's sampling: the loop samples every prompt with its n, temperature and
    max_tokens alone; ConfigError naming a field where a request asks for other sampling."""
    first = case.requests[0].sampling
    runs = SamplingParams(n=first.n, temperature=first.temperature, max_tokens=first.max_tokens)
    for i, request in enumerate(case.requests):
        asked = dataclasses.replace(request.sampling, seed=runs.seed, top_k_logprobs=0)
        field = next((f.name for f in dataclasses.fields(runs)
                      if getattr(asked, f.name) != getattr(runs, f.name)), None)
        if field is not None:
            raise ConfigError(f"loop case {case.name!r}: request {i} sets sampling {field} = "
                              f"{getattr(asked, field)!r}, but the loop samples every prompt with {field} = "
                              f"{getattr(runs, field)!r} (it takes n, temperature and max_tokens from the "
                              f"first request and nothing else); give every request that sampling")
    return first


def _worst(rows: list[dict[str, Any]], name: str) -> float:
    """The largest `name` of the step rows; NaN when any step's is NaN (Python's `max` keeps
    whichever of a number and a NaN comes first, so a NaN step after a finite one would vanish)."""
    return float(np.max([float(r[name]) for r in rows]))


def _worst_step(rows: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, Any]]:
    """The figures a loop row's tolerance judges: each at its worst step (the IS mean farthest from 1;
    NaN where a step's is), so steps above and below a limit do not average into a pass; and the
    "step" of the row each comes from (the first NaN one, as `_worst`'s NaN)."""
    worst, at = {}, {}
    for name in ("max_abs_logprob_diff", "mean_abs_logprob_diff", "k3_kl", "is_ratio_mean",
                 "frac_tokens_ratio_gt_2"):
        if not all(name in r for r in rows):  # rows from before the loop measured it
            continue
        values = np.array([float(r[name]) for r in rows])
        # argmax: a NaN first; the IS mean by its distance from 1
        i = int(np.argmax(np.abs(values - 1.0) if name == "is_ratio_mean" else values))
        worst[name], at[name] = float(values[i]), rows[i].get("step")
    return worst, at
