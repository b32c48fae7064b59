"""The monitor in a real training run (issue 50) and its bad-input items (issue 53: 1, 2, 6).

Resume as attempts, a store safe where runs live (journal by filesystem, one writer, foreign
files untouched, rows that do not decode named), policy versions and the causes the advisor
names (each planted: stale weights, temperature, nucleus renormalization, off-by-one), the page's
step details, and parity's one rule for values that are not logprobs.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from test_monitor import log, step_arrays, stored

import parity
from parity.advisor import advise
from parity.core.errors import ConfigError, InputError
from parity.core.logprobs import NOT_LOGPROBS
from parity.integrations import verl
from parity.integrations.batches import StepBatch, dump_step
from parity.monitor import page as page_module
from parity.monitor import store as store_module
from parity.monitor.command import main as monitor_main
from parity.monitor.store import STORE_FILE
from parity.rollouts.dumps import check_logprobs

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("one_thread")


def quiet(out: Path, **options) -> parity.Monitor:
    return parity.Monitor(out, advice_every=0, render_every=0, **options)


# -- planted causes (token-level simulation: a vocabulary per position, tokens sampled by the rollout) --


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def planted(cause: str, seed: int = 0, batch: int = 64, width: int = 64, vocab: int = 200
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(trainer, rollout, mask) `[batch, width]` logprobs of tokens the rollout sampled, with one
    cause planted: "noise" (bf16-like numerical drift), "stale" (the rollout's logits are another
    checkpoint's), "temperature" (the rollout at T=0.7, the trainer at 1), "nucleus" (the rollout
    renormalized over top-p 0.9), "shift" (the rollout logprobs stored one position early)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0.0, 3.0, (batch, width, vocab))
    train = _log_softmax(z)
    roll = {"stale": lambda: _log_softmax(z + rng.normal(0.0, 0.5, z.shape)),
            "temperature": lambda: _log_softmax(z / 0.7)}.get(cause, lambda: train)()
    if cause == "nucleus":
        p = np.exp(train)
        order = np.argsort(-p, -1)
        sorted_p = np.take_along_axis(p, order, -1)
        keep = np.zeros(p.shape, bool)
        np.put_along_axis(keep, order, np.cumsum(sorted_p, -1) - sorted_p < 0.9, -1)
        roll = np.where(keep, train - np.log((p * keep).sum(-1, keepdims=True)), -np.inf)
    u = rng.random((batch, width, 1))
    tokens = (np.cumsum(np.exp(roll), -1) < u).sum(-1).clip(0, vocab - 1)[..., None]
    t = np.take_along_axis(train, tokens, -1)[..., 0]
    r = np.take_along_axis(roll, tokens, -1)[..., 0]
    if cause == "noise":
        r = t + rng.normal(0.0, 0.02, t.shape)
    if cause == "shift":
        r = np.concatenate([r[:, 1:], r[:, -1:]], 1)
    return t.astype(np.float32), np.minimum(r, 0.0).astype(np.float32), np.ones(t.shape, bool)


@pytest.mark.parametrize("cause,named,absent", [
    ("stale", "weights are not the trainer's", "renormalized"),
    ("temperature", "temperature", "renormalized"),
    ("nucleus", "renormalized over a top-p/top-k nucleus", "weights"),
    ("shift", "shifted by one token", "renormalized"),
])
def test_each_planted_cause_is_named_by_its_own_signature(cause, named, absent):
    """Before: stale weights were called "one side looks renormalized over a top-p/top-k nucleus"
    (one-sidedness alone was the test). Each cause now gets its own name, none another's."""
    advice = advise(*planted(cause), bootstrap=0)
    assert advice.data_bugs and named in advice.data_bugs[0] and absent not in " ".join(advice.data_bugs)
    assert advice.config.rollout_is is None and advice.config.rollout_rs is None
    assert advice.name == ("none (weight mismatch)" if cause == "stale" else "none (data bug)")


def test_numerical_drift_is_no_cause_and_a_declared_lag_is_corrected_not_named():
    assert advise(*planted("noise"), bootstrap=0).data_bugs == ()  # the control: drift is advised on
    lagged = advise(*planted("stale"), bootstrap=0, policy_lag=1)
    assert lagged.data_bugs == () and lagged.name != "none (weight mismatch)"
    synced = advise(*planted("stale"), bootstrap=0, policy_lag=0)
    assert "weight-sync bug" in synced.data_bugs[0]


# -- policy versions and jumps in a run --------------------------------------------------------------


def grpo_run(out: Path, *, stale=(12, 13, 14), versions: str = "none", steps: int = 20) -> list[dict]:
    """A 20-step run whose weight sync is skipped at `stale`; versions "none", "synced" (both sides
    claim the same version), or "lagged" (the stale steps declare lag 1)."""
    records = []
    with parity.Monitor(out, render_every=0) as monitor:
        for step in range(steps):
            train, roll, mask = planted("stale" if step in stale else "noise", seed=step, batch=32, width=32)
            policy = {}
            if versions != "none":
                lag = 1 if versions == "lagged" and step in stale else 0
                policy = {"policy_version": step, "rollout_policy_version": step - lag}
            records.append(monitor.log(step, rollout_log_probs=roll, old_log_probs=train, response_mask=mask,
                                       **policy))
    return records


def test_stale_steps_alert_by_default_and_are_named_weights_not_renormalization(tmp_path):
    """Default relative bounds (no thresholds given) flag exactly the stale steps; the alert and the
    step's recommendation say the weights are not the trainer's, never "renormalized"."""
    grpo_run(tmp_path)
    records = stored(tmp_path)  # with the recommendations the background advisor added
    flagged = [r["step"] for r in records if r["alerts"]]
    assert flagged == [12, 13, 14]
    for r in records[12:15]:
        text = " ".join(a["message"] for a in r["alerts"]) + r["recommendation"]["reason"]
        assert "weights are not the trainer's" in text and "renormalized" not in text
        assert r["recommendation"]["name"] == "none (weight mismatch)"


def test_policy_versions_tell_intended_lag_from_a_sync_bug(tmp_path):
    synced = grpo_run(tmp_path / "synced", versions="synced")
    assert all("weight-sync bug" in a["message"] for r in synced[12:15] for a in r["alerts"])
    assert synced[12]["policy"] == {"trainer": 12, "rollout": 12, "lag": 0}
    grpo_run(tmp_path / "lagged", versions="lagged")
    lagged = stored(tmp_path / "lagged")
    assert all("declared policy lag 1" in a["message"] for r in lagged[12:15] for a in r["alerts"])
    assert lagged[12]["recommendation"]["name"] != "none (weight mismatch)"  # corrected, as intended
    with quiet(tmp_path / "bad") as monitor, pytest.raises(InputError, match="newer than the trainer's"):
        log(monitor, 0, policy_version=3, rollout_policy_version=4)


# -- resume ------------------------------------------------------------------------------------------


def test_a_resumed_run_starts_a_new_attempt_never_an_exception(tmp_path, caplog, capsys):
    """verl resumes `global_steps` from its checkpoint: steps at or below the stored ones. Before:
    InputError into `fit`. Now a warning and attempt 1, superseding the stored steps from its first
    on; the store keeps both attempts, the page and `parity monitor` show the restart."""
    with quiet(tmp_path, resume=True) as monitor:
        for step in range(6):
            log(monitor, step)
    with caplog.at_level(logging.WARNING, logger="parity.monitor"), quiet(tmp_path, resume=True) as monitor:
        for step in (3, 4):
            assert log(monitor, step, seed=100 + step)["attempt"] == 1
        assert monitor.attempt == 1 and monitor.last_step == 4
    assert any("resumed" in r.getMessage() and "attempt 1" in r.getMessage() for r in caplog.records)
    steps = stored(tmp_path)
    assert [(s["step"], s["attempt"]) for s in steps] == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 1)]
    assert steps[3]["restart"] == {"attempt": 1, "superseded": 3}
    store = store_module.MonitorStore.open(tmp_path)
    assert len(store.steps(every_attempt=True)) == 8
    store.close()
    assert monitor_main([str(tmp_path)]) == 0
    assert "step 3: the run was resumed (attempt 1, superseding 3 stored step(s))" in capsys.readouterr().out
    assert "Restarts" in (tmp_path / "index.html").read_text()
    # the control: without resume=True a step going back is refused (two runs are never merged silently)
    with quiet(tmp_path) as monitor, pytest.raises(InputError, match="resume=True"):
        log(monitor, 2)


# -- the store where runs live -----------------------------------------------------------------------


def test_the_journal_follows_the_filesystem(tmp_path, monkeypatch):
    """WAL is unsafe on NFS/Lustre: there the rollback journal is used (the file header says which:
    byte 18 is 2 for WAL, 1 for a rollback journal)."""
    monkeypatch.setattr(store_module, "filesystem_type", lambda path: "nfs4")
    with quiet(tmp_path / "nfs") as monitor:
        log(monitor, 0)
        assert not (tmp_path / "nfs" / f"{STORE_FILE}-wal").exists()
    assert (tmp_path / "nfs" / STORE_FILE).read_bytes()[18] == 1
    monkeypatch.setattr(store_module, "filesystem_type", lambda path: "ext4")  # the control
    with quiet(tmp_path / "local") as monitor:
        log(monitor, 0)
    assert (tmp_path / "local" / STORE_FILE).read_bytes()[18] == 2
    with quiet(tmp_path / "forced", journal="delete") as monitor:
        log(monitor, 0)
    assert (tmp_path / "forced" / STORE_FILE).read_bytes()[18] == 1
    with pytest.raises(ConfigError, match="journal must be one of"):
        quiet(tmp_path / "x", journal="memory")


def test_another_program_s_sqlite_file_is_refused_and_left_as_it_was(tmp_path):
    path = tmp_path / STORE_FILE
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE notes (text TEXT)")
    conn.execute("INSERT INTO notes VALUES ('mine')")
    conn.commit()
    conn.close()
    before = path.read_bytes()
    with pytest.raises(InputError, match="not a parity monitor store"):
        quiet(tmp_path)
    with pytest.raises(InputError, match="not a parity monitor store"):
        monitor_main([str(tmp_path)]) and stored(tmp_path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "monitor.lock", STORE_FILE]
    (tmp_path / "text" / STORE_FILE).parent.mkdir()
    (tmp_path / "text" / STORE_FILE).write_text("hello")
    with pytest.raises(InputError, match="not an SQLite file"):
        quiet(tmp_path / "text")


_HOLDER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    import parity
    monitor = parity.Monitor({out!r}, advice_every=0, render_every=0)
    print("HOLDING", flush=True)
    time.sleep(120)
""")


def test_a_second_process_on_the_directory_is_refused_naming_the_holder(tmp_path):
    code = _HOLDER.format(tests=str(ROOT / "tests"), out=str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", code],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert child.stdout.readline().strip() == "HOLDING", child.stderr.read()
        holder = rf"another Monitor writes this directory \(host \S+ pid {child.pid} "
        with pytest.raises(ConfigError, match=holder):
            quiet(tmp_path)
    finally:
        child.kill()
        child.wait()
    with quiet(tmp_path) as monitor:  # the control: once the holder is gone, the directory is writable
        log(monitor, 0)


def test_a_row_that_does_not_decode_is_named_and_the_rest_shown(tmp_path, capsys):
    with quiet(tmp_path) as monitor:
        for step in range(3):
            log(monitor, step)
    conn = sqlite3.connect(tmp_path / STORE_FILE)
    conn.execute("INSERT INTO steps (attempt, step, logged_at, record) VALUES (0, 3, 0, '{\"summ')")
    conn.commit()
    conn.close()
    steps = stored(tmp_path)
    assert [s["step"] for s in steps] == [0, 1, 2, 3] and "undecodable" in steps[3]
    assert monitor_main([str(tmp_path), "--html", str(tmp_path / "p.html")]) == 0
    out = capsys.readouterr().out
    assert "unreadable:" in out and "step 3 (attempt 0) does not decode" in out and "latest step 2:" in out
    page = (tmp_path / "p.html").read_text()
    assert "Unreadable steps" in page and "Latest step: 2" in page


@pytest.mark.slow
def test_readers_change_nothing_in_the_directory(tmp_path):
    """A reader opens the store read-only (SQLite may add its WAL index beside it: its own file)."""
    with parity.Monitor(tmp_path, advice_every=0) as monitor:
        log(monitor, 0)
    files = (STORE_FILE, "monitor.lock", "index.html")
    before = {name: (tmp_path / name).read_bytes() for name in files}
    assert monitor_main([str(tmp_path), "--html", str(tmp_path.parent / f"{tmp_path.name}.html")]) == 0
    assert {name: (tmp_path / name).read_bytes() for name in files} == before


@pytest.mark.parametrize("name", ["exp%31", "a#b", "q?x=1", "with space", "naïve-ü"])
@pytest.mark.slow
def test_any_directory_name_opens_its_own_store(tmp_path, name, capsys):
    """53.2: the URI was built unquoted: `exp%31` opened exp1's store, `#`/`?` cut the path."""
    with quiet(tmp_path / "exp1", run_name="the-other-run") as monitor:
        log(monitor, 7)
    with quiet(tmp_path / name, run_name="this-run") as monitor:
        log(monitor, 1)
    assert monitor_main([str(tmp_path / name)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("run this-run: 1 steps (1-1)")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({"exp1", name})  # no stray file beside


# -- the page ----------------------------------------------------------------------------------------


class Tokenizer:
    def decode(self, ids):
        return "".join(f"<t{i}>" for i in ids)


@pytest.mark.slow
def test_the_page_details_the_worst_steps_with_uid_and_text(tmp_path, capsys):
    rollout, trainer, mask, responses = step_arrays(0)
    uids = [f"group-{r // 4}" for r in range(rollout.shape[0])]
    with parity.Monitor(tmp_path, render_every=1, advice_every=0, tokenizer=Tokenizer()) as monitor:
        for step in range(6):
            drift = 3.0 if step == 2 else 0.05
            train, roll, m, ids = step_arrays(step, drift=drift)
            record = monitor.log(step, rollout_log_probs=roll, old_log_probs=train, response_mask=m,
                                 responses=ids, uids=uids)
    worst = record["worst_tokens"][0]
    assert worst["uid"] == uids[worst["row"]] and worst["text"] == f"<t{worst['token_id']}>"
    page = (tmp_path / "index.html").read_text()
    assert 'id="step-5"' in page and 'id="step-2"' in page  # the latest and the spike
    assert "group-" in page and "&#x27;&lt;t" in page
    assert monitor_main([str(tmp_path), "--step", "4", "--html", str(tmp_path / "s.html")]) == 0
    detailed = (tmp_path / "s.html").read_text()
    assert 'id="step-4"' in detailed and 'id="step-2"' not in detailed
    assert monitor_main([str(tmp_path), "--step", "99"]) == 2
    assert "--step 99: the run has no such step" in capsys.readouterr().err
    del rollout, trainer, mask, responses


@pytest.mark.slow
def test_log_scale_reaches_every_trend_chart(tmp_path, monkeypatch):
    seen = []
    real = page_module.step_trend_figure

    def spy(*args, **kwargs):
        seen.append(kwargs["log_scale"])
        return real(*args, **kwargs)

    monkeypatch.setattr(page_module, "step_trend_figure", spy)
    with quiet(tmp_path) as monitor:  # render_every=0: every drawing below is in this process
        log(monitor, 0)
        log(monitor, 1)
    page_module.write_page(tmp_path, log_scale=True)
    assert seen and all(seen)
    seen.clear()
    page_module.write_page(tmp_path)
    assert seen and not any(seen)


# -- 53.1: not logprobs ------------------------------------------------------------------------------


@pytest.mark.parametrize("transform", [np.exp, lambda x: -x, lambda x: x + 5.0],
                         ids=["probabilities", "sign-flipped", "logits"])
def test_values_that_are_not_logprobs_are_refused_everywhere(tmp_path, transform):
    """Before: `rollout_log_probs=np.exp(r)` stored k3 3.8e-4 and recommended a correction."""
    rollout, trainer, mask, responses = step_arrays(0)
    rollout = np.where(mask, rollout, 0.0).astype(np.float32)
    wrong = np.where(mask, transform(rollout), 0.0).astype(np.float32)
    with quiet(tmp_path / "m") as monitor:
        with pytest.raises(InputError, match=NOT_LOGPROBS.split(" (")[0].replace("/", ".")):
            monitor.log(0, rollout_log_probs=wrong, old_log_probs=trainer, response_mask=mask)
        assert monitor.last_step is None
        monitor.log(0, rollout_log_probs=rollout, old_log_probs=trainer, response_mask=mask)  # the control
    batch = StepBatch(rollout=wrong, trainer=trainer, mask=mask, lengths=mask.sum(1), responses=responses,
                      prompts=[np.array([1, 2])] * len(mask), sampling={"temperature": 1.0})
    with pytest.raises(InputError, match="looks like probabilities/logits"):
        dump_step(batch, tmp_path / "d.jsonl")
    with pytest.raises(InputError, match="looks like probabilities/logits"):
        check_logprobs([float(v) for v in wrong[0][mask[0]]])


def test_padding_may_hold_anything(tmp_path):
    rollout, trainer, mask, _ = step_arrays(0)
    clean = quiet(tmp_path / "a")
    reference = clean.log(0, rollout_log_probs=rollout, old_log_probs=trainer, response_mask=mask)
    clean.close()
    dirty_r, dirty_t = rollout.copy(), trainer.copy()
    dirty_r[~mask], dirty_t[~mask] = np.nan, 7.0  # 53.6: NaN at padding refused the whole step
    with quiet(tmp_path / "b") as monitor:
        record = monitor.log(0, rollout_log_probs=dirty_r, old_log_probs=dirty_t, response_mask=mask)
        assert record["summary"] == reference["summary"]
        counted = trainer.copy()
        counted[0, 0] = np.nan
        with pytest.raises(InputError, match=r"old_log_probs\[0, 0\] is nan at a counted token"):
            monitor.log(1, rollout_log_probs=rollout, old_log_probs=counted, response_mask=mask)


# -- 53.6: the rest ----------------------------------------------------------------------------------


def test_steps_meta_scalars_and_escape_sequences(tmp_path, capsys):
    with quiet(tmp_path, run_name="run\x1b[2J\x1b[31m") as monitor:
        with pytest.raises(InputError, match=r"< 2\*\*63"):
            log(monitor, 2**63)
        record = log(monitor, 0, meta={"lr": np.float32(0.5), "tokens": np.int64(7), "ok": np.bool_(True)})
        assert record["meta"] == {"lr": 0.5, "tokens": 7, "ok": True}
        log(monitor, 2**63 - 1)
    assert stored(tmp_path)[0]["meta"] == {"lr": 0.5, "tokens": 7, "ok": True}
    assert monitor_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "run\\x1b[2J\\x1b[31m" in out


def test_a_closed_pipe_ends_parity_monitor_quietly(tmp_path):
    """`parity monitor DIR | head`: exit 141, no traceback. The run's name is longer than a pipe
    buffers, so the closed pipe is certain to be hit at the first line."""
    with quiet(tmp_path, run_name="r" * 200_000) as monitor:
        log(monitor, 0)
    argv = [str(tmp_path), "--html", str(tmp_path / "p.html")]
    child = f"import sys; from parity.monitor.command import main; sys.exit(main({argv!r}))"
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141 and "BrokenPipeError" not in err and "Traceback" not in err, err


# -- the verl helper ---------------------------------------------------------------------------------


class TensorDictLike(dict):
    def __contains__(self, key):
        raise NotImplementedError("TensorDict does not support `in`")


@dataclass
class DataProtoLike:
    batch: TensorDictLike
    meta_info: dict = field(default_factory=dict)
    non_tensor_batch: dict = field(default_factory=dict)


def test_verl_log_batch_resumes_and_passes_policy_versions_and_uids(tmp_path):
    rollout, trainer, mask, responses = step_arrays(0)
    uid = np.array([f"u{r // 2}" for r in range(len(mask))], dtype=object)
    batch = DataProtoLike(TensorDictLike(rollout_log_probs=rollout, old_log_probs=trainer, response_mask=mask,
                                         responses=responses), {"temperature": 1.0}, {"uid": uid})
    with quiet(tmp_path, resume=True) as monitor:
        for step in (1, 2, 3):
            verl.log_batch(monitor, step, batch, policy_version=step, rollout_policy_version=step)
    with quiet(tmp_path, resume=True) as monitor:  # verl resumed from the step-1 checkpoint
        record = verl.log_batch(monitor, 2, batch, policy_version=2, rollout_policy_version=2)
    assert record["attempt"] == 1 and record["policy"] == {"trainer": 2, "rollout": 2, "lag": 0}
    assert record["worst_tokens"][0]["uid"] == str(uid[record["worst_tokens"][0]["row"]])


def test_a_store_on_a_read_only_mount_reads(tmp_path):
    """The run's directory bind-mounted read-only (a private mount namespace: `unshare -m`, skipped
    where it is not permitted): `parity monitor` still reads every step (a WAL store's reader cannot
    make its shared-memory file there: it opens the file immutable)."""
    out = tmp_path / "run"
    with quiet(out) as monitor:
        log(monitor, 0)
        log(monitor, 1)
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here ({probe.stderr.decode().strip()})")
    read = (f"from parity.cli import main; raise SystemExit(main(['monitor', {str(out)!r}, '--html', "
            f"{str(tmp_path / 'p.html')!r}]))")
    script = (f"mount --bind {out} {out} && mount -o remount,bind,ro {out} && "
              f"! touch {out}/probe 2>/dev/null && {sys.executable} -c \"{read}\"")
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, check=False,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("run run: 2 steps (0-1)")
