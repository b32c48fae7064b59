"""parity.Monitor: each step's record is parity's own metrics, correction and advice on the step's
arrays; the store is append-only, one transaction per step, readable while the run goes on and after
it is SIGKILLed mid-step; the page is drawn off the critical path and a failed drawing loses no
step; bad input is a named error that leaves the monitor as it was; nothing here loads torch until
the first `log`."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from test_layers import heavy_modules_after

import parity
from parity.cli import main as cli_main
from parity.core.errors import ConfigError, InputError
from parity.core.schema import SUMMARY_KEYS, SUPPORT_SUMMARY_KEYS
from parity.correction import rollout_correction
from parity.drift.metrics import drift_by_position, summarize
from parity.monitor import MonitorStore, flat_values
from parity.monitor import page as page_module
from parity.monitor.command import main as monitor_main
from parity.monitor.store import STORE_FILE

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("one_thread")


def step_arrays(seed: int = 0, batch: int = 16, width: int = 24, drift: float = 0.05
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """verl-layout float32 rollout / trainer logprobs `[batch, width]`, a right-padded mask with
    lengths 1..width, and response ids; padding holds -inf (allowed) in the rollout."""
    rng = np.random.default_rng(seed)
    rollout = np.log(rng.uniform(1e-4, 1.0, (batch, width))).astype(np.float32)
    trainer = np.minimum(rollout + rng.normal(0.0, drift, (batch, width)), 0.0).astype(np.float32)
    lengths = rng.integers(1, width + 1, batch)
    mask = np.arange(width)[None, :] < lengths[:, None]
    rollout[~mask] = -np.inf
    return rollout, trainer, mask, rng.integers(0, 1000, (batch, width))


def log(monitor: parity.Monitor, step: int, seed: int | None = None, **changes):
    rollout, trainer, mask, responses = step_arrays(step if seed is None else seed)
    kwargs = dict(rollout_log_probs=rollout, old_log_probs=trainer, response_mask=mask, responses=responses,
                  sampling={"temperature": 1.0})
    kwargs.update(changes)
    return monitor.log(step, **kwargs)


def stored(out: Path) -> list[dict]:
    store = MonitorStore.open(out)
    try:
        return store.steps()
    finally:
        store.close()


# -- what a step stores ---------------------------------------------------------------------------


def test_a_step_stores_parity_s_own_summary_correction_and_breakdown(tmp_path):
    """The record is `summarize`, verl's `rollout_corr/*` (default: token TIS at 2) and
    `drift_by_position` of the same arrays, exactly, and survives the store's JSON round trip."""
    rollout, trainer, mask, responses = step_arrays(3)
    with parity.Monitor(tmp_path, advice_every=0, render_every=0) as monitor:
        record = monitor.log(7, rollout_log_probs=torch.from_numpy(rollout),
                             old_log_probs=torch.from_numpy(trainer), response_mask=torch.from_numpy(mask),
                             responses=torch.from_numpy(responses))
    [row] = stored(tmp_path)
    assert row["step"] == record["step"] == 7 and row["logged_at"] == record["logged_at"]
    assert row["summary"] == {**summarize(trainer, rollout, mask), "num_tokens_outside_support": 0,
                              "frac_tokens_outside_support": 0.0}  # the -inf padding is padding
    assert tuple(row["summary"]) == SUMMARY_KEYS + SUPPORT_SUMMARY_KEYS
    _, _, metrics = rollout_correction(trainer, rollout, mask, rollout_is="token", rollout_is_threshold=2.0)
    assert row["rollout_corr"] == metrics
    assert row["by_position"] == json.loads(json.dumps(drift_by_position(trainer, rollout, mask)))
    assert row["shape"] == list(mask.shape) and "recommendation" not in row


def test_the_correction_of_the_rollout_corr_metrics_is_the_monitor_s(tmp_path):
    from parity.correction import CorrectionConfig

    rollout, trainer, mask, _ = step_arrays(2)
    options = {"rollout_is": "sequence", "rollout_is_threshold": 5.0, "rollout_rs": "seq_mean_k3",
               "rollout_rs_threshold": 0.01}
    _, _, want = rollout_correction(trainer, rollout, mask, **options)
    for correction in (options, CorrectionConfig(**options)):
        with parity.Monitor(tmp_path / str(type(correction).__name__), advice_every=0, render_every=0,
                            correction=correction) as monitor:
            got = monitor.log(0, rollout_log_probs=rollout, old_log_probs=trainer, response_mask=mask)
        assert got["rollout_corr"] == want


def test_worst_tokens_are_the_largest_drifts_with_their_token_ids(tmp_path):
    rollout, trainer, mask, responses = step_arrays(4)
    with parity.Monitor(tmp_path, advice_every=0, render_every=0) as monitor:
        worst = monitor.log(0, rollout_log_probs=rollout, old_log_probs=trainer, response_mask=mask,
                            responses=responses, prompts=responses[:, :20])["worst_tokens"]
    diff = np.where(mask, np.abs(trainer.astype(np.float64) - rollout), -1.0)
    order = np.argsort(-diff, axis=None, kind="stable")[:10]
    assert [(w["row"], w["position"]) for w in worst] == [divmod(int(i), mask.shape[1]) for i in order]
    for w in worst:
        r, c = w["row"], w["position"]
        assert w["token_id"] == responses[r, c] and w["prompt_tail"] == responses[r, 4:20].tolist()
        assert w["logprob_diff"] == float(trainer[r, c]) - float(rollout[r, c])


def test_torch_numpy_and_bfloat16_inputs(tmp_path):
    """A CPU tensor and its NumPy array give the same record; bfloat16 tensors (verl's trainer
    dtype) are widened exactly, so they match their float32 copies."""
    rollout, trainer, mask, _ = step_arrays(5)
    with parity.Monitor(tmp_path, advice_every=0, render_every=0) as monitor:
        a = monitor.log(0, rollout_log_probs=rollout, old_log_probs=trainer, response_mask=mask)
        b = monitor.log(1, rollout_log_probs=torch.from_numpy(rollout),
                        old_log_probs=torch.from_numpy(trainer), response_mask=torch.from_numpy(mask).int())
        bf = torch.from_numpy(trainer).bfloat16()
        c = monitor.log(2, rollout_log_probs=torch.from_numpy(rollout), old_log_probs=bf,
                        response_mask=torch.from_numpy(mask))
    assert a["summary"] == b["summary"] and a["rollout_corr"] == b["rollout_corr"]
    assert {k: c["summary"][k] for k in SUMMARY_KEYS} == summarize(bf.float().numpy(), rollout, mask)


def test_the_advisor_recommends_on_its_cadence(tmp_path):
    with parity.Monitor(tmp_path, advice_every=2, render_every=0) as monitor:
        returned = [log(monitor, step) for step in range(4)]
    assert not any("recommendation" in r for r in returned)  # the advisor runs off the training thread
    records = stored(tmp_path)
    assert ["recommendation" in r for r in records] == [True, False, True, False]
    rec = records[0]["recommendation"]
    with parity.Monitor(tmp_path / "inline", advice_every=2, render_every=0,
                        advice_in_background=False) as monitor:
        assert log(monitor, 0)["recommendation"] == rec
    rollout, trainer, mask, _ = step_arrays(0)
    assert rec == parity.advise(trainer, rollout, mask).to_dict()["recommendation"]
    verl = rec["frameworks"]["verl"]
    assert verl is None or "algorithm.rollout_correction.rollout_is" in verl


def test_tokens_outside_the_support_are_counted_apart(tmp_path):
    """parity's one rule for -inf, as in reports: a counted token one side gives -inf (a top-p cut)
    is counted in num_tokens_outside_support and left out of every other number."""
    rollout, trainer, mask, _ = step_arrays(6)
    trainer[0, 0] = -np.inf  # the trainer's nucleus excludes a token the rollout sampled
    rollout[3, 0] = -np.inf
    with parity.Monitor(tmp_path, advice_every=1, render_every=0, advice_in_background=False) as monitor:
        record = monitor.log(0, rollout_log_probs=rollout, old_log_probs=trainer, response_mask=mask)
    scored = mask.copy()
    scored[0, 0] = scored[3, 0] = False
    want = summarize(np.where(scored, trainer, 0), np.where(scored, rollout, 0), scored)
    summary = record["summary"]
    assert {k: summary[k] for k in want} == want
    assert summary["num_tokens_outside_support"] == 2
    assert summary["frac_tokens_outside_support"] == 2 / mask.sum()
    assert all(math.isfinite(v) for v in record["rollout_corr"].values())
    assert "recommendation" in record


def test_sampling_and_meta_are_stored_as_given(tmp_path):
    with parity.Monitor(tmp_path, advice_every=0, render_every=0) as monitor:
        log(monitor, 0, sampling={"temperature": np.float32(0.5), "top_p": 0.9},
            meta={"lr": 1e-6, "tag": "a"})
    [row] = stored(tmp_path)
    assert row["sampling"] == {"temperature": 0.5, "top_p": pytest.approx(0.9)}
    assert row["meta"] == {"lr": 1e-6, "tag": "a"}


# -- thresholds -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_thresholds_raise_a_warning_line_and_a_flag(tmp_path, caplog):
    bounds = {"k3_kl": 1e-4, "max_abs_logprob_diff": 50.0,
              "rollout_corr/rollout_is_eff_sample_size": (0.999, None)}
    with caplog.at_level(logging.WARNING, logger="parity.monitor"), \
            parity.Monitor(tmp_path, thresholds=bounds, advice_every=0, run_name="grpo") as monitor:
        rollout, trainer, mask, _ = step_arrays(0, drift=0.0)
        quiet = monitor.log(0, rollout_log_probs=rollout, old_log_probs=trainer, response_mask=mask)
        rollout, trainer, mask, _ = step_arrays(1, drift=0.3)
        loud = monitor.log(1, rollout_log_probs=rollout, old_log_probs=trainer, response_mask=mask)
    assert quiet["alerts"] == []
    assert {a["key"] for a in loud["alerts"]} == {"k3_kl", "rollout_corr/rollout_is_eff_sample_size"}
    lines = [r.getMessage() for r in caplog.records if r.name == "parity.monitor"]
    assert any(line.startswith("parity monitor grpo step 1: k3_kl") for line in lines)
    page = (tmp_path / "index.html").read_text()
    assert "2 alert(s)" in page and "step 1: k3_kl" in page


@pytest.mark.parametrize("bad, match", [
    ({"no_such_metric": 1.0}, "unknown metric"),
    ({"k3_kl": "high"}, "finite number"),
    ({"k3_kl": math.nan}, "finite number"),
    ({"k3_kl": (None, None)}, "at least one side"),
    ({"k3_kl": (2.0, 1.0)}, "above high"),
    ({"k3_kl": (1.0,)}, "a band is"),
    ([1.0], "dict of metric"),
])
def test_bad_thresholds_are_config_errors(tmp_path, bad, match):
    with pytest.raises(ConfigError, match=match):
        parity.Monitor(tmp_path, thresholds=bad)
    assert not (tmp_path / STORE_FILE).exists()


@pytest.mark.parametrize("kwargs, match", [
    ({"render_every": -1}, "render_every"), ({"advice_every": -1}, "advice_every"),
    ({"run_name": ""}, "run_name"), ({"correction": {"rollout_is": "bogus"}}, "rollout_is"),
    ({"correction": {"no_such_option": 1}}, "unknown option"),
])
def test_bad_options_are_config_errors(tmp_path, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        parity.Monitor(tmp_path, **kwargs)


# -- bad input: named errors, nothing stored, the monitor carries on ------------------------------


def _nan(a):
    a = a.copy()
    a[0, 0] = np.nan
    return a


def _posinf(a):
    a = a.copy()
    a[0, 0] = np.inf
    return a


BAD_INPUT = {
    "shapes": (lambda r, t, m: (r[:, :-1], t, m), "same \\[batch, seq\\] shape"),
    "nan": (lambda r, t, m: (r, _nan(t), m), "old_log_probs contains NaN or \\+inf"),
    "posinf": (lambda r, t, m: (_posinf(r), t, m), "rollout_log_probs contains NaN or \\+inf"),
    "neginf_at_every_valid_token": (lambda r, t, m: (r, np.where(m, -np.inf, t).astype(np.float32), m),
                                    "every counted token has logprob -inf"),
    "mask_values_with_neginf": (lambda r, t, m: (r, t, m.astype(np.int64) * 3),
                                "response_mask must be bool or hold only 0"),
    "empty_mask": (lambda r, t, m: (r, t, np.zeros_like(m)), "response_mask has no valid token"),
    "mask_values": (lambda r, t, m: (r, t, m.astype(np.int64) * 2),
                    "response_mask must be bool or hold only 0"),
    "one_d": (lambda r, t, m: (r[0], t[0], m[0]), "must be 2-D"),
    "integer_logprobs": (lambda r, t, m: (r, t.astype(np.int64), m), "floating point"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_arrays_are_named_errors_and_store_nothing(tmp_path, case):
    mutate, match = BAD_INPUT[case]
    with parity.Monitor(tmp_path, advice_every=0, render_every=0) as monitor:
        log(monitor, 0)
        rollout, trainer, mask, _ = step_arrays(1)
        r, t, m = mutate(rollout, trainer, mask)
        with pytest.raises(InputError, match=match):
            monitor.log(1, rollout_log_probs=r, old_log_probs=t, response_mask=m)
        assert monitor.last_step == 0 and [s["step"] for s in stored(tmp_path)] == [0]
        log(monitor, 1)  # the monitor carries on with the step that failed
    assert [s["step"] for s in stored(tmp_path)] == [0, 1]


@pytest.mark.parametrize("step, match", [
    (3, "does not come after the last logged step 3"), (1, "does not come after"), (-1, ">= 0"),
    (True, "integer"), (2.5, "integer"), ("4", "integer"),
])
def test_a_step_going_backwards_or_not_a_step_is_refused(tmp_path, step, match):
    with parity.Monitor(tmp_path, advice_every=0, render_every=0) as monitor:
        log(monitor, 3)
        with pytest.raises(InputError, match=match):
            log(monitor, step, seed=0)
        assert [s["step"] for s in stored(tmp_path)] == [3]
        log(monitor, np.int64(4))
        log(monitor, torch.tensor(5), seed=5)
    assert [s["step"] for s in stored(tmp_path)] == [3, 4, 5]


@pytest.mark.parametrize("changes, match", [
    ({"responses": np.zeros((16, 23), np.int64)}, "responses must be \\[16, 24\\]"),
    ({"responses": np.zeros((16, 24), np.float32)}, "integer token ids"),
    ({"prompts": np.zeros((15, 4), np.int64)}, "prompts has 15 rows"),
    ({"sampling": {"temperature": -1.0}}, "sampling.temperature must be"),
    ({"sampling": {"temprature": 1.0}}, r"unknown field\(s\) \['temprature'\]"),
    ({"sampling": 0.7}, "sampling must be a dict"),
    ({"meta": {"obj": object()}}, "cannot store object"),
    ({"meta": [1]}, "meta must be a dict"),
])
def test_bad_side_inputs_are_named_errors(tmp_path, changes, match):
    with parity.Monitor(tmp_path, advice_every=0, render_every=0) as monitor:
        with pytest.raises(InputError, match=match):
            log(monitor, 0, **changes)
        assert monitor.last_step is None and stored(tmp_path) == []


def test_log_after_close_is_refused(tmp_path):
    monitor = parity.Monitor(tmp_path, advice_every=0, render_every=0)
    monitor.close()
    monitor.close()
    with pytest.raises(ConfigError, match="closed"):
        log(monitor, 0)


# -- the store --------------------------------------------------------------------------------------


def test_the_store_itself_refuses_updates_deletes_and_old_steps(tmp_path):
    """Append-only is a property of the file (triggers), not only of this module's code."""
    with parity.Monitor(tmp_path, advice_every=0, render_every=0) as monitor:
        log(monitor, 0)
        log(monitor, 5)
    conn = sqlite3.connect(tmp_path / STORE_FILE)
    for sql in ("UPDATE steps SET record = '{}' WHERE step = 0", "DELETE FROM steps WHERE step = 5",
                "INSERT INTO steps (step, logged_at, record) VALUES (3, 0, '{}')"):
        with pytest.raises(sqlite3.IntegrityError, match=r"append-only|must increase"):
            conn.execute(sql)
    assert conn.execute("SELECT step FROM steps").fetchall() == [(0,), (5,)]
    conn.close()


def test_a_directory_continues_its_run(tmp_path):
    with parity.Monitor(tmp_path, advice_every=0, run_name="a", render_every=0) as monitor:
        log(monitor, 0)
    with parity.Monitor(tmp_path, advice_every=0, render_every=0) as monitor:
        assert monitor.run_name == "a" and monitor.last_step == 0
        with pytest.raises(InputError, match="after the last logged step 0"):
            log(monitor, 0)
        log(monitor, 1)
    with pytest.raises(ConfigError, match="holds run 'a'"):
        parity.Monitor(tmp_path, run_name="b")
    assert [s["step"] for s in stored(tmp_path)] == [0, 1]


_CHILD = textwrap.dedent("""
    import sys, time
    import numpy as np
    sys.path.insert(0, {tests!r})
    from test_monitor import log
    import parity
    monitor = parity.Monitor({out!r}, advice_every=0, render_every=0)
    for step in range(5):
        log(monitor, step)
    print("LOGGED", flush=True)
    def stall_in_commit(sql):
        if sql.strip().upper() == "COMMIT":
            print("IN-COMMIT", flush=True)
            time.sleep(600)
    monitor._store._conn.set_trace_callback(stall_in_commit)
    log(monitor, 5)
""")


@pytest.mark.slow
def test_killed_mid_step_the_store_reads_every_committed_step(tmp_path):
    """A training process SIGKILLed inside step 5's transaction: a reader that opened while it ran
    saw the committed steps, and afterwards the file reads whole, steps 0-4, and a new Monitor
    continues the run at step 5."""
    out = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-c", _CHILD.format(tests=str(ROOT / "tests"), out=str(out))],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert child.stdout.readline().strip() == "LOGGED"
        assert [s["step"] for s in stored(out)] == [0, 1, 2, 3, 4]  # the run is still going
        assert child.stdout.readline().strip() == "IN-COMMIT", child.stderr.read()
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert (out / f"{STORE_FILE}-wal").exists()  # the killed writer left its log: recovery has work to do
    steps = stored(out)
    assert [s["step"] for s in steps] == [0, 1, 2, 3, 4]
    assert all(tuple(s["summary"]) == SUMMARY_KEYS + SUPPORT_SUMMARY_KEYS for s in steps)
    conn = sqlite3.connect(out / STORE_FILE)
    assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    conn.close()
    assert monitor_main([str(out), "--json", str(tmp_path / "run.json")]) == 0
    assert [s["step"] for s in json.loads((tmp_path / "run.json").read_text())["steps"]] == [0, 1, 2, 3, 4]
    with parity.Monitor(out, advice_every=0, render_every=0) as monitor:
        log(monitor, 5)
    assert [s["step"] for s in stored(out)] == [0, 1, 2, 3, 4, 5]


# -- the page ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_page_shows_trends_the_latest_step_and_the_recommendation(tmp_path):
    with parity.Monitor(tmp_path, run_name="grpo-<b>", render_every=2) as monitor:
        for step in range(3):
            log(monitor, step)
    page = (tmp_path / "index.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "parity monitor: grpo-&lt;b&gt;" in page
    assert "3 steps (0–2)" in page and "Latest step: 2" in page
    assert page.count('alt="max_abs_logprob_diff over steps"') == 1 and 'alt="k3_kl over steps"' in page
    assert "Worst tokens" in page and "Recommended correction" in page and "rollout_correction:" in page
    assert "No alerts: no absolute thresholds set" in page


def test_drawing_runs_off_the_step_s_critical_path(tmp_path, monkeypatch):
    """`log` returns while the page is still being drawn (the drawing is blocked here)."""
    release, drawing = threading.Event(), threading.Event()
    real = page_module.write_page

    def slow_write(out_dir, path=None, **options):
        drawing.set()
        assert release.wait(30)
        return real(out_dir, path, **options)

    monkeypatch.setattr(page_module, "write_page", slow_write)
    monitor = parity.Monitor(tmp_path, advice_every=0, render_every=1, background="thread")
    try:
        assert drawing.wait(30)  # the first drawing started and is stuck
        for step in range(3):
            log(monitor, step)  # returns, drawing or not
        assert [s["step"] for s in stored(tmp_path)] == [0, 1, 2]
    finally:
        release.set()
        monitor.close()
    assert "Latest step: 2" in (tmp_path / "index.html").read_text()


def test_a_drawing_that_fails_loses_no_step(tmp_path, monkeypatch, caplog):
    def broken(run, steps, **options):
        raise RuntimeError("no fonts")

    monkeypatch.setattr(page_module, "monitor_html", broken)
    with caplog.at_level(logging.WARNING, logger="parity.monitor"), \
            parity.Monitor(tmp_path, advice_every=0, render_every=1, background="thread") as monitor:
        for step in range(3):
            log(monitor, step)
    assert [s["step"] for s in stored(tmp_path)] == [0, 1, 2]
    assert any("could not draw" in r.getMessage() and "no fonts" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    assert monitor_main([str(tmp_path)]) == 0  # the stored run draws once drawing works
    assert "Latest step: 2" in (tmp_path / "index.html").read_text()


# -- the command ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_parity_monitor_command(tmp_path, capsys):
    out = tmp_path / "run"
    # render_every=0: the command draws the page from the store; the monitor's own drawing (a child
    # process at start and close) is the page test's claim, not this one's
    with parity.Monitor(out, thresholds={"k3_kl": 1e-4}, advice_every=0, render_every=0) as monitor:
        for step in (0, 10):
            log(monitor, step)
    assert cli_main(["monitor", str(out), "--html", str(tmp_path / "p.html"),
                            "--json", str(tmp_path / "m.json")]) == 0
    text = capsys.readouterr().out
    assert text.startswith("run run: 2 steps (0-10), 2 alert(s)") and "latest step 10:" in text
    data = json.loads((tmp_path / "m.json").read_text())
    assert data["run_name"] == "run" and [s["step"] for s in data["steps"]] == [0, 10]
    assert set(data["steps"][0]) >= {"step", "summary", "rollout_corr", "by_position", "worst_tokens",
                                     "alerts"}
    assert flat_values(data["steps"][1])["k3_kl"] == data["steps"][1]["summary"]["k3_kl"]
    assert (tmp_path / "p.html").read_text().startswith("<!DOCTYPE html>")
    assert cli_main(["monitor", str(tmp_path / "nothing")]) == 2
    assert "no monitor.sqlite here" in capsys.readouterr().err


@pytest.mark.slow
def test_import_and_the_command_never_load_torch(tmp_path):
    out = tmp_path / "run"
    with parity.Monitor(out, advice_every=0, render_every=0) as monitor:
        log(monitor, 0)
    # one fresh interpreter for both: the imports, then the command; nothing heavy after either
    assert heavy_modules_after("import parity.monitor, parity.integrations.verl, parity.cli; "
                               f"parity.cli.main(['monitor', {str(out)!r}])") == []
    # negative control: the first log computes in torch, and the probe sees it
    code = textwrap.dedent(f"""
        import numpy as np, parity
        m = parity.Monitor({str(tmp_path / "b")!r}, advice_every=0, render_every=0)
        m.log(0, rollout_log_probs=np.full((1, 2), -1.0), old_log_probs=np.full((1, 2), -1.0),
              response_mask=np.ones((1, 2)))
        m.close()
    """)
    assert "torch" in heavy_modules_after(code)


def test_a_second_writer_is_refused_at_construction_naming_the_holder(tmp_path):
    """Two Monitors on one directory (two ranks by mistake): the second is refused when it is made,
    naming the holder's host and PID (before: both logged, the later one's steps half refused and
    the rest merged as one run); once the first closes, the directory can be written again."""
    with parity.Monitor(tmp_path, advice_every=0, render_every=0) as a:
        log(a, 0)
        holder = rf"another Monitor writes this directory \(host \S+ pid {os.getpid()} "
        with pytest.raises(ConfigError, match=holder):
            parity.Monitor(tmp_path, advice_every=0, render_every=0)
        log(a, 1)
    with parity.Monitor(tmp_path, advice_every=0, render_every=0) as b:
        log(b, 2)
    assert [s["step"] for s in stored(tmp_path)] == [0, 1, 2]
