"""Alert thresholds of a monitored run: which step values raise a warning line and a flag.

A number is an upper bound, a `(low, high)` pair a band (None: open); no absolute default, since
normal drift depends on the run. `Jumps` (`DEFAULT_JUMPS`, on by default) flag X times the
trailing median of `WINDOW` steps, catching a missed weight sync out of the box. Keys are the
summary's or the correction's `rollout_corr/*`; a missing one is flagged. A jump is judged against the
trailing steps sampled alike (`sampling_key`: drift of processed logprobs scales with 1/temperature).
Bounds and factors are Python or NumPy real numbers, stored as `float(value)` (`np.float32(0.1)`:
0.10000000149011612, the value that float32 holds).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from parity.core.errors import ConfigError
from parity.core.schema import SUMMARY_KEYS, SUPPORT_SUMMARY_KEYS, text_apart
from parity.core.types import SamplingParams, float32_meant

#: prefix of verl's rollout-correction metric names.
CORRECTION_PREFIX = "rollout_corr/"
#: the default relative bounds: a step is flagged at this many times the trailing median.
DEFAULT_JUMPS: dict[str, float] = {"k3_kl": 10.0, "mean_abs_logprob_diff": 5.0}
#: trailing steps whose median a jump is measured against.
WINDOW = 20
#: stored steps needed before a jump is judged (a median of fewer is noise).
MIN_HISTORY = 5
#: the summary keys a jump is judged on: drift magnitudes, >= 0, 0 without drift, larger is worse.
#: "X times the trailing median" means nothing for a signed value (k1_kl, chi2_token), one whose
#: no-drift value is 1 (the is_ratio_* means and quantiles, seq_is_ratio_mean, token_mult_prob_error),
#: one where lower is worse (rollout_probs_pearson, is_ratio_min) or a count: those take a band.
JUMP_KEYS: tuple[str, ...] = (
    "max_abs_logprob_diff", "mean_abs_logprob_diff", "is_ratio_std", "k2_kl", "k3_kl",
    "rollout_probs_diff_max", "rollout_probs_diff_mean", "frac_tokens_ratio_gt_2",
)
#: the values a bounded metric can take: fractions and probability differences in [0, 1] (not
#: percentages, not nats), a correlation in [-1, 1]; a bound beyond them could never be crossed.
RANGES: dict[str, tuple[float, float]] = {
    **dict.fromkeys(("rollout_probs_diff_max", "rollout_probs_diff_mean", "frac_tokens_ratio_gt_2",
                     "frac_tokens_outside_support"), (0.0, 1.0)),
    **{CORRECTION_PREFIX + k: (0.0, 1.0) for k in (
        "rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low", "rollout_is_seq_fraction_high",
        "rollout_is_seq_fraction_low", "rollout_is_eff_sample_size")},
    "rollout_probs_pearson": (-1.0, 1.0),
}
#: what a trailing median of 0 of a jump key says of the recent steps (every one above 0 is a jump).
ZERO_MEDIAN: dict[str, str] = {
    **dict.fromkeys(JUMP_KEYS, "bitwise equal logprobs at the counted tokens"),
    **dict.fromkeys(("rollout_probs_diff_max", "rollout_probs_diff_mean"), "equal probabilities at the "
                    "counted tokens"),
    "is_ratio_std": "one equal ratio at every counted token", "frac_tokens_ratio_gt_2": "no ratio above 2",
}


@dataclass(frozen=True)
class Bound:
    """One metric's allowed band: flagged below `low` or above `high` (None: open)."""

    key: str
    low: float | None
    high: float | None

    def check(self, value: Any) -> dict[str, Any] | None:
        """An alert dict `{"key", "value", "low", "high", "message"}` when `value` breaks the band."""
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            return self._alert(None, f"{self.key} is missing or not a finite number ({value!r})")
        if self.high is not None and value > self.high:
            return self._alert(value, "{} {} > {}".format(self.key, *apart(value, self.high)))
        if self.low is not None and value < self.low:
            return self._alert(value, "{} {} < {}".format(self.key, *apart(value, self.low)))
        return None

    def _alert(self, value: float | None, message: str) -> dict[str, Any]:
        return {"key": self.key, "value": value, "low": self.low, "high": self.high, "message": message}


@dataclass(frozen=True)
class Thresholds:
    """The bounds of a run, checked on construction (`Thresholds.of` parses the user's dict)."""

    bounds: tuple[Bound, ...] = ()

    @classmethod
    def of(cls, thresholds: Mapping[str, Any] | None) -> Thresholds:
        """From `{"key": upper}` / `{"key": (low, high)}` (see the module doc); None: no alerts."""
        if thresholds is None:
            return cls()
        if not isinstance(thresholds, Mapping):
            raise ConfigError(f"thresholds must be a dict of metric -> bound, got "
                              f"{type(thresholds).__name__}")
        bounds = []
        for key, spec in thresholds.items():
            if not isinstance(key, str) or not (key in SUMMARY_KEYS or key in SUPPORT_SUMMARY_KEYS
                                                or key.startswith(CORRECTION_PREFIX)):
                raise ConfigError(f"thresholds: unknown metric {key!r}; use a summary key "
                                  f"({', '.join(SUMMARY_KEYS + SUPPORT_SUMMARY_KEYS)}) or a verl "
                                  f"{CORRECTION_PREFIX}* metric name")
            low, high = (None, spec) if not isinstance(spec, (tuple, list)) else _pair(key, spec)
            for side, value in (("low", low), ("high", high)):
                if value is not None and _real(value) is None:
                    raise ConfigError(f"thresholds[{key!r}]: {side} bound must be a finite number or None, "
                                      f"got {value!r}{_as_number(value, band=True)}")
            low, high = (None if v is None else _real(v) for v in (low, high))
            if low is None and high is None:
                raise ConfigError(f"thresholds[{key!r}]: give an upper bound, or a (low, high) band with at "
                                  "least one side")
            if low is not None and high is not None and low > high:
                raise ConfigError(f"thresholds[{key!r}]: low {low} is above high {high}")
            _check_range(key, low, high)
            bounds.append(Bound(key, low, high))
        return cls(tuple(bounds))

    def check(self, values: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The alerts of one step's flat values (summary keys and `rollout_corr/*` names)."""
        return [alert for b in self.bounds if (alert := b.check(values.get(b.key))) is not None]

    def to_dict(self) -> dict[str, list[float | None]]:
        """`{"key": [low, high]}`, as the page shows them."""
        return {b.key: [b.low, b.high] for b in self.bounds}


def _check_range(key: str, low: float | None, high: float | None) -> None:
    """ConfigError for a bound `key`'s values can never cross (`RANGES`): an alert that cannot fire,
    given in another unit (a percentage, nats) for a fraction or a probability."""
    if key not in RANGES:
        return
    lo, hi = RANGES[key]
    for side, value, never in (("high", high, high is not None and high > hi),
                               ("low", low, low is not None and low < lo)):
        if never:
            raise ConfigError(f"thresholds[{key!r}]: {side} bound {value} lies outside [{lo:g}, {hi:g}], the "
                              f"values {key} takes (a fraction, probability or correlation; not a "
                              "percentage or nats), so it could never alert; give it in that unit")


def _pair(key: str, spec: Any) -> tuple[Any, Any]:
    if len(spec) != 2:
        raise ConfigError(f"thresholds[{key!r}]: a band is (low, high), got {spec!r}")
    return spec[0], spec[1]


@dataclass(frozen=True)
class Jumps:
    """Relative bounds: `{"key": X}` flags a step whose value exceeds X times the median of the
    run's last `WINDOW` values of `key` (the monitor passes those of steps sampled alike; judged
    from `MIN_HISTORY` values on; a NaN one, which has no order, is not counted, an infinite one is;
    an infinite value is judged, a NaN one is not; over a median of 0, any value above 0 is a jump,
    told by what that 0 means, `ZERO_MEDIAN`; X > 1; keys: `JUMP_KEYS`)."""

    factors: tuple[tuple[str, float], ...] = ()

    @classmethod
    def of(cls, jumps: Mapping[str, Any] | None) -> Jumps:
        """From `{"key": factor}`; None: none."""
        if jumps is None:
            return cls()
        if not isinstance(jumps, Mapping):
            raise ConfigError(f"jumps must be a dict of metric -> factor, got {type(jumps).__name__}")
        out = []
        for key, factor in jumps.items():
            if not isinstance(key, str) or key not in SUMMARY_KEYS:
                raise ConfigError(f"jumps: unknown metric {key!r}; use a summary key "
                                  f"({', '.join(SUMMARY_KEYS)})")
            if key not in JUMP_KEYS:
                raise ConfigError(f"jumps: {key!r} is not a drift magnitude (>= 0, 0 without drift, larger "
                                  "is worse), so X times its trailing median is no jump; judge one of "
                                  f"{', '.join(JUMP_KEYS)}, or bound {key!r} with a (low, high) band in "
                                  "thresholds=")
            number = _real(factor)
            if number is None or not number > 1:
                raise ConfigError(f"jumps[{key!r}] must be a finite number > 1 (times the trailing median), "
                                  f"got {factor!r}{_as_number(factor)}")
            out.append((key, number))
        return cls(tuple(out))

    def check(self, values: Mapping[str, Any], history: Mapping[str, list[float]]) -> list[dict[str, Any]]:
        """The jump alerts of one step's values against `history` (each key's trailing values)."""
        alerts = []
        for key, factor in self.factors:
            value = values.get(key)
            # NaN has no order: sorted() leaves it anywhere and the "median" depends on the steps' order
            past = [v for v in history.get(key, [])[-WINDOW:] if not math.isnan(v)]
            if len(past) < MIN_HISTORY or not isinstance(value, (int, float)) or math.isnan(value):
                continue
            ordered, half = sorted(past), len(past) // 2  # an even count's median: its two middles' mean
            median = ordered[half] if len(past) % 2 else (ordered[half - 1] + ordered[half]) / 2
            if value > factor * median and value > 0:
                if median > 0:
                    times, above = apart(value / median, factor, digits=3)
                    message = (f"{key} {value:.4g} is {times}x the trailing median {median:.4g} (flagged "
                               f"above {above}x)")
                else:  # X times 0 is 0: not "infx", what a median of 0 means
                    message = (f"{key} {value:.4g} where the trailing median is {median:.4g} "
                               f"({ZERO_MEDIAN[key]}): any drift is a jump")
                alerts.append({"key": key, "value": value, "low": None, "high": factor * median,
                               "jump": factor, "trailing_median": median, "message": message})
        return alerts

    def to_dict(self) -> dict[str, float]:
        return dict(self.factors)


def _real(value: Any) -> float | None:
    """A finite Python or NumPy real number (never a bool) as `float(value)`; None for anything else."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond the floats
        return None
    return number if math.isfinite(number) else None


def _as_number(value: Any, band: bool = False) -> str:
    """The fix for a tensor or array given where a number goes."""
    fix = " (a number: float(x) of a tensor" + (", or a (low, high) tuple)" if band else ")")
    return fix if hasattr(value, "shape") else ""


def apart(value: float, bound: float, digits: int = 4) -> tuple[str, str]:
    """`value` and `bound` to `digits` significant digits, or as many more as tell them apart
    (`text_apart` each way): a value just across its bound never prints equal to it ("0.1 > 0.1")."""
    return text_apart(value, digits, (bound,)), text_apart(bound, digits, (value,))


def sampling_key(sampling: dict[str, Any] | None) -> tuple[float, int, float] | None:
    """What a step's processed logprobs depend on, (temperature, top_k, top_p), a float32's
    temperature and top_p as the decimal meant (`float32_meant`: `np.float32(0.7)` is 0.7, as a plain
    0.7 is); None when not given."""
    if sampling is None:
        return None
    temperature, top_k, top_p = SamplingParams.from_dict(dict(sampling)).definition
    return float32_meant(temperature), top_k, float32_meant(top_p)


def stored_sampling_key(sampling: Any) -> tuple[float, int, float] | None:
    """`sampling_key` of a stored step's sampling (None where it has none or it no longer reads)."""
    try:
        return sampling_key(dict(sampling)) if isinstance(sampling, Mapping) else None
    except ConfigError:
        return None


def alike(a: tuple[float, int, float] | None, b: tuple[float, int, float] | None) -> bool:
    """Whether two steps' samplings may share a jump baseline (an unknown one matches any)."""
    return a is None or b is None or a == b
