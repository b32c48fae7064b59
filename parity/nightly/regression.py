"""Regression detection: is this row's per-token drift worse than its baseline's?

A one-sided Mann-Whitney U test on per-token |Δlogp| at `alpha`, plus a mean shift above
`min_effect` nats or a moved share of non-finite tokens (those rank worst and stay out of the means,
as in the report's summary; tokens of a sequence correlate, so p-values are optimistic). With the
backend's `Noise` (`judge_with_noise`): a deterministic backend's any change is "changed"; a
nondeterministic one's significant shift within its repeat noise is "noise" (the triangle
inequality bounds it where tokens agree); noise from fewer than `MIN_NOISE_REQUESTS` requests judges
nothing, and the verdict says so.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from parity.core.errors import ConfigError
from parity.core.schema import DISTRIBUTION_PREFIX, json_float

TEST_NAME = "one-sided Mann-Whitney U on per-token |Δlogp|"
#: summary keys with which a row shows its backend's noise (`Noise.summary`).
NOISE_DETERMINISTIC_KEY = "noise_deterministic"
NOISE_MEAN_KEY = "noise_mean_abs_logprob_diff"
#: summary keys of the regression test on the per-position KL bounds (`distribution_verdict`).
DISTRIBUTION_CHANGE_KEY = DISTRIBUTION_PREFIX + "regression_change"
DISTRIBUTION_VERDICT_KEY = DISTRIBUTION_PREFIX + "regression_verdict"
Change = Literal["regression", "improved", "unchanged", "noise", "changed"]
#: fewest audit requests whose repeat noise may judge a change: the audit records no token count, and a
#: band from one request is one prompt's few sampled tokens (it then only shows beside the test's verdict).
MIN_NOISE_REQUESTS = 2


@dataclass(frozen=True)
class RegressionPolicy:
    """When a drift change counts: `alpha` in (0, 1) and `min_effect` >= 0 nats of mean |Δlogp|."""

    alpha: float = 0.01
    min_effect: float = 1e-3

    def __post_init__(self) -> None:
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) \
                or not 0.0 < self.alpha < 1.0:
            raise ConfigError(f"--alpha must be a number in (0, 1), got {self.alpha!r}")
        if isinstance(self.min_effect, bool) or not isinstance(self.min_effect, (int, float)) \
                or not math.isfinite(self.min_effect) or self.min_effect < 0:
            raise ConfigError(f"--min-effect must be a finite number >= 0 (nats), got {self.min_effect!r}")


@dataclass(frozen=True)
class Noise:
    """A backend's run-to-run noise from this run's audit `repeat`: source, deterministic, mean/max
    |Δlogp| between runs (nats), differing_requests of requests.
    """

    source: str
    deterministic: bool
    mean_abs_logprob_diff: float
    max_abs_logprob_diff: float
    differing_requests: int
    requests: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Noise:
        return cls(**d)

    def summary(self) -> dict[str, float]:
        """What a row shows of its noise: is its backend deterministic; its repeat mean |Δlogp|."""
        return {NOISE_DETERMINISTIC_KEY: float(self.deterministic),
                NOISE_MEAN_KEY: self.mean_abs_logprob_diff}

    def describe(self) -> str:
        if self.deterministic:
            return f"deterministic (audit {self.source}: repeat identical)"
        return (f"repeat noise mean {self.mean_abs_logprob_diff:.3g}, max {self.max_abs_logprob_diff:.3g} "
                f"nats, {self.differing_requests} of {self.requests} requests differ (audit {self.source})")


@dataclass(frozen=True)
class Verdict:
    """One row against its baseline: change ("regression", "improved", "unchanged", and with noise
    "noise" or "changed"), one-sided p_worse / p_better, effect (nats; > 0 worse), noise.
    """

    change: Change
    baseline_run: str
    p_worse: float
    p_better: float
    effect: float
    current_mean: float
    baseline_mean: float
    current_tokens: int
    baseline_tokens: int
    alpha: float
    min_effect: float
    test: str = TEST_NAME
    noise: dict[str, Any] | None = None
    #: tokens whose |Δlogp| is not finite (outside a side's support, NaN): ranked worst by the test,
    #: left out of the means (as the report's summary leaves them out). Absent in older histories: 0.
    current_nonfinite: int = 0
    baseline_nonfinite: int = 0
    #: the settings that differ from the baseline row's (e.g. "versions.vllm 0.6.0 → 0.7.0"), or "".
    settings_changed: str = ""
    #: why `noise` did not judge the change (too few requests behind it), or "". Absent in older histories.
    noise_unused: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Verdict:
        return cls(**d)

    @property
    def flagged(self) -> bool:
        """Whether the row is a regression: worse beyond the test, or a deterministic backend changed."""
        return self.change in ("regression", "changed")

    def describe(self) -> str:
        """One line for reports, e.g. `regression vs X: mean |Δlogp| 0.001 → 0.004 nats (+0.003, p=2e-09)`,
        with the backend's noise where it was measured."""
        text = (f"{self.change} vs {self.baseline_run}: mean |Δlogp| {self.baseline_mean:.3g} → "
                f"{self.current_mean:.3g} nats ({self.effect:+.3g}, p={self.p_value:.2g})")
        if self.current_nonfinite or self.baseline_nonfinite:
            text += (f"; non-finite on {self.baseline_nonfinite} of {self.baseline_tokens} → "
                     f"{self.current_nonfinite} of {self.current_tokens} tokens (ranked worst, left out of "
                     "the means)")
        if self.settings_changed:
            text += f"; the baseline ran another setting: {self.settings_changed}"
        if self.noise is not None:
            text += f"; {Noise.from_dict(self.noise).describe()}"
        if self.noise_unused:
            text += f"; {self.noise_unused}"
        return text

    @property
    def p_value(self) -> float:
        """The p-value of the one-sided test behind the change (regression: worse; improved: better),
        else in the direction the mean moved."""
        if self.change == "regression":
            return self.p_worse
        if self.change == "improved":
            return self.p_better
        return self.p_worse if self.effect >= 0 else self.p_better

    @property
    def support_moved(self) -> int:
        """+1 / -1 when the share of non-finite tokens grew / shrank against the baseline, else 0."""
        return _support_moved(self.current_nonfinite, self.current_tokens, self.baseline_nonfinite,
                              self.baseline_tokens)


def compare_drift(current: np.ndarray, baseline: np.ndarray, *, baseline_run: str,
                  policy: RegressionPolicy) -> Verdict:
    """Compare per-token |Δlogp| arrays (any shape). Non-finite values rank worst in the test and are
    left out of the means (as the report's summary leaves them out); the effect is the change of the
    finite means, and a significant shift counts also when the share of non-finite tokens moved its way.
    """
    cur = _clean(current)
    base = _clean(baseline)
    cur_bad, base_bad = _nonfinite(current), _nonfinite(baseline)
    cur_mean, base_mean = _finite_mean(current), _finite_mean(baseline)
    effect = cur_mean - base_mean
    support = _support_moved(cur_bad, int(cur.size), base_bad, int(base.size))
    p_worse = p_better = 1.0
    # All values equal (e.g. exact-zero drift on both sides) is a complete tie: no evidence of
    # change, and scipy's normal approximation would divide by a zero variance.
    if cur.size and base.size and not np.all(np.concatenate([cur, base]) == cur[0]):
        from scipy.stats import mannwhitneyu  # 1.7 s to import: here, so `parity nightly --help` is quick

        p_worse = float(mannwhitneyu(cur, base, alternative="greater").pvalue)
        p_better = float(mannwhitneyu(cur, base, alternative="less").pvalue)
    change: Change = "unchanged"
    if p_worse < policy.alpha and (effect > policy.min_effect or support > 0):
        change = "regression"
    elif p_better < policy.alpha and (-effect > policy.min_effect or support < 0):
        change = "improved"
    return Verdict(change=change, baseline_run=baseline_run, p_worse=p_worse, p_better=p_better,
                   effect=effect, current_mean=cur_mean, baseline_mean=base_mean,
                   current_tokens=int(cur.size), baseline_tokens=int(base.size),
                   alpha=policy.alpha, min_effect=policy.min_effect,
                   current_nonfinite=cur_bad, baseline_nonfinite=base_bad)


def distribution_verdict(current_report: str | None, baseline_report: str | None, *, baseline_run: str,
                         policy: RegressionPolicy) -> dict[str, Any]:
    """The `distribution/` verdict keys of a row whose report and baseline report (JSON) both hold a
    full-distribution section (`parity.assess.distribution`): the same test as `compare_drift` on the
    per-position KL(train || engine) lower bounds (nats) in place of |Δlogp|; a note in the verdict key
    where only this row's report holds one (the KL was not judged); {} where this row's holds none."""
    sections = [json.loads(r).get("extras", {}).get("distribution") if r else None
                for r in (current_report, baseline_report)]
    if not sections[0]:
        return {}
    if not sections[1]:  # said, not left out: the row's KL figures must not read as judged
        note = (f"not compared with {baseline_run}: its row has no full-distribution section (no top-k "
                "from its engine) to test the KL bounds against")
        return {DISTRIBUTION_VERDICT_KEY: note}
    if sections[0].get("top_k") != sections[1].get("top_k"):
        # a lower bound from more of the distribution is larger: bounds of two widths are not comparable
        widths = (sections[1].get("top_k"), sections[0].get("top_k"))
        return {DISTRIBUTION_VERDICT_KEY: f"not compared with {baseline_run}: the engine's top-k was "
                                          f"{widths[0]} there, {widths[1]} here"}
    current, baseline = (np.asarray([json_float(v) for v in s["kl_train_engine"]], np.float64)
                         for s in sections)
    verdict = compare_drift(current, baseline, baseline_run=baseline_run, policy=policy)
    return {DISTRIBUTION_CHANGE_KEY: verdict.change,
            DISTRIBUTION_VERDICT_KEY: verdict.describe().replace("mean |Δlogp|", "mean KL(train || engine)")}


def _support_moved(cur_bad: int, cur_size: int, base_bad: int, base_size: int) -> int:
    """+1 when the share of non-finite tokens grew against the baseline, -1 when it shrank, else 0."""
    cur_share = cur_bad / cur_size if cur_size else 0.0
    base_share = base_bad / base_size if base_size else 0.0
    return (cur_share > base_share) - (cur_share < base_share)


def _nonfinite(values: np.ndarray) -> int:
    return int(np.count_nonzero(~np.isfinite(np.asarray(values, dtype=np.float64))))


def _finite_mean(values: np.ndarray) -> float:
    """Mean |value| over the finite values (0.0 for none: no token, or every one non-finite)."""
    arr = np.abs(np.asarray(values, dtype=np.float64).ravel())
    arr = arr[np.isfinite(arr)]
    return float(arr.mean()) if arr.size else 0.0


def _clean(values: np.ndarray) -> np.ndarray:
    """float64 1-D copy with NaN/inf as the largest float (undefined drift is the worst; ranks need order)."""
    arr = np.abs(np.asarray(values, dtype=np.float64).ravel())
    return np.where(np.isfinite(arr), arr, np.finfo(np.float64).max)


def judge_with_noise(verdict: Verdict, noise: Noise, current: np.ndarray, baseline: np.ndarray) -> Verdict:
    """`verdict` judged against the backend's own `noise` (see the module docstring); `current` and
    `baseline` are the arrays `verdict` compared. Noise from fewer than `MIN_NOISE_REQUESTS` requests
    judges nothing: the test's change stands, and the verdict says why."""
    if noise.requests < MIN_NOISE_REQUESTS:
        unused = (f"noise band from {noise.requests} request{'s' * (noise.requests != 1)}: too few to judge "
                  f"(at least {MIN_NOISE_REQUESTS}), the test's verdict stands")
        return dataclasses.replace(verdict, noise=noise.to_dict(), noise_unused=unused)
    change = verdict.change
    if noise.deterministic:
        if not np.array_equal(_clean(current), _clean(baseline)):
            change = "improved" if change == "improved" else "changed"
        else:
            change = "unchanged"
    elif change in ("regression", "improved") and abs(verdict.effect) <= noise.mean_abs_logprob_diff \
            and verdict.support_moved == 0:  # repeat noise says nothing of tokens leaving the support
        change = "noise"
    return dataclasses.replace(verdict, change=change, noise=noise.to_dict())
