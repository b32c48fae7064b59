"""Pass/fail limits on a parity summary, with defaults per backend class and dtype (of a mixed pair,
the less precise one's: `pair_dtype`).

`reference` is held to exact equality (every limit 0). Others get `DEFAULTS` per dtype, derived
by the rule docs/PRECISION.md states: twice the worst measured value, rounded up to one
significant digit, with floors against sampling and counting noise.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from parity.core.errors import ConfigError
from parity.core.schema import REFERENCE, text_apart
from parity.core.strict import check_dtype, from_mapping

#: the limits calibrated per dtype, in the order of `DEFAULTS`' rows.
_CALIBRATED = ("max_abs_logprob_diff", "mean_abs_logprob_diff", "is_ratio_mean_tol", "k3_kl_max")
#: shares of tokens, the same for every dtype: five tokens of the 512-token default workload.
_SHARES = {"frac_tokens_ratio_gt_2_max": 0.01, "frac_tokens_outside_support_max": 0.01}
#: default limits of a production backend by model dtype (docs/PRECISION.md, "Tolerances"); the
#: `Tolerance` field defaults are the bf16 row.
DEFAULTS: dict[str, dict[str, float]] = {
    dtype: {**dict(zip(_CALIBRATED, limits)), **_SHARES}
    for dtype, limits in (
        # dtype       max |Δ|  mean |Δ|  |IS mean - 1|  k3 KL
        ("bfloat16", (6.0, 0.07, 0.06, 0.02)),
        ("float16", (6.0, 0.009, 0.008, 0.003)),
        ("float32", (0.003, 1e-5, 8e-6, 5e-9)),
    )
}


def pair_dtype(trainer: str, rollout: str | None = None) -> str:
    """The dtype whose `DEFAULTS` judge a comparison of a `trainer`-dtype forward with `rollout`-dtype
    rollouts (None: the trainer's): the less precise of the two, whose rounding the drift carries
    (verl's fp32-logits trainer against bf16 vLLM drifts as bf16 does)."""
    trainer = check_dtype(trainer)
    rollout = trainer if rollout is None else check_dtype(rollout, "rollout dtype")
    return max((trainer, rollout), key=lambda d: DEFAULTS[d]["mean_abs_logprob_diff"])


class Violation(NamedTuple):
    """One failed check: the summary key, its measured value and the limit it broke."""

    metric: str
    value: float
    limit: float

    def describe(self) -> str:
        """One line a person can act on, e.g. `max_abs_logprob_diff = 0.73 > limit 0.5`."""
        limit = f"{self.limit:g}" if float(f"{self.limit:g}") == self.limit else repr(self.limit)
        # the value with the digits that tell it from its limit (0.0700000012 is not "0.07 > limit 0.07")
        if Tolerance.CHECKS_BY_METRIC.get(self.metric) == "mean1":
            gap, mean = text_apart(abs(self.value - 1.0), 6, (self.limit,)), text_apart(self.value, 6, (1.0,))
            return f"|{self.metric} - 1| = {gap} > limit {limit} ({self.metric} = {mean})"
        return f"{self.metric} = {text_apart(self.value, 6, (self.limit,))} > limit {limit}"


@dataclass(frozen=True)
class Tolerance:
    """Limits a `ParityReport.summary` must satisfy; `None` disables a check.

    max/mean_abs_logprob_diff: per-token |logp_train - logp_rollout| (nats). is_ratio_mean_tol:
    |mean ratio - 1|. k3_kl_max: nats per token. frac_tokens_ratio_gt_2_max: max(r, 1/r) > 2.
    frac_tokens_outside_support_max: tokens one side gives -inf.
    """

    max_abs_logprob_diff: float | None = 6.0
    mean_abs_logprob_diff: float | None = 0.07
    is_ratio_mean_tol: float | None = 0.06
    k3_kl_max: float | None = 0.02
    frac_tokens_ratio_gt_2_max: float | None = 0.01
    frac_tokens_outside_support_max: float | None = 0.01

    #: limit field -> (summary key it applies to, how: "max" (value <= limit) or
    #: "mean1" (|value - 1| <= limit)).
    CHECKS: ClassVar[dict[str, tuple[str, str]]] = {
        "max_abs_logprob_diff": ("max_abs_logprob_diff", "max"),
        "mean_abs_logprob_diff": ("mean_abs_logprob_diff", "max"),
        "is_ratio_mean_tol": ("is_ratio_mean", "mean1"),
        "k3_kl_max": ("k3_kl", "max"),
        "frac_tokens_ratio_gt_2_max": ("frac_tokens_ratio_gt_2", "max"),
        "frac_tokens_outside_support_max": ("frac_tokens_outside_support", "max"),
    }
    CHECKS_BY_METRIC: ClassVar[dict[str, str]] = {key: how for key, how in CHECKS.values()}

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ConfigError(f"tolerance.{f.name} must be a finite number >= 0 or None, got {value!r}")

    @classmethod
    def exact(cls) -> Tolerance:
        """All limits zero: bitwise equality of the two logprob arrays."""
        return cls(**{f.name: 0.0 for f in dataclasses.fields(cls)})

    @classmethod
    def for_backend(cls, backend: str, dtype: str = "bfloat16",
                    rollout_dtype: str | None = None) -> Tolerance:
        """Default limits: exact for `reference` in one dtype, else `DEFAULTS` of `pair_dtype(dtype,
        rollout_dtype)`.
        """
        pair = pair_dtype(dtype, rollout_dtype)
        same = rollout_dtype is None or rollout_dtype == dtype
        return cls.exact() if backend == REFERENCE and same else cls(**DEFAULTS[pair])

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, where: str = "tolerance") -> Tolerance:
        return from_mapping(cls, d, where=where)

    @classmethod
    def resolve(cls, value: Tolerance | dict[str, Any] | None, backend: str,
                dtype: str = "bfloat16", rollout_dtype: str | None = None) -> Tolerance:
        """A user's `tolerance=` -> Tolerance: None is `for_backend(...)`; a dict overrides its fields."""
        if value is None:
            return cls.for_backend(backend, dtype, rollout_dtype)
        if isinstance(value, _GivenLimits):  # a case's table: the limits it names over this row's defaults
            base = cls.for_backend(backend, dtype, rollout_dtype).to_dict()
            return cls.from_dict({**base, **value.given()})
        if isinstance(value, Tolerance):
            return value
        if isinstance(value, dict):
            base = cls.for_backend(backend, dtype, rollout_dtype).to_dict()
            return cls.from_dict({**base, **value})
        raise ConfigError(
            f"tolerance must be a parity.Tolerance, a dict of its fields or None, got {type(value).__name__}"
        )

    def to_dict(self) -> dict[str, float | None]:
        return dataclasses.asdict(self)

    def violations(self, summary: dict[str, Any]) -> list[Violation]:
        """Every check the summary fails; NaN always fails, a key missing from it is skipped."""
        failed = []
        for name, (key, how) in self.CHECKS.items():
            limit = getattr(self, name)
            if limit is None or key not in summary:
                continue
            value = float(summary[key])
            measured = abs(value - 1.0) if how == "mean1" else value
            if not (measured <= limit):
                failed.append(Violation(key, value, float(limit)))
        return failed


class _GivenLimits(Tolerance):
    """A case file's `[tolerance]` limits: only the fields it names are its own; `Tolerance.resolve`
    fills the others from the defaults of the backend and dtype the row runs in (a float32 row that
    sets `k3_kl_max` alone keeps float32's mean limit, not bf16's). Until resolved, the unnamed
    fields hold the class defaults (bf16's). Made by `given_limits` only."""

    #: the fields the case names (an instance sets its own; `dataclasses.replace` gives all of them)
    _names: frozenset[str] = frozenset(Tolerance.CHECKS)

    def given(self) -> dict[str, float | None]:
        """The limits the case named, by field."""
        return {name: getattr(self, name) for name in Tolerance.CHECKS if name in self._names}

    def __eq__(self, other: object) -> bool:  # as before: equal to a Tolerance of the same values
        return self.to_dict() == other.to_dict() if isinstance(other, Tolerance) else NotImplemented

    __hash__ = Tolerance.__hash__

    def __repr__(self) -> str:
        named = ", ".join(f"{k}={v!r}" for k, v in self.given().items())
        return f"Tolerance({named}; the rest: the row's dtype defaults)"


def given_limits(limits: dict[str, Any], *, where: str = "tolerance") -> Tolerance:
    """A `Tolerance` of the limits a case names (checked as `Tolerance.from_dict`); the others are the
    defaults of the row's backend and dtype once `Tolerance.resolve` sees it."""
    made = from_mapping(_GivenLimits, limits, where=where)
    object.__setattr__(made, "_names", frozenset(limits))
    return made


def over_limits(base: Tolerance, changes: dict[str, Any]) -> Tolerance:
    """`base` with the fields `changes` names replaced; a case's limits stay partial (`given_limits`)."""
    if isinstance(base, _GivenLimits):
        return given_limits({**base.given(), **changes})
    return Tolerance.from_dict({**base.to_dict(), **changes})
