"""No silent wrong numbers, round 6 leftovers (c): counts a reader takes at face value.

A report of 100 rollouts, some with no generated token (an empty response, every token injected) or
every token outside a side's support, read `num_sequences` 96 with no word of the other four: they are
now counted in `num_empty_sequences` and `num_sequences_outside_support`. A nightly noise band
from one audit request turned a significant regression into "noise": noise from fewer than
`MIN_NOISE_REQUESTS` requests now judges nothing, and the verdict says so.
"""

from __future__ import annotations

import json

import numpy as np

from parity.assess.reporting import build_report
from parity.core.schema import UNMEASURED_SEQUENCE_KEYS
from parity.core.types import Rollout
from parity.drift.tolerance import Tolerance
from parity.nightly.regression import (
    MIN_NOISE_REQUESTS,
    Noise,
    RegressionPolicy,
    Verdict,
    compare_drift,
    judge_with_noise,
)
from parity.report.document import ParityReport


def rollout(i: int, n: int, *, mask: tuple[int, ...] | None = None) -> Rollout:
    logprobs = tuple(-0.1 * (k + 1) for k in range(n))
    return Rollout(f"r{i}", 0, (1, 2), tuple(range(3, 3 + n)), logprobs, "stop", "vllm", response_mask=mask)


def report_of(rollouts: list[Rollout], train: list[np.ndarray] | None = None) -> ParityReport:
    if train is None:
        train = [np.asarray(r.logprobs, np.float32) - np.float32(0.01) for r in rollouts]
    return build_report(rollouts, train, tolerance=Tolerance())


def test_rollouts_without_a_generated_token_are_counted_not_dropped():
    rollouts = [rollout(i, 0 if i < 3 else 5) for i in range(100)]
    rollouts[3] = rollout(3, 2, mask=(0, 0))  # a turn of injected tokens only
    summary = report_of(rollouts).summary
    assert summary["num_sequences"] == 96  # unchanged: the sequences measured
    assert summary["num_empty_sequences"] == 4 and summary["num_sequences_outside_support"] == 0
    assert summary["num_sequences"] + sum(summary[k] for k in UNMEASURED_SEQUENCE_KEYS) == len(rollouts)


def test_a_rollout_whose_every_token_is_outside_the_support_is_counted():
    rollouts = [rollout(i, 4) for i in range(5)]
    train = [np.asarray(r.logprobs, np.float32) for r in rollouts]
    train[2] = np.full(4, -np.inf, np.float32)  # the trainer's nucleus excludes every sampled token
    summary = report_of(rollouts, train).summary
    assert summary["num_sequences"] == 4 and summary["num_tokens_outside_support"] == 4
    assert summary["num_sequences_outside_support"] == 1 and summary["num_empty_sequences"] == 0


def test_the_counts_print_and_survive_the_stored_report_and_older_reports_still_read():
    report = report_of([rollout(0, 0), rollout(1, 3)])
    assert "num_empty_sequences            1" in report.summary_text()
    assert ParityReport.from_json(report.to_json()).summary["num_empty_sequences"] == 1
    older = json.loads(report.to_json())
    for key in UNMEASURED_SEQUENCE_KEYS:
        del older["summary"][key]
    assert "num_empty_sequences" not in ParityReport.from_dict(older).summary


def noise(requests: int, *, deterministic: bool = False) -> Noise:
    return Noise(source="audit / vllm / bfloat16", deterministic=deterministic,
                 mean_abs_logprob_diff=0.0 if deterministic else 0.05,
                 max_abs_logprob_diff=0.0 if deterministic else 0.3,
                 differing_requests=0 if deterministic else requests, requests=requests)


def drifts(shift: float) -> tuple[np.ndarray, np.ndarray]:
    base = np.abs(np.random.default_rng(0).normal(0.0, 0.01, 2000))
    return base + shift, base


def test_a_noise_band_from_one_request_does_not_excuse_a_regression():
    cur, base = drifts(0.004)  # significant, above min_effect, within the band's 0.05
    verdict = compare_drift(cur, base, baseline_run="b", policy=RegressionPolicy())
    assert verdict.change == "regression"
    judged = judge_with_noise(verdict, noise(1), cur, base)
    assert judged.change == "regression" and judged.flagged  # the old code called it "noise"
    assert "noise band from 1 request: too few to judge (at least 2), the test's verdict stands" \
        in judged.describe()
    assert judged.noise == noise(1).to_dict()  # the band still shows


def test_a_determinism_claim_from_one_request_judges_nothing_either():
    cur, base = drifts(1e-6)  # below min_effect: the test finds nothing
    verdict = compare_drift(cur, base, baseline_run="b", policy=RegressionPolicy())
    enough = noise(MIN_NOISE_REQUESTS, deterministic=True)
    assert judge_with_noise(verdict, enough, cur, base).change == "changed"
    judged = judge_with_noise(verdict, noise(1, deterministic=True), cur, base)
    assert judged.change == verdict.change == "unchanged" and "too few to judge" in judged.describe()


def test_noise_from_enough_requests_judges_as_before_and_older_verdicts_read():
    cur, base = drifts(0.004)
    verdict = compare_drift(cur, base, baseline_run="b", policy=RegressionPolicy())
    judged = judge_with_noise(verdict, noise(MIN_NOISE_REQUESTS), cur, base)
    assert judged.change == "noise" and judged.noise_unused == "" and "too few" not in judged.describe()
    stored = judged.to_dict()
    del stored["noise_unused"]  # a history written before the field
    assert Verdict.from_dict(stored) == judged
