"""Audit rows and the noise floor they give the other rows of a run: an audit row fails on a failed
seed control or a claimed-invariant backend found otherwise; its `repeat` is the backend's noise
(`backend_noise`) for rows of the same model, backend and dtype. Audits run first in the plan.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from parity.backends import Backend
from parity.nightly.history import now
from parity.nightly.regression import Noise
from parity.nightly.rows import RowKey, RowResult
from parity.workload.cases import Case

AUDIT = "audit"
#: summary keys of an audit row (each a trend chart on the nightly page, so few): the two verdicts
#: where measured, "audit_<check>_<figure>" per check that ran, and the repeat's mean |Δlogp| (the
#: noise floor).
#: The whole result is in the row's provenance.
FIGURES = ("differing_requests", "max_abs_logprob_diff")
NOISE_FLOOR_KEY = "audit_repeat_mean_abs_logprob_diff"
#: provenance key of a row's engine start options (`parity.nightly.execute.engine_options`): an
#: adapter, a tensor-parallel degree, route capture or prefix caching make another engine.
ENGINE_OPTIONS = "engine_options"
#: checks beside batch invariance that the reference engine (invariant kernels) must pass too.
REFERENCE_IDENTICAL = ("prefill_decode", "prefix_cache")


def audit_row(run_id: str, key: RowKey, case: Case, engine: Backend, provenance: dict[str, Any],
              timing: dict[str, float], device: str = "cpu") -> RowResult:
    """An audit case's row: every check of `parity.audit` on the case's requests (see the module),
    on the run's device."""
    # the audit drives a running engine; importing nightly stays light
    from parity.audit import audit

    t0 = time.perf_counter()
    result = audit(None, engine, case=case, dtype=key.dtype, device=device)
    timing["case_s"] = round(time.perf_counter() - t0, 3)
    # a verdict whose checks did not run is left out, as their figures are: 0 would read as "no"
    summary: dict[str, Any] = {f"audit_{name}": float(getattr(result, name))
                               for name in ("deterministic", "batch_invariant") if result.measured(name)}
    for name, check in result.checks.items():
        if check.skipped is None:
            summary.update({f"audit_{name}_{figure}": float(getattr(check, figure)) for figure in FIGURES})
    if result.checks["repeat"].skipped is None:
        summary[NOISE_FLOOR_KEY] = result.checks["repeat"].mean_abs_logprob_diff
    violations = []
    if not result.control_held:
        violations.append({"metric": "audit seed: samples identical under other seeds (seeds ignored?)",
                           "value": 1.0, "limit": 0.0})
    # only a check that ran and differed counts: a skipped one (one request has no other order) is not
    # "identical", yet nothing differed (it failed the batch-invariant reference with "0 > limit 0")
    differing = sum(result.checks[c].differing_requests for c in ("repeat", "batch", "order")
                    if result.checks[c].skipped is None)
    if engine.meta.get("batch_invariant") and differing:
        violations.append({"metric": "audit: requests that differ although the backend is batch-invariant",
                           "value": float(differing), "limit": 0.0})
    # parity's own engine with invariant kernels is documented identical on every check (docs/DESIGN.md:
    # its rollout logprobs are the training forward's bit for bit), so a check beside the verdict that
    # differs is a finding there too; other backends claim batch invariance only
    if getattr(engine, "name", None) == "reference" and engine.meta.get("batch_invariant"):
        for name in REFERENCE_IDENTICAL:
            check = result.checks[name]
            if check.skipped is None and check.differing_requests:
                violations.append({"metric": f"audit {name}: requests that differ although the reference "
                                             "engine is identical on every check",
                                   "value": float(check.differing_requests), "limit": 0.0})
    return RowResult(run_id=run_id, key=key, status="fail" if violations else "pass", summary=summary,
                     violations=violations,
                     provenance={**provenance, "kind": AUDIT, "backend_meta": dict(engine.meta),
                                 AUDIT: result.to_dict()},
                     timing=timing, finished_at=now())


def backend_noise(rows: Iterable[RowResult], row: RowResult) -> Noise | None:
    """The noise of `row`'s backend: the repeat check of an audit row of the same run, model,
    backend, dtype, variant and engine options (a route-capture, prefix-cache, LoRA or tensor-parallel
    engine is another engine, whose noise the plain one's does not measure); None when there is none
    (or its repeat did not run). Of several such audits the first by key, not the first to finish
    (a parallel run finishes them in any order)."""
    for other in sorted(rows, key=lambda r: str(r.key)):
        audit = other.provenance.get(AUDIT)
        if other.provenance.get("kind") != AUDIT or audit is None or other.status == "error":
            continue
        same = _engine(other) == _engine(row)
        repeat = audit["checks"]["repeat"]
        if same and repeat["skipped"] is None:
            return Noise(source=other.key.label, deterministic=bool(repeat["identical"]),
                         mean_abs_logprob_diff=float(repeat["mean_abs_logprob_diff"]),
                         max_abs_logprob_diff=float(repeat["max_abs_logprob_diff"]),
                         differing_requests=int(repeat["differing_requests"]),
                         requests=int(repeat["requests"]))
    return None


def _engine(row: RowResult) -> tuple[Any, ...]:
    """What makes a row's engine: backend, dtype, variant, model, start options (None: not recorded)."""
    return (row.key.backend, row.key.dtype, row.key.router_replay, row.provenance.get("model"),
            row.provenance.get(ENGINE_OPTIONS))
