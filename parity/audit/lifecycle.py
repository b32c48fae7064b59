"""Lifecycle checks: do a rollout engine's state transitions leave its numbers alone?

In RL the rollout engine goes through the same transitions every step: it sleeps while the
trainer runs, wakes up, receives new weights, drops its caches. Each is a place where silent
staleness hides (after a weight update, is it really sampling from the new weights?). Each check
samples the same requests with the same seeds before and after one transition and compares token
ids and logprobs bit for bit:

- `repeat`: two runs with no transition in between (the control: every other check is only
  meaningful if this one passes).
- `prefix_cache_reset`: a run on a warm prefix cache, then one after the cache was reset.
- `sleep_wake`: sleep (level 1: weights offloaded to host memory), wake up, run again.
- `sleep_wake_2`: sleep at level 2 (weights discarded; the backend reloads them on wake from
  where it last got them), wake up, run again.
- `kv_cache_release`: free the KV cache's memory, run again.
- `weight_update`: push perturbed weights; the backend's scores must follow them (close to the
  training forward on the perturbed weights, far from the old scores); push the originals back;
  the scores must return to the bit (`parity.backends.weight_sync`).

A transition the backend (or its build) refuses raises `UnsupportedError`; its check is reported
as skipped with the backend's own words, never as passed.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from parity.backends import get_backend, parse_option
from parity.backends.base import Backend
from parity.backends.weight_sync import check_weight_sync
from parity.core.errors import ConfigError, UnsupportedError
from parity.core.outputs import output_file
from parity.core.types import Request, Rollout, SamplingParams
from parity.workload.cases import resolve_case

CHECKS: tuple[str, ...] = ("repeat", "prefix_cache_reset", "sleep_wake", "sleep_wake_2", "kv_cache_release",
                           "weight_update")
CheckStatus = Literal["pass", "fail", "skip"]


@dataclass(frozen=True)
class CheckResult:
    """One check: its status, what ran (or why it was skipped), and its numbers.

    metrics: for the comparisons, "samples", "samples_with_other_tokens" and
        "max_abs_logprob_diff" (nats, over samples whose tokens agree); for weight_update,
        the `WeightSyncResult` fields.
    violation: for a failed check, (metric, value, limit) of what broke, e.g.
        ("samples_with_other_tokens", 3, 0); None otherwise.
    """

    name: str
    status: CheckStatus
    detail: str
    metrics: dict[str, float] = field(default_factory=dict)
    violation: tuple[str, float, float] | None = None


@dataclass(frozen=True)
class LifecycleReport:
    """Every check of one backend, in run order; `passed` when none failed."""

    backend: str
    model: str
    results: tuple[CheckResult, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(r.status != "fail" for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "model": self.model, "passed": self.passed,
                "results": [asdict(r) for r in self.results], "meta": self.meta}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def summary_text(self) -> str:
        """One line per check: name, status, detail."""
        width = max(len(r.name) for r in self.results)
        lines = [f"lifecycle of {self.backend} on {self.model}: {'PASS' if self.passed else 'FAIL'}"]
        lines += [f"  {r.name.ljust(width)}  {r.status:<4}  {r.detail}" for r in self.results]
        return "\n".join(lines)


def default_requests() -> list[Request]:
    """Six prompts, n=2, temperature 0.8 and top-p 0.95 (so seeds matter), 16 tokens each."""
    rng = np.random.Generator(np.random.PCG64(7))
    sampling = SamplingParams(n=2, temperature=0.8, top_p=0.95, max_tokens=16)
    return [Request(tuple(int(t) for t in rng.integers(3, 259, size=int(rng.integers(4, 24)))),
                    sampling.replace(seed=2000 + i), f"lifecycle-{i}") for i in range(6)]


def same_rollouts(before: Sequence[Rollout], after: Sequence[Rollout]) -> dict[str, float]:
    """How two runs of the same requests differ: sample counts and the max |Δlogp| on equal tokens."""
    if [r.key for r in before] != [r.key for r in after]:
        raise ConfigError("the two runs hold different samples; compare runs of the same requests")
    other = [a.token_ids != b.token_ids for a, b in zip(before, after)]
    diffs = [float(np.max(np.abs(np.subtract(a.logprobs, b.logprobs), dtype=np.float64)))
             if a.logprobs and not o and a.logprobs != b.logprobs else 0.0
             for a, b, o in zip(before, after, other)]
    return {"samples": float(len(before)), "samples_with_other_tokens": float(sum(other)),
            "max_abs_logprob_diff": max(diffs, default=0.0)}


def _comparison(name: str, before: Sequence[Rollout], after: Sequence[Rollout], what: str) -> CheckResult:
    m = same_rollouts(before, after)
    samples, other, diff = int(m["samples"]), int(m["samples_with_other_tokens"]), m["max_abs_logprob_diff"]
    if other == 0 and diff == 0.0:
        return CheckResult(name, "pass", f"{what}: identical tokens and logprobs ({samples} samples)", m)
    violation = ("samples_with_other_tokens", float(other), 0.0) if other else \
        ("max_abs_logprob_diff", diff, 0.0)
    return CheckResult(name, "fail", f"{what}: {other} of {samples} samples changed tokens; max |dlogp| "
                                     f"{diff:.3g} on the rest", m, violation)


def run_lifecycle(backend: Backend, requests: Sequence[Request] | None = None, *,
                  checks: Sequence[str] = CHECKS, weight_scale: float = 0.2, weight_seed: int = 0,
                  weight_tolerance: float = 0.15, reference: str = "reference") -> LifecycleReport:
    """Run `checks` (a subset of `CHECKS`, run in `CHECKS` order) on a running `backend`.

    requests: what to sample before and after each transition (default `default_requests()`).
    weight_scale, weight_seed: the weight perturbation (each weight times 1 + scale * N(0, 1)).
    weight_tolerance: max |dlogp| (nats) between the backend after the push and `reference`
        (default: parity's training forward, fp32) on the perturbed weights.
    """
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        raise ConfigError(f"unknown lifecycle checks {unknown}; choose from {list(CHECKS)}")
    requests = list(requests) if requests is not None else default_requests()
    baseline = backend.generate(requests)
    sleep_note = "" if backend.meta.get("enable_sleep_mode", True) else (
        " (sleep mode is off in this engine, so sleep paused scheduling and dropped the prefix cache; "
        "weights and KV cache stayed in memory)")
    transitions: dict[str, tuple[Callable[[], None], str]] = {
        "repeat": (lambda: None, "two runs, nothing in between"),
        "prefix_cache_reset": (_call(backend, "reset_prefix_cache"), "warm prefix cache vs after a reset"),
        "sleep_wake": (_sleep_wake(backend, 1), "before sleep vs after wake up" + sleep_note),
        "sleep_wake_2": (_sleep_wake(backend, 2), "before a level-2 sleep vs after wake up" + sleep_note),
        "kv_cache_release": (_call(backend, "release_kv_cache"), "before vs after releasing the KV cache"),
    }
    results = []
    for name in (c for c in CHECKS if c in checks):
        if name == "weight_update":
            results.append(_weight_update(backend, baseline, weight_scale, weight_seed, weight_tolerance,
                                          reference))
            continue
        transition, what = transitions[name]
        try:
            transition()
        except UnsupportedError as e:
            results.append(CheckResult(name, "skip", str(e)))
            continue
        results.append(_comparison(name, baseline, backend.generate(requests), what))
    return LifecycleReport(backend=backend.name, model=str(backend.model_path), results=tuple(results),
                           meta=dict(backend.meta))


def _call(backend: Backend, method: str) -> Callable[..., None]:
    """`backend.method`, or a call that raises UnsupportedError where the backend has no such method."""
    bound = getattr(backend, method, None)
    if bound is None:
        def missing(**_: Any) -> None:
            raise UnsupportedError(f"backend {backend.name!r} has no {method}")
        return missing
    return bound


def _sleep_wake(backend: Backend, level: int) -> Callable[[], None]:
    sleep, wake_up = _call(backend, "sleep"), _call(backend, "wake_up")

    def transition() -> None:
        sleep(level=level)
        wake_up()
    return transition


def _weight_update(backend: Backend, baseline: Sequence[Rollout], scale: float, seed: int, tolerance: float,
                   reference: str) -> CheckResult:
    if type(backend).update_weights is Backend.update_weights:
        return CheckResult("weight_update", "skip", f"backend {backend.name!r} has no weight-update API")
    try:
        r = check_weight_sync(backend, baseline, reference=reference, scale=scale, seed=seed,
                              tolerance=tolerance)
    except UnsupportedError as e:
        return CheckResult("weight_update", "skip", str(e))
    metrics = {"max_abs_diff_new": r.max_abs_diff_new, "mean_shift": r.mean_shift, "tolerance": r.tolerance,
               "max_abs_diff_restored": r.max_abs_diff_restored}
    detail = (f"after the push max |dlogp| vs the {reference} forward on the new weights "
              f"{r.max_abs_diff_new:.3g} (limit {tolerance:g}), mean shift from the old scores "
              f"{r.mean_shift:.3g}; after restoring, max |dlogp| vs before {r.max_abs_diff_restored:.3g}")
    violation = None
    if r.max_abs_diff_new > tolerance:
        violation = ("max_abs_diff_new", r.max_abs_diff_new, tolerance)
    elif r.mean_shift <= tolerance:
        violation = ("mean_shift (must exceed the tolerance: did the push reach the engine?)", r.mean_shift,
                     tolerance)
    elif r.max_abs_diff_restored != 0.0:
        violation = ("max_abs_diff_restored", r.max_abs_diff_restored, 0.0)
    return CheckResult("weight_update", "pass" if r.passed else "fail", detail, metrics, violation)


def main(argv: Sequence[str]) -> int:
    """`parity lifecycle`: run the checks on one backend; exit 0 when none failed, 1 when one did.

    Errors (bad options, a backend that fails to start) raise ParityError, which the `parity`
    command prints as one line with exit code 2.
    """
    parser = argparse.ArgumentParser(
        prog="parity lifecycle",
        description="Sample the same requests before and after each lifecycle transition of a running "
                    "backend (cache reset, sleep/wake, KV-cache release, weight update) and compare token "
                    "ids and logprobs bit for bit. Exit 0 when no check failed (skips included), 1 when "
                    "one did, 2 on an error.")
    parser.add_argument("--backend", required=True, help="backend name, e.g. vllm or vllm-server")
    parser.add_argument("--model", help="built-in checkpoint or local HF checkpoint; optional with --case")
    parser.add_argument("--case", type=Path,
                        help="take the requests (and the model) from this case file or name in cases/")
    parser.add_argument("--dtype", help="model dtype (default: the case's first dtype, else bfloat16)")
    parser.add_argument("--checks", default=",".join(CHECKS),
                        help=f"comma-separated checks to run (default: all: {','.join(CHECKS)})")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="backend option, repeatable; e.g. --option url=http://127.0.0.1:8000")
    parser.add_argument("--weight-tolerance", type=float, default=0.15, metavar="NATS",
                        help="max |dlogp| after a weight push vs the training forward (default: 0.15)")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the results as JSON to OUT")
    parser.add_argument("--verbose", action="store_true", help="print the traceback of an unexpected error")
    args = parser.parse_args(list(argv))
    case = resolve_case(args.case, what="--case") if args.case is not None else None
    model = args.model or (case.model if case is not None else None)
    if model is None:
        raise ConfigError("parity lifecycle needs --model (or --case naming a model)")
    dtype = args.dtype or (case.dtypes[0] if case is not None and case.dtypes else "bfloat16")
    checks = tuple(c.strip() for c in args.checks.split(",") if c.strip())
    options = dict(parse_option(text) for text in args.option)
    if args.json is not None:
        output_file(args.json, "--json")  # before any work, as compare checks its outputs
    with get_backend(args.backend, model, dtype=dtype, **options) as backend:
        report = run_lifecycle(backend, case.requests if case is not None else None, checks=checks,
                               weight_tolerance=args.weight_tolerance)
    print(report.summary_text())
    if args.json is not None:
        args.json.write_text(report.to_json(), encoding="utf-8")
        print(f"wrote {args.json}")
    return 0 if report.passed else 1
