"""The audit's result: one `CheckResult` per check and the two verdicts, with a stable JSON form
(keys in docs/DESIGN.md). NumPy only.

`deterministic` is `repeat` identical; `batch_invariant` is `batch` and `order` identical; a
skipped check is never identical. `seed` is the control: identical only when seeds changed nothing.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from parity.core.errors import InputError
from parity.core.schema import AUDIT_VERDICT_CHECKS
from parity.render.audit import CONTROL, machine_clause, verdict_words

#: the checks, in run order.
CHECKS: tuple[str, ...] = ("repeat", "batch", "order", "prefill_decode", "prefix_cache", "seed")
#: the keys of one check's JSON, in order.
CHECK_KEYS: tuple[str, ...] = ("identical", "requests", "differing_requests", "first_difference",
                               "max_abs_logprob_diff", "mean_abs_logprob_diff", "skipped")
#: the keys of the result's JSON, in order.
RESULT_KEYS: tuple[str, ...] = ("backend", "model", "dtype", "provenance", "checks", "deterministic",
                                "batch_invariant")


@dataclass(frozen=True)
class CheckResult:
    """One check: did two runs of the same seeded requests give the same tokens and logprobs?

    identical: same ids, logprobs (NaN equals NaN) and expert sets. requests: compared;
    differing_requests: with any sample differing. first_difference: None when identical.
    max/mean_abs_logprob_diff: nats over the common token prefix. skipped: why it did not run
    (neither pass nor failure).
    """

    identical: bool
    requests: int
    differing_requests: int
    first_difference: dict[str, Any] | None
    max_abs_logprob_diff: float
    mean_abs_logprob_diff: float
    skipped: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.identical, bool):
            raise InputError(f"check identical must be true or false, got {self.identical!r}")
        for name in ("requests", "differing_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InputError(f"check {name} must be an integer >= 0, got {value!r}")
        if self.differing_requests > self.requests:
            raise InputError(f"check differing_requests ({self.differing_requests}) exceeds requests "
                             f"({self.requests})")
        for name in ("max_abs_logprob_diff", "mean_abs_logprob_diff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
                    or value < 0:
                raise InputError(f"check {name} must be a number >= 0 (nats), got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.first_difference is not None and not isinstance(self.first_difference, dict):
            raise InputError(f"check first_difference must be an object or null, got "
                             f"{self.first_difference!r}")
        if self.skipped is not None and (not isinstance(self.skipped, str) or not self.skipped):
            raise InputError(f"check skipped must be a reason (a non-empty string) or null, got "
                             f"{self.skipped!r}")
        if self.skipped is not None and (self.identical or self.requests):
            raise InputError("a skipped check compares nothing: identical false, requests 0")
        if self.identical != (self.differing_requests == 0 and self.requests > 0):
            raise InputError(f"check identical={self.identical} contradicts {self.differing_requests} of "
                             f"{self.requests} differing requests")

    @classmethod
    def skip(cls, reason: str) -> CheckResult:
        """A check the backend cannot do, with the reason (the backend's own words where it gave them)."""
        return cls(identical=False, requests=0, differing_requests=0, first_difference=None,
                   max_abs_logprob_diff=0.0, mean_abs_logprob_diff=0.0, skipped=reason)

    def to_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in CHECK_KEYS}

    @classmethod
    def from_dict(cls, d: Any, where: str = "check") -> CheckResult:
        """The inverse of `to_dict`; a missing or unknown key is an InputError naming it."""
        _exact_keys(d, CHECK_KEYS, where)
        return cls(**{key: d[key] for key in CHECK_KEYS})

    def describe(self) -> str:
        """One line: identical, or how much differs and where it starts; or why it was skipped."""
        if self.skipped is not None:
            return f"skipped: {self.skipped}"
        if self.identical:
            return f"identical ({self.requests} requests)"
        where = _where(self.first_difference)
        return (f"{self.differing_requests} of {self.requests} requests differ; max |dlogp| "
                f"{self.max_abs_logprob_diff:.3g}, mean {self.mean_abs_logprob_diff:.3g} nats"
                f"{'; first: ' + where if where else ''}")


def _where(first: dict[str, Any] | None) -> str:
    if not first:
        return ""
    text = f"{first.get('what', '?')} of {first.get('request_id')}/{first.get('sample_index')}"
    if first.get("position") is not None:
        text += f" at response token {first['position']}"
    if first.get("route_position") is not None:
        text += f" at position {first['route_position']} layer {first.get('route_layer')}"
    context = first.get("context") or {}
    return text + "".join(f", {k} {v}" for k, v in context.items())


@dataclass(frozen=True)
class AuditResult:
    """Every check of one backend on one model and dtype (`CHECKS` order), with its provenance."""

    backend: str
    model: str
    dtype: str
    provenance: dict[str, Any]
    checks: dict[str, CheckResult]

    def __post_init__(self) -> None:
        for name in ("backend", "model", "dtype"):
            if not isinstance(getattr(self, name), str):
                raise InputError(f"audit {name} must be a string, got {getattr(self, name)!r}")
        if not isinstance(self.provenance, dict):
            raise InputError(f"audit provenance must be an object, got {type(self.provenance).__name__}")
        if not isinstance(self.checks, dict) or list(self.checks) != list(CHECKS) \
                or not all(isinstance(c, CheckResult) for c in self.checks.values()):
            raise InputError(f"audit checks must hold one CheckResult per check, in order: {list(CHECKS)}")

    @property
    def deterministic(self) -> bool:
        """The same batch twice gives the same bits."""
        return self.checks["repeat"].identical

    @property
    def batch_invariant(self) -> bool:
        """A request's bits do not depend on what shares its batch, nor on the batch's order."""
        return self.checks["batch"].identical and self.checks["order"].identical

    def measured(self, verdict: str) -> bool:
        """Whether `verdict` ("deterministic", "batch_invariant") was measured: every check it rests on
        ran, or one that ran differed (a NO needs no more). A False verdict not measured is "not
        checked", never "no"."""
        checks = [self.checks[name] for name in AUDIT_VERDICT_CHECKS[verdict]]
        return all(c.skipped is None for c in checks) or any(c.skipped is None and not c.identical
                                                             for c in checks)

    @property
    def control_held(self) -> bool:
        """Different seeds gave different samples (or the control could not run: greedy sampling)."""
        seed = self.checks[CONTROL]
        return seed.skipped is not None or not seed.identical

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "model": self.model, "dtype": self.dtype,
                "provenance": self.provenance,
                "checks": {name: c.to_dict() for name, c in self.checks.items()},
                "deterministic": self.deterministic, "batch_invariant": self.batch_invariant}

    def to_json(self) -> str:
        # a logprob difference may be inf (a token -inf on one side): JSON's Infinity, as Python writes it
        return json.dumps(self.to_dict(), indent=2, default=str)

    @classmethod
    def from_dict(cls, d: Any) -> AuditResult:
        """The inverse of `to_dict`; the stored verdicts must agree with the checks."""
        _exact_keys(d, RESULT_KEYS, "audit result")
        checks = d["checks"]
        if not isinstance(checks, dict):
            raise InputError("audit result: checks must be an object of check results")
        _exact_keys(checks, CHECKS, "audit result checks")
        result = cls(backend=d["backend"], model=d["model"], dtype=d["dtype"], provenance=d["provenance"],
                     checks={name: CheckResult.from_dict(checks[name], f"check {name!r}") for name in CHECKS})
        for name in ("deterministic", "batch_invariant"):
            if d[name] is not getattr(result, name):
                raise InputError(f"audit result: {name}={d[name]!r} contradicts its checks")
        return result

    @classmethod
    def from_json(cls, text: str) -> AuditResult:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as exc:
            raise InputError(f"not an audit result: invalid JSON ({exc})") from exc

    def replace(self, **changes: Any) -> AuditResult:
        return dataclasses.replace(self, **changes)

    def summary_text(self) -> str:
        """The verdicts (on this engine, workload and machine), then one line per check."""
        width = max(map(len, CHECKS))
        # the batch-invariance words name a check beside the verdict that differs, and which of the
        # verdict's checks ran when not all did: the page's badge says the same (`verdict_words`)
        deterministic, invariant = verdict_words(self.to_dict())
        lines = [f"audit of {self.backend} on {self.model} ({self.dtype}): deterministic {deterministic}, "
                 f"batch-invariant {invariant}; {machine_clause(self.provenance)}"]
        lines += [f"  {name.ljust(width)}  {_describe(name, check)}" for name, check in self.checks.items()]
        if not self.control_held:
            lines.append("  control FAILED: two seeds gave identical samples, so the sampling checks prove "
                         "nothing (are seeds ignored?)")
        return "\n".join(lines)


def _describe(name: str, check: CheckResult) -> str:
    """A check's line; the control's passing row in its own words (different samples are its pass)."""
    if name == CONTROL and check.skipped is None and not check.identical:
        return (f"seeds change the samples: as expected ({check.differing_requests} of {check.requests} "
                "requests differ)")
    return check.describe()


def _exact_keys(d: Any, keys: tuple[str, ...], where: str) -> None:
    if not isinstance(d, dict):
        raise InputError(f"{where} must be a JSON object, got {type(d).__name__}")
    missing = [k for k in keys if k not in d]
    if missing:
        raise InputError(f"{where}: missing key {missing[0]!r}")
    unknown = sorted(set(d) - set(keys))
    if unknown:
        raise InputError(f"{where}: unknown key {unknown[0]!r}; the keys are {list(keys)}")
