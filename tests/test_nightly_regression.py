"""Regression statistics on synthetic per-token |Δlogp| arrays."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from parity.core.errors import ConfigError
from parity.nightly.regression import (
    NOISE_DETERMINISTIC_KEY,
    NOISE_MEAN_KEY,
    TEST_NAME,
    Noise,
    RegressionPolicy,
    Verdict,
    compare_drift,
    judge_with_noise,
)
from parity.nightly.rows import row_status

POLICY = RegressionPolicy(alpha=0.01, min_effect=1e-3)


def drift(scale: float, n: int = 2000, seed: int = 0) -> np.ndarray:
    return np.abs(scale * np.random.default_rng(seed).standard_normal(n))


def test_exact_zero_against_exact_zero_is_no_change():
    v = compare_drift(np.zeros(500), np.zeros(300), baseline_run="r0", policy=POLICY)
    assert v.change == "unchanged" and v.p_worse == 1.0 and v.p_better == 1.0 and v.effect == 0.0


def test_identical_arrays_and_same_distribution_are_no_change():
    a = drift(0.01)
    assert compare_drift(a, a, baseline_run="r0", policy=POLICY).change == "unchanged"
    assert compare_drift(drift(0.01, seed=1), a, baseline_run="r0", policy=POLICY).change == "unchanged"


def test_a_larger_drift_is_a_regression_and_a_smaller_one_an_improvement():
    base, worse = drift(0.01), drift(0.05, seed=1)
    v = compare_drift(worse, base, baseline_run="r0", policy=POLICY)
    assert v.change == "regression" and v.p_worse < 1e-6 and v.effect > 0.02
    assert v.baseline_run == "r0" and v.test == TEST_NAME and "regression vs r0" in v.describe()
    assert compare_drift(base, worse, baseline_run="r0", policy=POLICY).change == "improved"


def test_a_significant_but_tiny_shift_is_below_the_minimum_effect():
    base = drift(1e-5)
    v = compare_drift(base * 3, base, baseline_run="r0", policy=POLICY)
    assert v.p_worse < 1e-6 and v.change == "unchanged"
    assert compare_drift(base * 3, base, baseline_run="r0",
                         policy=RegressionPolicy(min_effect=0.0)).change == "regression"


def test_zero_baseline_against_nonzero_drift_is_a_regression():
    v = compare_drift(drift(0.01), np.zeros(2000), baseline_run="r0", policy=POLICY)
    assert v.change == "regression"


def test_non_finite_tokens_count_as_worst_and_empty_arrays_are_no_change():
    base = drift(0.01, n=200)
    cur = base.copy()
    cur[:50] = np.nan
    assert compare_drift(cur, base, baseline_run="r0", policy=POLICY).change == "regression"
    assert compare_drift(np.zeros(0), base, baseline_run="r0", policy=POLICY).change == "unchanged"


def test_verdict_round_trips_and_policy_validates():
    v = compare_drift(drift(0.02), drift(0.01), baseline_run="r0", policy=POLICY)
    assert Verdict.from_dict(v.to_dict()) == v
    for bad in ({"alpha": 0.0}, {"alpha": 1.5}, {"min_effect": -1.0}, {"min_effect": float("inf")}):
        with pytest.raises(ConfigError, match=r"alpha|min-effect"):
            RegressionPolicy(**bad)


@given(st.lists(st.floats(0, 1, allow_subnormal=False), min_size=1, max_size=60),
       st.lists(st.floats(0, 1, allow_subnormal=False), min_size=1, max_size=60))
def test_a_verdict_is_never_both_ways_and_always_backed_by_its_test(cur, base):
    v = compare_drift(np.array(cur), np.array(base), baseline_run="r0", policy=POLICY)
    if v.change == "regression":
        assert v.p_worse < POLICY.alpha and v.effect > POLICY.min_effect
    elif v.change == "improved":
        assert v.p_better < POLICY.alpha and -v.effect > POLICY.min_effect
    assert 0.0 <= v.p_worse <= 1.0 and 0.0 <= v.p_better <= 1.0
    swapped = compare_drift(np.array(base), np.array(cur), baseline_run="r0", policy=POLICY)
    assert {v.change, swapped.change} in ({"unchanged"}, {"regression", "improved"})


# -- the backend's own noise (an audit of it in the same run) ------------------------------------------

DETERMINISTIC = Noise(source="audit / reference / bfloat16", deterministic=True, mean_abs_logprob_diff=0.0,
                      max_abs_logprob_diff=0.0, differing_requests=0, requests=4)
NOISY = Noise(source="audit / vllm / bfloat16", deterministic=False, mean_abs_logprob_diff=0.02,
              max_abs_logprob_diff=0.3, differing_requests=2, requests=4)


def test_a_deterministic_backend_that_moves_one_ulp_is_flagged():
    base = drift(0.01)
    moved = base.copy()
    moved[17] = np.nextafter(moved[17], 1.0)
    plain = compare_drift(moved, base, baseline_run="r0", policy=POLICY)
    assert plain.change == "unchanged"  # the negative control: the test alone cannot see it
    judged = judge_with_noise(plain, DETERMINISTIC, moved, base)
    assert judged.change == "changed" and judged.flagged and row_status([], judged) == "regression"
    assert "deterministic" in judged.describe() and Verdict.from_dict(judged.to_dict()) == judged
    plain_same = compare_drift(base, base, baseline_run="r0", policy=POLICY)
    same = judge_with_noise(plain_same, DETERMINISTIC, base, base)
    assert same.change == "unchanged" and not same.flagged
    better = drift(0.001)
    improved = compare_drift(better, base, baseline_run="r0", policy=POLICY)
    assert judge_with_noise(improved, DETERMINISTIC, better, base).change == "improved"


def test_a_shift_within_the_backends_repeat_noise_is_noise_and_beyond_it_a_regression():
    base = drift(0.01)
    within = base + 0.01  # significant and above min_effect, but inside 0.02 nats of repeat noise
    plain = compare_drift(within, base, baseline_run="r0", policy=POLICY)
    assert plain.change == "regression"
    judged = judge_with_noise(plain, NOISY, within, base)
    assert judged.change == "noise" and not judged.flagged and row_status([], judged) == "pass"
    assert "repeat noise mean 0.02" in judged.describe() and judged.noise == NOISY.to_dict()
    beyond = base + 0.05
    assert judge_with_noise(compare_drift(beyond, base, baseline_run="r0", policy=POLICY), NOISY, beyond,
                            base).change == "regression"
    assert NOISY.summary() == {NOISE_DETERMINISTIC_KEY: 0.0, NOISE_MEAN_KEY: 0.02}
