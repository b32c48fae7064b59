"""`parity.audit`: every check on one engine, everything checked before it starts."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from parity.audit.checks import AuditSettings, run_checks
from parity.audit.derived import BATCH_SIZES, check_batch_sizes, single_turn
from parity.audit.result import CHECKS, AuditResult
from parity.backends import Backend, backend_options, check_requests, shared_backend
from parity.backends.base import check_dtype
from parity.backends.borrowed import check_borrowed, check_placement, resolve_device, torch_device_type
from parity.core.errors import ConfigError
from parity.core.schema import BACKEND_NAMES
from parity.core.types import Request, check_int
from parity.models import model_limits
from parity.models.checkpoints import model_text
from parity.report.provenance import provenance
from parity.workload.cases import Case
from parity.workload.resolve import resolve_workload


def audit(model: str | os.PathLike[str] | None, backend: str | Backend, *,
          case: Case | str | os.PathLike[str] | None = None, dtype: str | None = None, device: str = "auto",
          checks: Sequence[str] = CHECKS, batch_sizes: Sequence[int] = BATCH_SIZES, seed: int = 0,
          **backend_options: Any) -> AuditResult:
    """Audit `backend` on `model`: repeat, batch, order, prefill_decode, prefix_cache and seed.

    backend: a registry name (shared, with `backend_options`) or a running `Backend`. case: None is
    `default_case(model)`; multi-turn is refused. dtype: None is the running backend's, else the
    case's first. device: a backend that would run elsewhere is refused before it starts.
    checks: the others are skipped ("not asked for"). batch_sizes: 1 and at least two more.
    seed: for the derived requests.
    """
    # the cheap checks first: a typo costs no model or engine load
    if isinstance(backend, str) and backend not in BACKEND_NAMES:
        raise ConfigError(f"backend: unknown {backend!r}; choose from {', '.join(BACKEND_NAMES)}")
    unknown = [c for c in checks if c not in CHECKS]
    if isinstance(checks, str) or unknown:
        raise ConfigError(f"checks: unknown {unknown or checks!r}; choose from {list(CHECKS)}")
    if not checks:
        raise ConfigError(f"checks is empty: nothing would be measured; give at least one of {list(CHECKS)} "
                          "(--checks), or leave it unset for all")
    check_batch_sizes(batch_sizes)
    device = resolve_device(device, [backend], {str(backend): backend_options})
    _check_device(device)
    the_case = resolve_workload(model, case, None, None)
    model_arg = model_text(model) if model is not None else the_case.model  # a Path stays a path
    requests = single_turn(the_case.requests, f"case {the_case.name!r}")
    limits = model_limits(model_arg)
    limits.check(requests, prefix=f"case {the_case.name!r}: ")
    # a running backend is audited in its own dtype unless another is asked for (and then refused)
    dtype = check_dtype(dtype or (backend.dtype if isinstance(backend, Backend) else the_case.dtypes[0]))
    settings = AuditSettings(checks=tuple(checks), batch_sizes=check_batch_sizes(batch_sizes),
                             seed=check_int(seed, "seed", low=0), context=limits.max_positions)
    engine = _backend(backend, model_arg, dtype, device, backend_options, requests)
    placed = engine.meta.get("device")
    if placed is not None and torch_device_type(placed) != torch_device_type(device):  # runs_on guessed wrong
        raise ConfigError(f"backend {engine.name!r} runs on {placed!r}, not device={device!r}: pass "
                          f"device={placed!r}, or start it on {device!r}")
    results, notes = run_checks(engine, requests, settings)
    prov = provenance(model_arg, backend=engine.name, backend_meta=dict(engine.meta), dtype=dtype,
                      device=device, backend_device=engine.meta.get("device"),
                      reference="none (the backend is compared with itself)", router_replay=None,
                      seeds=the_case.seeds, case=the_case.name, case_hash=the_case.hash,
                      rollout_logprobs=f"sampled here by backend {engine.name!r}",
                      train_logprobs="none (the audit runs no training forward)")
    prov["audit"] = {"checks": list(settings.checks), "batch_sizes": list(settings.batch_sizes),
                     "seed": settings.seed, **notes}
    return AuditResult(backend=engine.name, model=str(prov["model"]), dtype=dtype, provenance=prov,
                       checks=results)


def _check_device(device: str) -> None:
    """ConfigError unless `device` exists here, before an engine starts ("cpu" needs no torch)."""
    if device == "cpu":
        return
    from parity.models.loading import check_device  # torch: `import parity` stays light

    check_device(device)


def _backend(backend: str | Backend, model: str, dtype: str, device: str, options: dict[str, Any],
             requests: Sequence[Request]) -> Backend:
    """The named backend started (shared) on `device` once `requests` are checked against it, or the
    running one checked against the call."""
    if not isinstance(backend, str):
        return check_borrowed(backend, model=model, dtype=dtype, device=device, options=options)
    check_placement(backend, device, options)
    check_requests(backend, requests, options)
    if device != "cpu" and "device" in backend_options(backend):  # reference, hf: placed there
        options = {**options, "device": device}
    return shared_backend(backend, model, dtype=dtype, **options)
