"""Lifecycle checks: do a rollout engine's state transitions leave its numbers alone?

Each check samples the same seeded requests before and after one transition and compares ids and
logprobs bit for bit: `repeat` (the control), `prefix_cache_reset`, `sleep_wake` (level 1),
`sleep_wake_2` (weights discarded and reloaded), `kv_cache_release`, and `weight_update` (scores
follow perturbed weights, then return to the bit on the originals). A refused transition is
skipped with the backend's words, never passed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

from parity.backends.base import Backend
from parity.core.errors import ConfigError, UnsupportedError
from parity.core.types import Request, Rollout, SamplingParams

CHECKS: tuple[str, ...] = ("repeat", "prefix_cache_reset", "sleep_wake", "sleep_wake_2", "kv_cache_release",
                           "weight_update")
CheckStatus = Literal["pass", "fail", "skip"]


@dataclass(frozen=True)
class CheckResult:
    """One check: its status, what ran (or why it was skipped), and its numbers.

    metrics: "samples", "samples_with_other_tokens", "max_abs_logprob_diff" (nats, where tokens
    agree), or `WeightSyncResult` fields. violation: (metric, value, limit) of a failed check.
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


def _max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """max |a - b| over positions where the two differ: the same number on both sides (-inf and -inf,
    NaN and NaN) is no difference, a NaN on one side only is NaN (a difference without a size)."""
    x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
    differ = ~((x == y) | (np.isnan(x) & np.isnan(y)))
    if not differ.any():
        return 0.0
    with np.errstate(invalid="ignore"):
        return float(np.max(np.abs(x[differ] - y[differ])))  # np.max keeps a NaN


def same_rollouts(before: Sequence[Rollout], after: Sequence[Rollout]) -> dict[str, float]:
    """How two runs of the same requests differ: sample counts and the max |Δlogp| on equal tokens
    (NaN when a logprob is NaN on one side only)."""
    if [r.key for r in before] != [r.key for r in after]:
        raise ConfigError("the two runs hold different samples; compare runs of the same requests")
    other = [a.token_ids != b.token_ids for a, b in zip(before, after)]
    diffs = [0.0 if o else _max_abs_diff(a.logprobs, b.logprobs) for a, b, o in zip(before, after, other)]
    # np.max, not max(): Python's max keeps whichever of a number and a NaN comes first
    return {"samples": float(len(before)), "samples_with_other_tokens": float(sum(other)),
            "max_abs_logprob_diff": float(np.max(diffs)) if diffs else 0.0}


def _comparison(name: str, before: Sequence[Rollout], after: Sequence[Rollout], what: str) -> CheckResult:
    if not any(r.token_ids for r in (*before, *after)):  # two empty runs agree on no evidence
        return CheckResult(name, "skip", f"{what}: every sample ({len(before)}) has no response token in "
                                         "either run, so nothing was compared")
    m = same_rollouts(before, after)
    samples, other, diff = int(m["samples"]), int(m["samples_with_other_tokens"]), m["max_abs_logprob_diff"]
    if other == 0 and diff == 0.0:
        return CheckResult(name, "pass", f"{what}: identical tokens and logprobs ({samples} samples)", m)
    violation = ("samples_with_other_tokens", float(other), 0.0) if other else \
        ("max_abs_logprob_diff", diff, 0.0)
    return CheckResult(name, "fail", f"{what}: {other} of {samples} samples changed tokens; max |dlogp| "
                                     f"{diff:.3g} on the rest", m, violation)


#: the relative size of the weight-update check's perturbation (a push must move the scores).
WEIGHT_SCALE = 0.2


def run_lifecycle(backend: Backend, requests: Sequence[Request] | None = None, *,
                  checks: Sequence[str] = CHECKS, weight_scale: float = WEIGHT_SCALE, weight_seed: int = 0,
                  weight_tolerance: float = 0.15, reference: str = "reference") -> LifecycleReport:
    """Run `checks` (in `CHECKS` order) on a running `backend`; weights are perturbed as
    w * (1 + scale * N(0, 1)), and `weight_tolerance` (nats) bounds the pushed backend against
    `reference` (default: the fp32 training forward).
    """
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        raise ConfigError(f"unknown lifecycle checks {unknown}; choose from {list(CHECKS)}")
    check_weight_settings(weight_scale, weight_tolerance)
    requests = list(requests) if requests is not None else default_requests()
    baseline = backend.generate(requests)
    # each transition is judged against the run just before it, not the first run: a change an
    # earlier transition left behind is that transition's failure, not every later one's
    before = baseline
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
        after = backend.generate(requests)
        results.append(_comparison(name, before, after, what))
        before = after
    return LifecycleReport(backend=backend.name, model=str(backend.model_path), results=tuple(results),
                           meta=dict(backend.meta))


def check_weight_settings(scale: float, tolerance: float) -> None:
    """ConfigError for a weight-update scale or tolerance that decides the check before it runs: a
    scale of 0 pushes no change, so the check failed as "did the push reach the engine?"; a tolerance
    <= 0, NaN or inf failed every push (no score within it, or no shift past it)."""
    for name, value in (("weight_scale", scale), ("weight_tolerance (--weight-tolerance)", tolerance)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
            raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if scale == 0:
        raise ConfigError("weight_scale 0 leaves the weights as they are, so the push could not be told from "
                          "no push; give a scale such as 0.2")
    if tolerance <= 0:
        raise ConfigError(f"weight_tolerance (--weight-tolerance) must be > 0 nats, got {tolerance!r}: no "
                          "pushed backend matches the training forward to 0 or less; e.g. 0.15")


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
    # the weight sync check runs the training forward (torch): loaded here so that `parity lifecycle
    # --help` and the other checks never import it
    from parity.backends.weight_sync import check_weight_sync

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
    # negated, so a NaN figure (a push that left NaN weights) names itself instead of failing unnamed
    if not r.max_abs_diff_new <= tolerance:
        violation = ("max_abs_diff_new", r.max_abs_diff_new, tolerance)
    elif not r.mean_shift > tolerance:
        violation = ("mean_shift (must exceed the tolerance: did the push reach the engine?)", r.mean_shift,
                     tolerance)
    elif r.max_abs_diff_restored != 0.0:
        violation = ("max_abs_diff_restored", r.max_abs_diff_restored, 0.0)
    return CheckResult("weight_update", "pass" if r.passed else "fail", detail, metrics, violation)
