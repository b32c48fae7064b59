"""The zygote that forks CPU ranks (`parity.parallel.zygote`): a forked rank is the process a fresh
start would make (the caller's current environment, directory and stdout/stderr), a change of the
environment starts a new zygote without touching a live group of the old one, and a caller killed
with SIGKILL leaves neither the zygote nor its ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from multiprocessing.connection import Listener

import psutil
import pytest
from procs import alive

from parity.parallel import RankGroup
from parity.parallel import zygote as zygote_module
from parity.parallel.group import ADDRESS_ENV
from parity.runtime.processes import free_loopback_port

pytestmark = pytest.mark.slow


def parents(group: RankGroup) -> set[int]:
    return {psutil.Process(pid).ppid() for pid in group.pids}


def test_ranks_are_forked_by_one_zygote_and_see_the_callers_directory(probe_path, tmp_path, monkeypatch):
    with RankGroup(2, "cpu", probe_path) as first:
        first_parents = parents(first)
    monkeypatch.chdir(tmp_path)
    with RankGroup(2, "cpu", probe_path) as second:
        assert second.call("cwd") == str(tmp_path)
        again = parents(second)
    assert len(first_parents) == 1 and first_parents != {os.getpid()}  # forked, not started here
    assert again != first_parents  # the directory changed: a new zygote


def test_a_changed_environment_starts_a_new_zygote_and_a_live_group_keeps_its_ranks(probe_path, monkeypatch):
    monkeypatch.setenv("PARITY_ZYGOTE_TEST", "one")
    old = RankGroup(2, "cpu", probe_path)
    try:
        monkeypatch.setenv("PARITY_ZYGOTE_TEST", "two")
        with RankGroup(2, "cpu", probe_path) as new:
            assert new.call("environ", "PARITY_ZYGOTE_TEST") == "two"
            assert parents(new) != parents(old)
        assert old.call("environ", "PARITY_ZYGOTE_TEST") == "one"  # still running: not killed by the switch
        assert old.call("gather") == [0, 1]
    finally:
        old.close()


def test_a_rank_writes_to_the_callers_current_stdout_and_stderr(probe_path, tmp_path) -> None:
    with RankGroup(2, "cpu", probe_path) as group:
        group.call("gather")  # the zygote is up, holding this process's stdout and stderr as they are now
    files = {fd: (tmp_path / f"fd{fd}").open("w") for fd in (1, 2)}
    saved = {fd: os.dup(fd) for fd in files}
    try:
        for fd, file in files.items():
            os.dup2(file.fileno(), fd)
        with RankGroup(2, "cpu", probe_path) as group:
            group.call("say", "later")
    finally:
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
            files[fd].close()
    assert (tmp_path / "fd1").read_text().split() == ["out", "later"]
    assert (tmp_path / "fd2").read_text().split() == ["err", "later"]


def test_a_caller_killed_with_sigkill_leaves_no_zygote_and_no_rank(probe_path, tmp_path) -> None:
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent("""
        import time
        from parallel_probe import Probe  # tests/ is on the PYTHONPATH (probe_path)
        from parity.parallel import RankGroup
        group = RankGroup(2, "cpu", Probe)
        print(*group.pids, flush=True)
        time.sleep(600)
    """))
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        ranks = [psutil.Process(int(pid)) for pid in caller.stdout.readline().split()]
        zygotes = {rank.parent() for rank in ranks}
        assert len(ranks) == 2 and len(zygotes) == 1
        caller.send_signal(signal.SIGKILL)
        caller.wait()
        deadline = time.monotonic() + 30
        left = [*ranks, *zygotes]
        while left and time.monotonic() < deadline:
            left = [p for p in left if alive(p)]
            time.sleep(0.1)
        assert not left, left
    finally:
        caller.kill()
        caller.wait()


def test_the_zygote_reports_a_ranks_exit_code_and_its_killing_signal(capfd) -> None:
    z = zygote_module.zygote()
    nobody = f"127.0.0.1:{free_loopback_port()}:00"  # nothing listens: the rank fails to connect
    assert z.spawn(0, {**os.environ, ADDRESS_ENV: nobody}).wait(60) == 1
    assert "ConnectionRefusedError" in capfd.readouterr().err
    key = b"k" * 32
    with Listener(("127.0.0.1", 0), authkey=key) as listener:
        host, port = listener.address
        rank = z.spawn(0, {**os.environ, ADDRESS_ENV: f"{host}:{port}:{key.hex()}"})
        with listener.accept():  # connected: it now waits for its group
            with pytest.raises(subprocess.TimeoutExpired):
                rank.wait(0.2)
            assert rank.poll() is None
            rank.kill()
            assert rank.wait(30) == -signal.SIGKILL
