"""Processes parity starts die with it: the guard (parity.runtime.guard) and servers
(parity.runtime.processes).

Fast stand-ins for the engines (tests/data/processes): a fake parity process owning an "engine"
with a "worker" of its own, a "server" in its own session with a child in its group, and an
unrelated child. Killing the fake parity must take the first four down and leave the last one;
the unguarded run is the negative control (the same tree outlives its parent). The same is
checked with the real vLLM engine and server in tests/test_no_orphans.py.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from procs import alive

from parity.core.errors import BackendError
from parity.runtime.processes import LOOPBACK, ServerProcess, free_loopback_port

DATA = Path(__file__).parent / "data" / "processes"
ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
OWNED = ("engine", "worker", "server", "server_child")
#: the guard run as parity runs it: `python -P GUARD PARENT_PID`, commands on its stdin.
GUARD = ROOT / "parity" / "runtime" / "guard.py"


def wait_until(predicate, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def start_fake_parity(tmp_path, mode):
    out = tmp_path / "pids.json"
    proc = subprocess.Popen([sys.executable, str(DATA / "fake_parity.py"), mode, str(out)], env=ENV)
    assert wait_until(out.exists, 30), "the fake parity process did not start its children"
    time.sleep(0.2)  # the file is complete once written; give the guard a scan
    pids = json.loads(out.read_text())
    folder = Path(pids.pop("folder"))
    return proc, {name: psutil.Process(pid) for name, pid in pids.items() if pid is not None}, folder


def kill_all(procs):
    for p in procs.values():
        if alive(p):
            p.kill()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
@pytest.mark.slow
def test_owned_processes_die_with_parity(tmp_path, sig):
    parity, procs, folder = start_fake_parity(tmp_path, "guarded")
    try:
        assert all(alive(procs[name]) for name in OWNED) and folder.is_dir()
        parity.send_signal(sig)
        parity.wait(timeout=30)
        assert wait_until(lambda: not any(alive(procs[n]) for n in OWNED), 15), \
            {n: alive(procs[n]) for n in OWNED}
        assert alive(procs["unrelated"]), "the guard killed a process that was not parity's to clean up"
        assert wait_until(lambda: not alive(procs["guard"]), 10), "the guard did not exit"
        assert not folder.exists(), "the guard left the folder parity named"
    finally:
        kill_all(procs)


def test_negative_control_unguarded_children_outlive_parity(tmp_path):
    parity, procs, folder = start_fake_parity(tmp_path, "unguarded")
    try:
        parity.kill()
        parity.wait(timeout=30)
        time.sleep(3)
        assert all(alive(procs[name]) for name in OWNED), "without the guard the tree should be orphaned"
        assert folder.is_dir(), "without the guard the folder should be left"
    finally:
        kill_all(procs)
        shutil.rmtree(folder, ignore_errors=True)


def fake_server(mode, port):
    return ServerProcess([sys.executable, str(DATA / "fake_server.py"), str(port), mode], port=port,
                         name="fake server")


def tree(pid):
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def test_server_starts_on_loopback_and_stops_without_leftovers():
    port = free_loopback_port()
    server = fake_server("healthy", port)
    server.start(timeout_s=30)
    assert server.url == f"http://{LOOPBACK}:{port}"
    procs = tree(server.pid)
    assert len(procs) == 2 and all(alive(p) for p in procs)
    server.stop()
    assert not any(alive(p) for p in procs)
    server.stop()  # idempotent


@pytest.mark.parametrize("folder_env", [None, "TMPDIR"])
def test_a_server_pointed_at_its_folder_leaves_no_temporary_file(folder_env):
    """`folder_env`: the server's temporary files (SGLang's sockets) go with its folder at the stop;
    without it (the control) the file stays in the system's temporary folder."""
    port = free_loopback_port()
    argv = [sys.executable, str(DATA / "fake_server.py"), str(port), "healthy", "--temp-file"]
    server = ServerProcess(argv, port=port, name="fake server", folder_env=folder_env)
    server.start(timeout_s=30)
    made = Path(server.log_path.read_text().split("temp file ")[1].split()[0])
    server.stop()
    if folder_env:
        assert made.parent == server.log_path.parent and not made.parent.exists()
    else:
        assert made.is_file()
        made.unlink()


def test_failed_start_quotes_the_log_and_leaves_nothing():
    server = fake_server("crash", free_loopback_port())
    with pytest.raises(BackendError, match=r"(?s)exited with code 3.*fake server starting in mode crash"):
        server.start(timeout_s=30)
    assert server.pid is None


def test_start_timeout_stops_the_server():
    server = fake_server("silent", free_loopback_port())
    seen = []
    original = server._wait_healthy

    def remember_tree(timeout_s):
        time.sleep(1.5)
        seen.extend(tree(server.pid))
        original(timeout_s)

    server._wait_healthy = remember_tree
    with pytest.raises(BackendError, match="did not answer /health within 2 s; stopped it"):
        server.start(timeout_s=2)
    assert len(seen) == 2 and not any(alive(p) for p in seen)


def test_interrupt_during_start_stops_the_server(tmp_path):
    """Ctrl-C while parity waits for a server to come up: the server and its child are stopped."""
    port = free_loopback_port()
    script = (
        "import sys; from parity.runtime.processes import ServerProcess\n"
        f"s = ServerProcess([sys.executable, {str(DATA / 'fake_server.py')!r}, '{port}', 'silent'], "
        f"port={port}, name='fake server')\n"
        "try:\n    s.start(timeout_s=120)\n"
        "except KeyboardInterrupt:\n    print('interrupted; server stopped')\n")
    parity = subprocess.Popen([sys.executable, "-c", script], env=ENV, stdout=subprocess.PIPE, text=True)
    me = psutil.Process(parity.pid)

    def find_server():
        # the script's path as the first argument: a child forked but not yet exec'd (the guard's) has
        # the parent's command line, whose -c code names the script too
        for child in me.children():
            with contextlib.suppress(psutil.Error):
                if child.cmdline()[1:2] == [str(DATA / "fake_server.py")]:
                    return child
        return None

    assert wait_until(lambda: find_server() is not None, 30)
    server = find_server()
    assert wait_until(lambda: len(tree(server.pid)) == 2, 10)
    server_procs = tree(server.pid)
    parity.send_signal(signal.SIGINT)
    out, _ = parity.communicate(timeout=60)
    assert out.strip() == "interrupted; server stopped"
    assert not any(alive(p) for p in server_procs)


def test_guard_acts_on_what_parity_sent_even_if_parity_died_first(tmp_path):
    """parity can die before its guard has started: the guard still reads the pipe and cleans up."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    named, other = tmp_path / "named folder", tmp_path / "other"  # a space: the rest of the line is the path
    for folder in (named, other):
        (folder / "socket").mkdir(parents=True)
    done = subprocess.run([sys.executable, "-P", str(GUARD), str(dead.pid)],
                          input=f"track {sleeper.pid}\nremove {named}\n".encode(), timeout=60)
    assert done.returncode == 0
    assert wait_until(lambda: sleeper.poll() is not None, 10)
    assert not named.exists() and other.is_dir()


@pytest.mark.parametrize("closed", [True, False])
def test_a_child_started_after_the_window_is_not_the_guards(closed):
    """The guard reads its pipe late: a child parity starts after `close` but before the guard has
    read it is seen by the guard's window scans, and must not die with parity (the race that once
    killed the unrelated sleeper above). Unclosed (parity died inside its window), what the scans
    found dies."""
    me = psutil.Process()
    before = ",".join(str(c.pid) for c in me.children())
    guard = subprocess.Popen([sys.executable, "-P", str(GUARD), str(os.getpid())], stdin=subprocess.PIPE,
                             start_new_session=True)
    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    started = []
    try:
        guard.stdin.write(f"open {before}\n".encode())
        guard.stdin.flush()
        time.sleep(1.0)  # the guard has started and read `open`
        engine = subprocess.Popen(sleep)
        started.append(engine)
        later = subprocess.Popen(sleep)  # after the window in parity's time; the guard has not read `close`
        started.append(later)
        time.sleep(1.0)  # the guard's window scans see both
        if closed:
            guard.stdin.write(f"track {engine.pid}\nclose\n".encode())
        guard.stdin.close()  # parity is gone
        assert guard.wait(timeout=30) == 0
        assert engine.poll() is not None, "the window's own child outlived parity"
        assert (later.poll() is None) == closed
    finally:
        if not guard.stdin.closed:
            guard.stdin.close()
        guard.wait(timeout=30)
        for proc in started:
            proc.kill()
            proc.wait()
