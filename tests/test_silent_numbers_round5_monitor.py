"""Round 5, the monitor: alerts and stored series that were silently wrong on valid inputs.

- `jumps=` took any summary key and flagged `value > X x median`: for the signed `k1_kl` (median
  -0.009) a step with almost no drift (+1e-4) was flagged "infx the trailing median" and a step
  75x further out (-0.74) was not. Now only drift magnitudes (>= 0, 0 without drift, larger is
  worse) take a jump; any other key is a `ConfigError` pointing at a band in `thresholds=`.
- A resumed attempt's first step was judged against the steps it supersedes: a run whose steps
  10-29 drifted (a broken weight sync) and that resumed at step 10 with the bug still there had
  no jump alert, the median being the broken steps'. Now against the steps it keeps (0-9).
- A run directory continued with another `correction=` charted both corrections' `rollout_corr/*`
  metrics as one series, and no step said which correction it was measured with. Now each step
  stores its correction and a Monitor of another correction on the run is a `ConfigError`.
"""

from __future__ import annotations

import numpy as np
import pytest

import parity
from parity.core.errors import ConfigError
from parity.core.schema import SUMMARY_KEYS
from parity.monitor import MonitorStore
from parity.monitor.thresholds import DEFAULT_JUMPS, JUMP_KEYS

pytestmark = pytest.mark.usefixtures("one_thread")


def _arrays(rng: np.random.Generator, drift: float, bias: float = 0.0) -> dict[str, np.ndarray]:
    rollout = np.log(rng.uniform(0.05, 0.9, (8, 16)))
    train = np.minimum(rollout + bias + rng.normal(0.0, drift, rollout.shape), 0.0)
    return {"rollout_log_probs": rollout, "old_log_probs": train, "response_mask": np.ones((8, 16), bool)}


def _stored(out) -> list[dict]:
    store = MonitorStore.open(out)
    try:
        return store.steps()
    finally:
        store.close()


# -- jumps only where "X times the median" means a jump ----------------------------------------------

@pytest.mark.parametrize("key", ["k1_kl", "chi2_token", "rollout_probs_pearson", "is_ratio_min",
                                 "is_ratio_mean", "token_mult_prob_error", "num_tokens"])
def test_jumps_refuse_a_metric_that_is_not_a_drift_magnitude(tmp_path, key):
    with pytest.raises(ConfigError, match=rf"jumps: '{key}' is not a drift magnitude.*thresholds="):
        parity.Monitor(tmp_path, jumps={key: 10.0}, render_every=0)
    assert not (tmp_path / "monitor.sqlite").exists()  # refused before the store is made


def test_every_drift_magnitude_takes_a_jump_and_flags_upward(tmp_path):
    assert set(DEFAULT_JUMPS) <= set(JUMP_KEYS) <= set(SUMMARY_KEYS)
    rng = np.random.default_rng(0)
    with parity.Monitor(tmp_path, jumps=dict.fromkeys(JUMP_KEYS, 5.0), advice_every=0, render_every=0) as m:
        for step in range(6):
            assert m.log(step, **_arrays(rng, 0.01))["alerts"] == []
        assert m.log(6, **_arrays(rng, 0.0, bias=-1e-4))["alerts"] == []  # the old k1_kl false alarm
        flagged = {a["key"] for a in m.log(7, **_arrays(rng, 0.5))["alerts"]}
    assert {"k3_kl", "mean_abs_logprob_diff", "max_abs_logprob_diff", "k2_kl"} <= flagged


# -- a resumed attempt is judged against the steps it keeps ------------------------------------------

@pytest.mark.parametrize("session", ["same", "new"])
def test_a_resumed_step_is_judged_against_the_steps_it_keeps(tmp_path, session):
    rng = np.random.default_rng(0)
    m = parity.Monitor(tmp_path, advice_every=0, render_every=0, resume=True)
    try:
        for step in range(10):
            m.log(step, **_arrays(rng, 0.001))
        for step in range(10, 30):  # a broken weight sync from step 10 on
            m.log(step, **_arrays(rng, 0.5))
        if session == "new":
            m.close()
            m = parity.Monitor(tmp_path, advice_every=0, render_every=0, resume=True)
        first = m.log(10, **_arrays(rng, 0.5))  # resumed from the step-10 checkpoint, the bug still there
        assert first["attempt"] == 1
        jumped = {a["key"]: a for a in first["alerts"]}
        assert set(jumped) == {"k3_kl", "mean_abs_logprob_diff"}  # was no alert at all
        assert jumped["mean_abs_logprob_diff"]["trailing_median"] < 0.01  # steps 0-9's, not 10-29's
        # the attempt's later steps are judged against it and steps 0-9 alone
        later = m.log(11, **_arrays(rng, 0.5))
        assert {a["key"] for a in later["alerts"]} == {"k3_kl", "mean_abs_logprob_diff"}
    finally:
        m.close()
    assert [s["step"] for s in _stored(tmp_path)] == list(range(12))


# -- one run, one correction -------------------------------------------------------------------------

def test_a_run_continued_with_another_correction_is_refused(tmp_path):
    rng = np.random.default_rng(0)
    with parity.Monitor(tmp_path, advice_every=0, render_every=0) as m:
        record = m.log(0, **_arrays(rng, 1.0))
    assert record["correction"] == {"rollout_is": "token", "rollout_is_threshold": 2.0,
                                    "rollout_is_batch_normalize": False, "rollout_rs": None,
                                    "rollout_rs_threshold": None, "rollout_is_clamp_lower": None}
    assert _stored(tmp_path)[0]["correction"] == record["correction"]
    for other in ({"rollout_is": "token", "rollout_is_threshold": 10.0}, {"rollout_is": "sequence"},
                  {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k3",
                   "rollout_rs_threshold": 0.01}):
        with pytest.raises(ConfigError, match=r"correction .*rollout_corr/\* metrics were computed with "
                                              r"correction .*'rollout_is_threshold': 2\.0.*another out_dir"):
            parity.Monitor(tmp_path, correction=other, advice_every=0, render_every=0)
    # the same correction, spelled otherwise, continues (and the refusals released the writer lock)
    with parity.Monitor(tmp_path, correction={"rollout_is": "token", "rollout_is_threshold": 2},
                        advice_every=0, render_every=0) as m:
        m.log(1, **_arrays(rng, 1.0))
    with parity.Monitor(tmp_path, correction=m.correction, advice_every=0, render_every=0, resume=True) as m:
        m.log(1, **_arrays(rng, 1.0))
    assert [(s["step"], s["attempt"]) for s in _stored(tmp_path)] == [(0, 0), (1, 1)]


def test_a_store_from_before_steps_carried_their_correction_continues(tmp_path):
    store = MonitorStore.create(tmp_path, "old")
    store.append(0, {"summary": {"k3_kl": 1e-4}, "rollout_corr": {}})
    store.close()
    with parity.Monitor(tmp_path, correction={"rollout_is": "sequence"}, advice_every=0, render_every=0) as m:
        m.log(1, **_arrays(np.random.default_rng(0), 0.01))
    assert [s.get("correction", {}).get("rollout_is") for s in _stored(tmp_path)] == [None, "sequence"]
