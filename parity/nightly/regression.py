"""Regression detection: is this row's per-token drift worse than its baseline's?

The test is a one-sided Mann-Whitney U test (scipy) on the per-token |Δlogp| =
|logp_train - logp_rollout| of the current row against the baseline row: "current tokens are
stochastically larger than baseline tokens" at significance `alpha`. A significant shift alone is
not enough, because with thousands of tokens a shift of 1e-7 nats is significant and harmless; it
must also move the mean |Δlogp| by more than `min_effect` nats. Improvements are the mirror image.

Caveat worth knowing: tokens of one sequence are correlated, so the test's p-values are optimistic;
`min_effect` is the guard that keeps that from flagging noise.

The backend's own noise floor (`Noise`, from an audit of the backend in the same run,
`parity.audit`) sharpens both sides (`judge_with_noise`):

- A deterministic backend (the audit's repeat is identical) gives the same bits for the same
  seeded requests, so any change of the row's per-token |Δlogp| against its baseline is
  "changed" (flagged as a regression), however small; only a significant improvement stays
  "improved".
- A nondeterministic backend moves by itself: a shift the test calls significant but whose mean
  |Δlogp| effect is within the backend's repeat noise (the mean |Δlogp| between two runs of the
  same batch) is "noise", not a regression. Where both runs sample the same tokens, the mean
  |Δlogp| against the training forward can move by at most that much (triangle inequality);
  where the repeat also changed tokens, the floor is an estimate, and the row shows it.
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


@dataclass(frozen=True)
class RegressionPolicy:
    """When a drift change counts.

    alpha: significance level of each one-sided test, in (0, 1).
    min_effect: smallest change of mean per-token |Δlogp| (nats) that counts, >= 0.
    """

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
    """A backend's run-to-run noise: the audit's `repeat` check (`parity.audit`) of that backend,
    model and dtype in the same run.

    source: the audit row that measured it (its label).
    deterministic: the repeat was identical (same tokens, same logprob bits).
    mean_abs_logprob_diff / max_abs_logprob_diff: |Δlogp| between the two runs, nats.
    differing_requests / requests: how many of the audit's requests changed.
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
    """The outcome of comparing one row's drift with its baseline row.

    change: "regression", "improved" or "unchanged"; with the backend's noise (`judge_with_noise`)
        also "noise" (significant, but within the backend's repeat noise) or "changed" (a
        deterministic backend's numbers moved at all).
    p_worse / p_better: one-sided p-values (current larger / smaller than baseline).
    effect: mean |Δlogp| now minus at baseline (nats; > 0 is worse).
    noise: the backend's `Noise` as a dict, None when no audit of it ran in this run.
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
        if self.noise is not None:
            text += f"; {Noise.from_dict(self.noise).describe()}"
        return text

    @property
    def p_value(self) -> float:
        """The p-value of the one-sided test in the direction the mean moved."""
        return self.p_worse if self.effect >= 0 else self.p_better


def compare_drift(current: np.ndarray, baseline: np.ndarray, *, baseline_run: str,
                  policy: RegressionPolicy) -> Verdict:
    """Compare per-token |Δlogp| arrays (any shape; non-finite values count as worst)."""
    cur = _clean(current)
    base = _clean(baseline)
    with np.errstate(over="ignore", invalid="ignore"):  # a non-finite token makes the mean inf
        cur_mean = float(cur.mean()) if cur.size else 0.0
        base_mean = float(base.mean()) if base.size else 0.0
        effect = cur_mean - base_mean
    p_worse = p_better = 1.0
    # All values equal (e.g. exact-zero drift on both sides) is a complete tie: no evidence of
    # change, and scipy's normal approximation would divide by a zero variance.
    if cur.size and base.size and not np.all(np.concatenate([cur, base]) == cur[0]):
        from scipy.stats import mannwhitneyu  # 1.7 s to import: here, so `parity nightly --help` is quick

        p_worse = float(mannwhitneyu(cur, base, alternative="greater").pvalue)
        p_better = float(mannwhitneyu(cur, base, alternative="less").pvalue)
    change: Change = "unchanged"
    if p_worse < policy.alpha and effect > policy.min_effect:
        change = "regression"
    elif p_better < policy.alpha and -effect > policy.min_effect:
        change = "improved"
    return Verdict(change=change, baseline_run=baseline_run, p_worse=p_worse, p_better=p_better,
                   effect=effect, current_mean=cur_mean, baseline_mean=base_mean,
                   current_tokens=int(cur.size), baseline_tokens=int(base.size),
                   alpha=policy.alpha, min_effect=policy.min_effect)


def distribution_verdict(current_report: str | None, baseline_report: str | None, *, baseline_run: str,
                         policy: RegressionPolicy) -> dict[str, Any]:
    """The `distribution/` verdict keys of a row whose report and baseline report (JSON) both hold a
    full-distribution section (`parity.assess.distribution`): the same test as `compare_drift` on the
    per-position KL(train || engine) lower bounds (nats) in place of |Δlogp|; {} otherwise."""
    sections = [json.loads(r).get("extras", {}).get("distribution") if r else None
                for r in (current_report, baseline_report)]
    if not all(sections):
        return {}
    current, baseline = (np.asarray([json_float(v) for v in s["kl_train_engine"]], np.float64)
                         for s in sections)
    verdict = compare_drift(current, baseline, baseline_run=baseline_run, policy=policy)
    return {DISTRIBUTION_CHANGE_KEY: verdict.change,
            DISTRIBUTION_VERDICT_KEY: verdict.describe().replace("mean |Δlogp|", "mean KL(train || engine)")}


def _clean(values: np.ndarray) -> np.ndarray:
    """float64 1-D copy where NaN/inf become the largest finite float: an undefined logprob
    difference is the worst drift there is, and the rank test needs orderable values."""
    arr = np.abs(np.asarray(values, dtype=np.float64).ravel())
    return np.where(np.isfinite(arr), arr, np.finfo(np.float64).max)


def judge_with_noise(verdict: Verdict, noise: Noise, current: np.ndarray, baseline: np.ndarray) -> Verdict:
    """`verdict` judged against the backend's own `noise` (see the module docstring); `current` and
    `baseline` are the arrays `verdict` compared."""
    change = verdict.change
    if noise.deterministic:
        if not np.array_equal(_clean(current), _clean(baseline)):
            change = "improved" if change == "improved" else "changed"
        else:
            change = "unchanged"
    elif change in ("regression", "improved") and abs(verdict.effect) <= noise.mean_abs_logprob_diff:
        change = "noise"
    return dataclasses.replace(verdict, change=change, noise=noise.to_dict())
