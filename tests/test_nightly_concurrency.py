"""Concurrent nightlies on one history never merge: run ids are claimed atomically, and a run id a
live process owns is refused to every other process until that process ends (however it ends).
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from test_nightly_runner import install, write_cases

from parity.nightly import main, runner
from parity.nightly.history import History
from parity.nightly.lock import RunLock

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def test_two_connections_cannot_create_the_same_run(tmp_path):
    with History(tmp_path / "h.sqlite") as a, History(tmp_path / "h.sqlite") as b:
        assert a.create_run("r1", {"who": "a"}, {}) is True
        assert b.create_run("r1", {"who": "b"}, {}) is False
        assert b.require_run("r1", option="--run-id").config == {"who": "a"}


# Two nightlies whose clocks read the same second: each waits at `new_run_id` until both are
# there (so both pick the same time-based id at the same moment), then runs on the fakes.
SAME_SECOND = """
import sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
import test_nightly_runner as fakes
from parity.nightly import main, runner

barrier, me = Path(sys.argv[1]), sys.argv[2]

def same_second():
    (barrier / me).touch()
    deadline = time.monotonic() + 120
    while len(list(barrier.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    return "20250101-000000"

fakes.install(runner)
runner.new_run_id = same_second
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.slow
def test_two_nightlies_started_in_the_same_second_make_two_runs(tmp_path):
    cases = write_cases(tmp_path)
    script = tmp_path / "same_second.py"
    script.write_text(SAME_SECOND.format(tests=str(TESTS)))
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    out = tmp_path / "reports"
    args = ["--cases", str(cases / "alpha.toml"), "--backends", "reference,hf,vllm", "--out", str(out),
            "--no-progress"]
    procs = [subprocess.Popen([sys.executable, str(script), str(barrier), name, *args], env=ENV, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name in "ab"]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    with sqlite3.connect(out / "history.sqlite") as db:
        runs = [r[0] for r in db.execute("SELECT run_id FROM runs ORDER BY seq")]
        rows = db.execute("SELECT run_id, COUNT(*) FROM rows GROUP BY run_id ORDER BY run_id").fetchall()
    assert sorted(runs) == ["20250101-000000", "20250101-000000-2"]
    assert rows == [("20250101-000000", 3), ("20250101-000000-2", 3)]
    for run_id in runs:
        results = json.loads((out / run_id / "results.json").read_text())
        assert results["run_id"] == run_id and len(results["rows"]) == 3
    assert not list(out.glob("*.lock"))  # every claim was released


HOLDER = """
import sys, time
from parity.nightly.lock import RunLock
lock = RunLock(sys.argv[1], sys.argv[2])
assert lock.acquire()
print("holding", flush=True)
time.sleep(600)
"""


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    install(runner, patch=monkeypatch.setattr)
    return tmp_path, write_cases(tmp_path)


@pytest.mark.slow
def test_a_run_id_another_live_process_owns_is_refused_until_it_dies(workspace, capsys):
    root, cases = workspace
    out = root / "reports"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out / "history.sqlite"), "busy"], env=ENV,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        argv = ["--cases", str(cases / "alpha.toml"), "--backends", "hf", "--out", str(out), "--no-progress"]
        assert main([*argv, "--run-id", "busy"]) == 2
        err = capsys.readouterr().err
        assert f"--run-id 'busy' is being run by another process (pid {holder.pid}" in err
        assert main(["--resume", "busy", "--out", str(out)]) == 2  # no such run yet: refused either way
        assert main([*argv, "--run-id", "other"]) == 0  # other run ids are free
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    # the owner is gone (killed: it released nothing itself), so the id is free again
    assert main([*argv, "--run-id", "busy"]) == 0


def test_a_lock_is_exclusive_and_released(tmp_path):
    history = tmp_path / "h.sqlite"
    first, second = RunLock(history, "r"), RunLock(history, "r")
    assert first.acquire() and not second.acquire()
    assert f"pid {os.getpid()}" in second.owner()
    first.release()
    assert second.acquire()
    second.release()
    assert not list(tmp_path.iterdir())  # the lock file goes with its last owner
