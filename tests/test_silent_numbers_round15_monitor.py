"""Round 15, the monitor: thresholds, jump factors and counts given as NumPy scalars are taken (as
`float(x)`, `int(x)`); a float32 temperature (`np.float32(0.7)`, stored as 0.699999988) shares its jump
baseline with a plain 0.7, as a dump row's float32 column does (`float32_meant`, one rule); a jump over
a trailing median of 0 says what that median means instead of "infx"; a sampling field holding several
values is an InputError naming it, never a bare ValueError. No engine starts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from parity.core.errors import ConfigError, InputError
from parity.core.types import float32_meant
from parity.monitor import Monitor
from parity.monitor.core import checked_sampling
from parity.monitor.thresholds import Jumps, Thresholds, sampling_key

QUIET = {"render_every": 0, "advice_every": 0, "background": "thread", "advice_in_background": False}
F32_07 = float(np.float32(0.7))  # 0.699999988079071: what a float32 0.7 reads as in Python


pytestmark = pytest.mark.usefixtures("quiet_monitor_log")


def _arrays(drift: float) -> dict:
    """One step's arrays: a single token drifted by `drift` nats."""
    rollout = np.full((2, 4), -0.5)
    rollout[1, 1] -= drift
    return {"rollout_log_probs": rollout, "old_log_probs": np.full((2, 4), -0.5),
            "response_mask": np.ones((2, 4), np.int64)}


# -- 1. NumPy scalars as thresholds, jump factors and counts -------------------------------------------


def test_numpy_scalar_bounds_are_taken_as_the_float_they_hold():
    t = Thresholds.of({"k3_kl": np.float32(0.1), "k2_kl": (np.float64(0.0), np.int64(1)),
                       "rollout_probs_pearson": (np.float16(0.5), None)})
    assert t.to_dict() == {"k3_kl": [None, float(np.float32(0.1))], "k2_kl": [0.0, 1.0],
                           "rollout_probs_pearson": [0.5, None]}
    assert all(type(v) is float for b in t.to_dict().values() for v in b if v is not None)
    assert t.check({"k3_kl": 0.2, "k2_kl": 0.5, "rollout_probs_pearson": 0.9})[0]["key"] == "k3_kl"
    assert Jumps.of({"k3_kl": np.float32(10.0), "mean_abs_logprob_diff": np.int64(5)}).to_dict() == {
        "k3_kl": 10.0, "mean_abs_logprob_diff": 5.0}


@pytest.mark.parametrize("bad", [np.bool_(True), np.float32("nan"), np.float64("inf"), 10**400],
                         ids=["np_bool", "nan", "inf", "int_beyond_floats"])
def test_numpy_bools_and_non_finite_bounds_are_still_refused(bad):
    with pytest.raises(ConfigError, match=r"thresholds\['k3_kl'\]: high bound"):
        Thresholds.of({"k3_kl": bad})
    with pytest.raises(ConfigError, match=r"jumps\['k3_kl'\]"):
        Jumps.of({"k3_kl": bad})
    with pytest.raises(ConfigError, match=r"jumps\['k3_kl'\]"):
        Jumps.of({"k3_kl": np.float32(1.0)})  # not > 1


def test_a_tensor_bound_is_refused_with_the_fix():
    for bad in (torch.tensor(0.1, dtype=torch.bfloat16), np.array(0.1)):
        with pytest.raises(ConfigError, match=r"float\(x\) of a tensor"):
            Thresholds.of({"k3_kl": bad})
    for bad in (torch.tensor(10.0), np.array(10.0)):
        with pytest.raises(ConfigError, match=r"jumps\['k3_kl'\].*float\(x\) of a tensor\)"):
            Jumps.of({"k3_kl": bad})


def test_numpy_integer_counts_are_taken(tmp_path):
    m = Monitor(tmp_path, render_every=np.int64(0), advice_every=np.int32(3), threads=np.int64(1),
                background="thread")
    try:
        assert (m.render_every, m.advice_every, m.threads) == (0, 3, 1)
        assert type(m.advice_every) is int
    finally:
        m.close()
    for bad in (np.bool_(True), np.float64(2.0), np.int64(-1)):
        with pytest.raises(ConfigError, match="render_every must be an integer >= 0"):
            Monitor(tmp_path / "bad", render_every=bad, background="thread")


# -- 2. a float32 temperature shares its jump baseline with the decimal it stands for -----------------


def test_float32_sampling_groups_with_its_decimal_and_distinct_values_do_not():
    assert sampling_key({"temperature": F32_07, "top_p": float(np.float32(0.95))}) == \
        sampling_key({"temperature": 0.7, "top_p": 0.95}) == (0.7, 0, 0.95)
    assert sampling_key({"temperature": np.float32(0.7)}) == sampling_key({"temperature": 0.7})
    next_up = float(np.nextafter(np.float32(0.7), np.float32(1)))
    assert sampling_key({"temperature": next_up}) != sampling_key({"temperature": 0.7})
    assert sampling_key({"temperature": 0.71}) != sampling_key({"temperature": 0.7})
    assert float32_meant(F32_07) == 0.7 and float32_meant(0.7) == 0.7 and float32_meant(0.5) == 0.5


@pytest.mark.parametrize("first, then", [(0.7, np.float32(0.7)), (np.float32(0.7), 0.7)])
def test_a_jump_across_the_two_spellings_is_flagged(tmp_path, first, then):
    with Monitor(tmp_path, jumps={"mean_abs_logprob_diff": 5.0}, **QUIET) as m:
        for step in range(5):
            assert m.log(step, sampling={"temperature": first}, **_arrays(0.01))["alerts"] == []
        alerts = m.log(5, sampling={"temperature": then}, **_arrays(1.0))["alerts"]
    assert [a["key"] for a in alerts] == ["mean_abs_logprob_diff"]


def test_a_continued_run_groups_stored_float32_steps_with_the_decimal(tmp_path):
    with Monitor(tmp_path, jumps={"mean_abs_logprob_diff": 5.0}, **QUIET) as m:
        for step in range(5):
            m.log(step, sampling={"temperature": np.float32(0.7)}, **_arrays(0.01))
    with Monitor(tmp_path, jumps={"mean_abs_logprob_diff": 5.0}, **QUIET) as m:  # history from the store
        alerts = m.log(5, sampling={"temperature": 0.7}, **_arrays(1.0))["alerts"]
        assert [a["key"] for a in alerts] == ["mean_abs_logprob_diff"]
        # another temperature keeps its own baseline: no history yet, no jump
        assert m.log(6, sampling={"temperature": 0.71}, **_arrays(1.0))["alerts"] == []


# -- 3. a trailing median of 0 -------------------------------------------------------------------------


def test_a_jump_over_a_zero_median_says_what_the_zero_means():
    (alert,) = Jumps.of({"k3_kl": 10.0}).check({"k3_kl": 1e-9}, {"k3_kl": [0.0] * 5})
    assert "infx" not in alert["message"]
    assert alert["message"] == ("k3_kl 1e-09 where the trailing median is 0 (bitwise equal logprobs at "
                                "the counted tokens): any drift is a jump")
    assert {k: alert[k] for k in ("key", "value", "low", "high", "jump", "trailing_median")} == {
        "key": "k3_kl", "value": 1e-9, "low": None, "high": 0.0, "jump": 10.0, "trailing_median": 0.0}
    (alert,) = Jumps.of({"frac_tokens_ratio_gt_2": 3.0}).check(
        {"frac_tokens_ratio_gt_2": 0.01}, {"frac_tokens_ratio_gt_2": [0.0] * 5})
    assert "(no ratio above 2)" in alert["message"]  # not "bitwise equal": ratios of 1.5 give 0 too
    (alert,) = Jumps.of({"k3_kl": 10.0}).check({"k3_kl": 1.0}, {"k3_kl": [0.01] * 5})
    assert alert["message"] == "k3_kl 1 is 100x the trailing median 0.01 (flagged above 10x)"


def test_a_bitwise_equal_run_that_drifts_is_flagged_with_the_zero_median(tmp_path):
    with Monitor(tmp_path, **QUIET) as m:
        for step in range(5):
            assert m.log(step, **_arrays(0.0))["alerts"] == []
        alerts = m.log(5, **_arrays(0.01))["alerts"]
    assert {a["key"] for a in alerts} == {"k3_kl", "mean_abs_logprob_diff"}
    assert all("trailing median is 0 (bitwise equal" in a["message"] and "infx" not in a["message"]
               for a in alerts)


# -- a sampling field holding several values -----------------------------------------------------------


@pytest.mark.parametrize("value", [np.array([0.7, 0.7]), torch.tensor([0.7, 0.7])])
def test_a_per_row_sampling_value_is_an_input_error(value):
    with pytest.raises(InputError, match=r"sampling\['temperature'\] must be one value for the step"):
        checked_sampling({"temperature": value})
    assert checked_sampling({"temperature": np.array([0.5]), "top_k": torch.tensor(5)}) == {
        "temperature": 0.5, "top_k": 5}
