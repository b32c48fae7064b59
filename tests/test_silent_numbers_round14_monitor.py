"""Round 14, the monitor: a non-finite value inside a list (a step's top-k logprobs) or the user's `meta`
reads back as itself, not as "not measured"; jumps are judged on an order-free median (NaN in the
history, an even window) and an infinite step is a jump; a run continued with an infinite correction
threshold is not refused; the run names each parity version that appended steps. No engine starts.
"""

from __future__ import annotations

import json
import math
import sqlite3

import numpy as np
import pytest

from parity.core.schema import VERSION
from parity.monitor import Monitor
from parity.monitor.command import main as monitor_main
from parity.monitor.page import monitor_html
from parity.monitor.store import MonitorStore
from parity.monitor.thresholds import Jumps

#: the entry naming the non-finite floats inside a dict's lists and its `meta`: part of the format.
ITEMS_KEY = "nonfinite_items"
INF, NAN = math.inf, math.nan
QUIET = {"render_every": 0, "background": "thread"}


pytestmark = pytest.mark.usefixtures("quiet_monitor_log")


def _record(k3: float = 0.01, **extra: object) -> dict:
    return {"summary": {"k3_kl": k3, "mean_abs_logprob_diff": 0.01}, "rollout_corr": {}, "alerts": [],
            "worst_tokens": [], "by_position": [], **extra}


def _steps(tmp_path) -> tuple[list[dict], list[str]]:
    store = MonitorStore.open(tmp_path)
    try:
        return store.steps(), store.problems
    finally:
        store.close()


def _raw(tmp_path) -> list[dict]:
    with sqlite3.connect(tmp_path / "monitor.sqlite") as conn:
        return [json.loads(r[0]) for r in conn.execute("SELECT record FROM steps ORDER BY step")]


def _log_kw(drift: float, value: float = 0.0) -> dict:
    rollout = np.zeros((2, 4))
    rollout[1, 1] = -drift
    rollout[0, 0] = value
    return {"rollout_log_probs": rollout, "old_log_probs": np.zeros_like(rollout),
            "response_mask": np.ones_like(rollout)}


def _distribution() -> dict:
    return {"top_k": 3, "worst": [{"row": 0, "position": 1, "token_id": 5, "kl_train_engine": 0.5,
                                   "kl_engine_train": 0.4, "tv": 0.3, "sampled_rank": 0,
                                   "rollout": {"ids": [5, 6, 7], "logprobs": [-0.1, -2.5, -INF]},
                                   "train": {"ids": [5, 7, 6], "logprobs": [-0.2, -INF, NAN]}}]}


def test_a_non_finite_top_k_logprob_reads_back_as_itself(tmp_path):
    store = MonitorStore.create(tmp_path, "run")
    store.append(0, _record(distribution=_distribution(), nested=[[1.0, INF], [-INF]]))
    store.close()
    step = _steps(tmp_path)[0][0]
    assert step["distribution"]["worst"][0]["rollout"]["logprobs"] == [-0.1, -2.5, -INF]  # was None
    train = step["distribution"]["worst"][0]["train"]["logprobs"]
    assert train[:2] == [-0.2, -INF] and math.isnan(train[2])
    assert step["nested"] == [[1.0, INF], [-INF]]
    assert ITEMS_KEY not in step["distribution"]["worst"][0]["rollout"]  # in memory: the record again


def test_stored_text_is_strict_json_with_nulls_older_readers_see_as_before(tmp_path):
    store = MonitorStore.create(tmp_path, "run")
    store.append(0, _record(distribution=_distribution()))
    store.close()
    side = _raw(tmp_path)[0]["distribution"]["worst"][0]["rollout"]
    assert side["logprobs"] == [-0.1, -2.5, None]
    assert side[ITEMS_KEY] == [[["logprobs", 2], "-inf"]]


def test_a_stored_list_null_without_the_entry_stays_not_measured(tmp_path):
    store = MonitorStore.create(tmp_path, "run")
    store.append(0, _record(by_step=[0.1, None]))  # a null of its own, as older stores hold
    store.close()
    assert _steps(tmp_path)[0][0]["by_step"] == [0.1, None]


def test_users_meta_with_inf_and_nan_reads_back_as_given(tmp_path):
    meta = {"grad_norm": INF, "losses": [1.0, NAN], "opt": {"lr": -INF}, "nonfinite": {"x": "inf"},
            ITEMS_KEY: [["x"], "inf"], "x": None}
    with Monitor(tmp_path, **QUIET) as m:
        out = m.log(0, **_log_kw(0.1), meta=meta)
    for got in (out["meta"], _steps(tmp_path)[0][0]["meta"]):
        assert got["grad_norm"] == INF  # was None, in the returned record and the store
        assert got["losses"][0] == 1.0 and math.isnan(got["losses"][1])
        assert got["opt"] == {"lr": -INF}
        # the user's own keys, named like parity's marks, are never read as marks
        assert got["nonfinite"] == {"x": "inf"} and got[ITEMS_KEY] == [["x"], "inf"] and got["x"] is None
    assert _raw(tmp_path)[0]["meta"]["grad_norm"] is None  # strict JSON


def test_a_stored_meta_is_never_read_for_marks_of_its_own(tmp_path):
    store = MonitorStore.create(tmp_path, "run")
    store.append(0, _record(meta={"nonfinite": {"lr": "inf"}, "lr": None}))
    store.close()
    assert _steps(tmp_path)[0][0]["meta"] == {"nonfinite": {"lr": "inf"}, "lr": None}


@pytest.mark.parametrize("mark", [[["logprobs", 0], "-inf"], [["logprobs", 9], "-inf"], [["ids", 2], "inf"],
                                  [["logprobs", 2], "big"], "logprobs"])
def test_a_malformed_items_entry_makes_its_step_unreadable_not_wrong(tmp_path, mark):
    store = MonitorStore.create(tmp_path, "run")
    store.append(0, _record())
    store.append(1, _record(side={"ids": [1, 2, 3], "logprobs": [-0.1, -0.2, None], ITEMS_KEY: [mark]}))
    store.close()
    steps, problems = _steps(tmp_path)
    assert "undecodable" not in steps[0]
    assert ITEMS_KEY in steps[1]["undecodable"] and len(problems) == 1


def test_json_export_names_a_non_finite_list_item_and_meta_value(tmp_path):
    store = MonitorStore.create(tmp_path, "run")
    store.append(0, _record(distribution=_distribution(), meta={"loss": NAN}))
    store.close()
    out = tmp_path / "steps.json"
    assert monitor_main([str(tmp_path), "--json", str(out), "--html", str(tmp_path / "p.html")]) == 0
    step = json.loads(out.read_text())["steps"][0]
    assert step["distribution"]["worst"][0]["rollout"][ITEMS_KEY] == [[["logprobs", 2], "-inf"]]
    assert step["meta"] == {"loss": None} and step[ITEMS_KEY] == [[["meta", "loss"], "nan"]]


def test_a_nan_in_the_history_does_not_change_the_median_wherever_it_lies():
    medians = []
    for at in range(6):
        history = [0.01] * 5
        history.insert(at, NAN)
        alerts = Jumps.of({"k3_kl": 10.0}).check({"k3_kl": 0.5}, {"k3_kl": history})
        medians.append([a["trailing_median"] for a in alerts])
    assert medians == [[0.01]] * 6  # old: the jump missed with the NaN at 3 (sorted() left it mid-list)


def test_nan_values_do_not_count_toward_the_history_needed():
    history = [0.01] * 4 + [NAN] * 3
    assert Jumps.of({"k3_kl": 10.0}).check({"k3_kl": 0.5}, {"k3_kl": history}) == []


def test_a_run_continued_over_a_stored_nan_flags_a_jump(tmp_path):
    store = MonitorStore.create(tmp_path, "run")
    for step, k3 in enumerate([1e-4, 1e-4, 1e-4, NAN, 1e-4, 1e-4]):
        store.append(step, _record(k3))
    store.close()
    with Monitor(tmp_path, jumps={"k3_kl": 10.0}, **QUIET) as m:
        out = m.log(6, **_log_kw(0.5))
    assert [a["key"] for a in out["alerts"]] == ["k3_kl"]


def test_an_infinite_step_is_a_jump(tmp_path):
    with Monitor(tmp_path, jumps={"k2_kl": 5.0}, **QUIET) as m:
        for step in range(5):
            m.log(step, **_log_kw(0.1))
        out = m.log(5, **_log_kw(0.1, value=-1e300))  # k2_kl overflows to +inf
    assert out["summary"]["k2_kl"] == INF
    assert [(a["key"], a["value"]) for a in out["alerts"]] == [("k2_kl", INF)]  # old: no alert


def test_an_even_window_is_judged_on_its_true_median(tmp_path):
    with Monitor(tmp_path, jumps={"mean_abs_logprob_diff": 5.0}, **QUIET) as m:
        for step in range(20):  # mean_abs_logprob_diff 0.01 and 0.02 alternating: median 0.015
            m.log(step, **_log_kw(0.08 if step % 2 else 0.16))
        out = m.log(20, **_log_kw(0.72))  # 0.09: 6x the median
    assert [a["trailing_median"] for a in out["alerts"]] == [pytest.approx(0.015)]  # old: 0.02, no alert


def test_a_run_with_an_infinite_correction_threshold_continues(tmp_path):
    correction = {"rollout_is": "token", "rollout_is_threshold": INF}
    with Monitor(tmp_path, correction=correction, **QUIET) as m:
        m.log(0, **_log_kw(0.1))
    with Monitor(tmp_path, correction=correction, **QUIET) as m:  # old: ConfigError "another correction"
        assert m.log(1, **_log_kw(0.1))["correction"]["rollout_is_threshold"] == INF
    with pytest.raises(Exception, match="another out_dir"):
        Monitor(tmp_path, correction={"rollout_is": "token", "rollout_is_threshold": 2.0}, **QUIET)


def test_the_run_names_each_parity_version_that_appended(tmp_path):
    with Monitor(tmp_path, **QUIET) as m:
        m.log(0, **_log_kw(0.1))
    store = MonitorStore.open(tmp_path)
    assert json.loads(store.run_info()["parity_versions"]) == [VERSION]
    store.close()
    with sqlite3.connect(tmp_path / "monitor.sqlite") as conn:  # as if an older parity had created it
        conn.execute("DELETE FROM run WHERE key = 'parity_versions'")
        conn.execute("UPDATE run SET value = '0.0.1' WHERE key = 'parity_version'")
    with Monitor(tmp_path, **QUIET) as m:
        m.log(1, **_log_kw(0.1))
    store = MonitorStore.open(tmp_path)
    run, steps = store.run_info(), store.steps()
    store.close()
    assert run["parity_version"] == "0.0.1"  # the creator's, as older readers read it
    assert json.loads(run["parity_versions"]) == ["0.0.1", VERSION]
    assert f"steps by parity 0.0.1, {VERSION}" in monitor_html(run, steps)
    assert f"· parity {VERSION}<" not in monitor_html(run, steps)


def test_a_top_k_sampled_step_keeps_its_minus_inf_entries_and_its_page(tmp_path):
    from parity.drift.distribution import trainer_view
    from parity.monitor.page import write_page

    logits = 2.0 * np.random.default_rng(0).standard_normal((8, 20))
    kept = logits >= np.sort(logits, axis=1)[:, -3:-2]  # top_k=3 sampling: the rest is -inf
    shifted = np.where(kept, logits, -INF) - logits.max(axis=1, keepdims=True)
    rows = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))  # log_softmax
    top_ids = np.argsort(-rows, axis=1, kind="stable")[:, :5]
    top_lp = np.take_along_axis(rows, top_ids, axis=1)  # entries 3 and 4 are -inf
    responses, lp = top_ids[:, 0], top_lp[:, 0]
    view = trainer_view(rows, top_ids, responses)
    with Monitor(tmp_path, **QUIET) as m:
        out = m.log(0, rollout_log_probs=lp.reshape(2, 4), old_log_probs=lp.reshape(2, 4),
                    response_mask=np.ones((2, 4)), responses=responses.reshape(2, 4),
                    rollout_top_k=(top_ids.reshape(2, 4, 5), top_lp.reshape(2, 4, 5)), train_top_k=view)
    assert out["distribution"]["worst"][0]["rollout"]["logprobs"][3:] == [-INF, -INF]
    stored = _steps(tmp_path)[0][0]["distribution"]["worst"][0]
    assert stored["rollout"]["logprobs"][3:] == [-INF, -INF]  # old: [None, None]
    assert stored["train"]["logprobs"][3:] == [-INF, -INF]
    assert "-inf" in write_page(tmp_path).read_text()  # old: TypeError formatting None, no page


def test_an_alert_just_across_its_bound_is_not_printed_equal_to_it():
    from parity.monitor.thresholds import Thresholds

    alerts = Thresholds.of({"k3_kl": 0.1, "is_ratio_mean": (0.999, None)}).check(
        {"k3_kl": 0.100004, "is_ratio_mean": 0.99899999})
    assert [a["message"] for a in alerts] == ["k3_kl 0.100004 > 0.1", "is_ratio_mean 0.99899999 < 0.999"]
    assert Thresholds.of({"k3_kl": 0.1}).check({"k3_kl": 0.3})[0]["message"] == "k3_kl 0.3 > 0.1"
    (jump,) = Jumps.of({"k3_kl": 10.0}).check({"k3_kl": 0.1000001}, {"k3_kl": [0.01] * 5})
    assert "is 10.00001x the trailing median 0.01 (flagged above 10x)" in jump["message"]  # old: 10x, 10x
