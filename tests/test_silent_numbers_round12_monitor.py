"""Round 12, the monitor's stored steps and their page: an infinite value is stored and read back as
itself (not as "not measured"), alerts say what crossed, the page names what its charts leave out
and where a continued run changed its thresholds. No engine starts.
"""

from __future__ import annotations

import json
import math
import sqlite3

import numpy as np

from parity.monitor import Monitor
from parity.monitor.command import main as monitor_main
from parity.monitor.page import detail_steps, monitor_html
from parity.monitor.store import MonitorStore

#: the entry naming a dict's non-finite floats (`parity.core.tables.NONFINITE_KEY`): part of the format.
NONFINITE_KEY = "nonfinite"
INF, NAN = math.inf, math.nan


def _record(k3: float | None, **summary: float | None) -> dict:
    return {"summary": {"k3_kl": k3, "mean_abs_logprob_diff": 0.01, **summary},
            "rollout_corr": {"rollout_corr/k3_kl": k3}, "alerts": [], "worst_tokens": [], "by_position": []}


def _store(tmp_path, records: list[dict]) -> MonitorStore:
    store = MonitorStore.create(tmp_path, "run")
    for step, record in enumerate(records):
        store.append(step, record)
    return store


def _steps(tmp_path) -> list[dict]:
    store = MonitorStore.open(tmp_path)
    try:
        return store.steps()
    finally:
        store.close()


def _log_kw(rollout: np.ndarray) -> dict:
    return {"rollout_log_probs": rollout, "old_log_probs": np.zeros_like(rollout),
            "response_mask": np.ones_like(rollout)}


def _rollout(value: float, drift: float = -0.1) -> np.ndarray:
    r = np.zeros((2, 4))
    r[1, 1] = drift
    r[0, 0] = value
    return r


def test_infinite_and_nan_values_read_back_as_themselves(tmp_path):
    rec = _record(INF, k2_kl=NAN, k1_kl=None)
    rec["rollout_corr"]["rollout_corr/rollout_ppl"] = -INF
    rec["alerts"] = [{"key": "k3_kl", "value": INF, "message": "k3_kl inf > 1"}]
    _store(tmp_path, [rec]).close()
    step = _steps(tmp_path)[0]
    assert step["summary"]["k3_kl"] == INF  # was None: "not measured"
    assert math.isnan(step["summary"]["k2_kl"])
    assert step["summary"]["k1_kl"] is None  # a null stays "not measured"
    assert step["rollout_corr"]["rollout_corr/rollout_ppl"] == -INF
    assert step["alerts"][0]["value"] == INF
    assert NONFINITE_KEY not in step["summary"]  # in memory, the record is the monitor's again


def test_stored_text_is_null_with_a_marker_old_readers_see_as_null(tmp_path):
    _store(tmp_path, [_record(INF)]).close()
    with sqlite3.connect(tmp_path / "monitor.sqlite") as conn:
        text = conn.execute("SELECT record FROM steps").fetchone()[0]
    stored = json.loads(text)  # strict JSON
    assert stored["summary"]["k3_kl"] is None
    assert stored["summary"][NONFINITE_KEY] == {"k3_kl": "inf"}
    assert stored["rollout_corr"][NONFINITE_KEY] == {"rollout_corr/k3_kl": "inf"}


def test_a_malformed_marker_makes_its_step_unreadable_not_wrong(tmp_path):
    store = _store(tmp_path, [_record(0.1)])
    bad = _record(None)
    bad["summary"][NONFINITE_KEY] = {"k3_kl": "big"}
    store.append(1, bad)
    contradicting = _record(0.2)
    contradicting["summary"][NONFINITE_KEY] = {"k3_kl": "inf"}  # a value and a marker: edited
    store.append(2, contradicting)
    store.close()
    reader = MonitorStore.open(tmp_path)
    steps = reader.steps()
    reader.close()
    assert "undecodable" not in steps[0] and steps[0]["summary"]["k3_kl"] == 0.1
    assert "nonfinite" in steps[1]["undecodable"] and "nonfinite" in steps[2]["undecodable"]
    assert len(reader.problems) == 2


def test_users_meta_is_kept_as_given(tmp_path):
    rec = {**_record(0.1), "meta": {"nonfinite": {"lr": "inf"}, "lr": 3e-4}}
    _store(tmp_path, [rec]).close()
    assert _steps(tmp_path)[0]["meta"] == {"nonfinite": {"lr": "inf"}, "lr": 3e-4}


def test_alert_on_an_infinite_value_says_it_crossed_and_keeps_the_value(tmp_path):
    with Monitor(tmp_path, thresholds={"rollout_corr/k3_kl": 1.0}, render_every=0, background="thread",
                 jumps=None) as m:
        out = m.log(0, **_log_kw(_rollout(-800.0)))  # exp(800) overflows: verl's k3 is +inf
    alert = out["alerts"][0]
    assert out["rollout_corr"]["rollout_corr/k3_kl"] == INF
    assert alert["value"] == INF and "missing" not in alert["message"], alert
    stored = _steps(tmp_path)[0]
    assert stored["rollout_corr"]["rollout_corr/k3_kl"] == INF and stored["alerts"][0]["value"] == INF


def test_nan_and_missing_values_still_alert(tmp_path):
    from parity.monitor.thresholds import Thresholds

    t = Thresholds.of({"k3_kl": 1.0, "k2_kl": (0.0, None)})
    assert [a["key"] for a in t.check({"k3_kl": NAN, "k2_kl": None})] == ["k3_kl", "k2_kl"]
    assert [a["value"] for a in t.check({"k3_kl": INF, "k2_kl": -INF})] == [INF, -INF]


def test_json_export_tells_infinity_from_not_measured(tmp_path):
    _store(tmp_path, [_record(0.1), _record(INF), _record(None)]).close()
    out = tmp_path / "steps.json"
    assert monitor_main([str(tmp_path), "--json", str(out), "--html", str(tmp_path / "p.html")]) == 0
    steps = json.loads(out.read_text())["steps"]
    assert steps[1]["summary"]["k3_kl"] is None and steps[1]["summary"][NONFINITE_KEY] == {"k3_kl": "inf"}
    assert steps[2]["summary"]["k3_kl"] is None and NONFINITE_KEY not in steps[2]["summary"]


def test_page_details_an_infinite_step_and_names_the_chart_gaps(tmp_path):
    records = [_record(0.1), _record(INF), _record(NAN), _record(None), _record(0.2), _record(0.05)]
    _store(tmp_path, records).close()
    steps = _steps(tmp_path)
    chosen = detail_steps(steps)
    assert chosen[:2] == [5, 1]  # the latest, then the infinite k3_kl (was never ranked: null)
    assert 2 not in chosen and 3 not in chosen
    page = monitor_html({"run_name": "run"}, steps)
    assert "k3_kl: 3 of the 6 steps storing it not charted" in page
    assert "inf at step 1" in page and "nan at step 2" in page and "null (not measured) at step 3" in page
    assert "mean_abs_logprob_diff: " not in page  # every step has a finite value: nothing to say


def test_page_says_where_thresholds_changed(tmp_path):
    first = {**_record(0.1), "thresholds": {"k3_kl": [None, 1e-9]},
             "alerts": [{"key": "k3_kl", "value": 0.1, "message": "k3_kl 0.1 > 1e-09"}]}
    second = {**_record(0.1), "thresholds": {"k3_kl": [None, 100.0]}}
    page = monitor_html({"run_name": "run"}, [{"step": 0, "logged_at": 0.0, **first},
                                              {"step": 1, "logged_at": 1.0, **second}])
    assert "Thresholds changed" in page
    assert "k3_kl: threshold [open, 1e-09] up to step 0, threshold [open, 100] from step 1" in page


def test_a_continued_run_judges_jumps_on_the_values_a_live_one_would(tmp_path):
    kw = {"render_every": 0, "background": "thread", "jumps": {"k2_kl": 5.0}}
    with Monitor(tmp_path, **kw) as m:
        for step in range(5):  # step 2's k2_kl is +inf: the live history holds it, 5 values
            m.log(step, **_log_kw(_rollout(-1e300 if step == 2 else 0.0)))
    with Monitor(tmp_path, **kw) as m:  # the same run, a new session: its history from the store
        out = m.log(5, **_log_kw(_rollout(0.0, drift=-3.0)))
    assert [a["key"] for a in out["alerts"]] == ["k2_kl"]


def test_page_does_not_say_no_thresholds_were_set_when_an_earlier_session_set_them():
    first = {**_record(0.1), "thresholds": {"k3_kl": [None, 1.0]}}
    page = monitor_html({"run_name": "run"}, [{"step": 0, "logged_at": 0.0, **first},
                                              {"step": 1, "logged_at": 1.0, **_record(0.1)}])
    assert "no absolute thresholds set" not in page
    assert "None: every step within its thresholds" in page


def test_command_names_a_latest_value_that_is_infinite_or_not_measured(tmp_path, capsys):
    _store(tmp_path, [_record(0.1), _record(INF, max_abs_logprob_diff=None)]).close()
    assert monitor_main([str(tmp_path), "--html", str(tmp_path / "p.html")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("latest step"))
    assert "k3_kl inf" in line and "max_abs_logprob_diff null (not measured)" in line, line
