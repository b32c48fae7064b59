"""The guard: engine processes that parity starts die with the parity process that started them.

After SIGKILL vLLM's EngineCore and workers were measured alive 30 s later, and
`PR_SET_PDEATHSIG` is neither inherited across fork nor tied to the process. So the first engine
start launches one guard process per parity process, holding a pipe only parity writes: at EOF
(or a dead parent pid) it SIGTERMs every tracked process and group (`track PID`, and children
appearing between `open` and `close`, with descendants), waits `GRACE_S`, then SIGKILLs, and
removes the folders parity named (`remove PATH`: its engines' socket files) if they are still there.
Children the guard finds by scanning an open window count only until `close`: the guard reads the
pipe late, and a child parity starts after its `close` is not the window's (parity names the
window's own children before closing it). Processes are keyed by (pid, start time); the guard runs
with only stdlib and psutil (~0.1 s).
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

#: seconds between checks for new children while an engine start window is open.
WINDOW_SCAN_S = 0.25
#: seconds between checks that parity is alive when no window is open (a pipe EOF is immediate).
IDLE_CHECK_S = 1.0
#: seconds tracked processes get to exit after SIGTERM before SIGKILL.
GRACE_S = 5.0


class Guard:
    """Parity's handle on its guard process (one per parity process; see `guard`)."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        # -P: do not put parity/ on sys.path (parity/core/types.py would shadow the standard library)
        self._proc = subprocess.Popen(
            [sys.executable, "-P", str(Path(__file__).resolve()), str(self.owner)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        self._lock = threading.Lock()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc.poll() is None

    def send(self, line: str) -> None:
        with self._lock:
            assert self._proc.stdin is not None
            self._proc.stdin.write(f"{line}\n".encode())
            self._proc.stdin.flush()


_GUARD: Guard | None = None
_GUARD_LOCK = threading.Lock()


def guard() -> Guard:
    """This process's guard, started on first use (again after a fork, or if it was killed)."""
    global _GUARD
    with _GUARD_LOCK:
        if _GUARD is None or _GUARD.owner != os.getpid() or not _GUARD.alive():
            _GUARD = Guard()
        return _GUARD


def track(pid: int) -> None:
    """Make process `pid` and its descendants die with this process."""
    guard().send(f"track {int(pid)}")


def remove_with_owner(path: str) -> None:
    """Remove folder `path` once this process is gone, should it not have done so itself (SIGKILL)."""
    guard().send(f"remove {path}")


def owned_folder(prefix: str) -> tempfile.TemporaryDirectory[str]:
    """A temporary folder that goes with its `cleanup()`, or with this process should it die first."""
    folder = tempfile.TemporaryDirectory(prefix=prefix)
    remove_with_owner(folder.name)
    return folder


@contextlib.contextmanager
def spawn_window() -> Iterator[None]:
    """Every child this process starts inside the block (vLLM's EngineCore) dies with it."""
    g = guard()
    me = psutil.Process()
    before = {c.pid for c in me.children()}
    g.send(f"open {','.join(map(str, sorted(before)))}")
    try:
        yield
    finally:
        if g.alive():
            # named explicitly as well: the guard's own scan of our children cannot run once we are gone
            for child in me.children():
                if child.pid not in before and child.pid != g.pid:
                    g.send(f"track {child.pid}")
            g.send("close")


def _watch(parent_pid: int, fd: int) -> tuple[list[psutil.Process], list[str]]:
    """Follow the parent until it is gone; return the tracked processes and the folders to remove."""
    try:
        parent: psutil.Process | None = psutil.Process(parent_pid)
    except psutil.NoSuchProcess:  # gone before we started: still act on what it sent
        parent = None
    me = os.getpid()
    tracked: dict[int, psutil.Process] = {}
    found: dict[int, psutil.Process] = {}  # the parent's children seen in an open window
    folders: list[str] = []
    windows = 0
    before: set[int] = set()

    def adopt(proc: psutil.Process, into: dict[int, psutil.Process]) -> None:
        if proc.pid not in (me, parent_pid):
            into.setdefault(proc.pid, proc)

    def scan() -> None:
        if windows and parent is not None:
            with contextlib.suppress(psutil.Error):
                for child in parent.children():
                    if child.pid not in before:
                        adopt(child, found)
        for procs in (tracked, found):
            for proc in list(procs.values()):
                try:
                    for child in proc.children(recursive=True):
                        adopt(child, procs)
                except psutil.Error:
                    procs.pop(proc.pid, None)

    def handle(line: bytes) -> None:
        nonlocal windows, before
        command, _, arg = line.decode().partition(" ")
        if command == "open":
            if windows == 0:
                before = {int(pid) for pid in arg.split(",") if pid}
            windows += 1
        elif command == "close":
            windows = max(windows - 1, 0)
            if windows == 0:  # parity has named the window's children: what else was found is not its
                found.clear()
        elif command == "track":
            with contextlib.suppress(psutil.Error, ValueError):
                adopt(psutil.Process(int(arg)), tracked)
        elif command == "remove":
            folders.append(arg)

    buffer = b""
    while True:
        gone = parent is None or not _alive(parent)
        # once the parent is gone, only read what it already sent (a fork of it may hold the pipe)
        ready, _, _ = select.select([fd], [], [], 0 if gone else WINDOW_SCAN_S if windows else IDLE_CHECK_S)
        chunk = os.read(fd, 4096) if ready else b""
        *lines, buffer = (buffer + chunk).split(b"\n")
        for line in lines:
            handle(line)
        if not chunk and (ready or gone):
            break
        if windows:
            scan()
    scan()
    return list({**found, **tracked}.values()), folders


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def terminate(procs: list[psutil.Process], grace_s: float = GRACE_S) -> None:
    """SIGTERM `procs` and the groups they lead, SIGKILL what is left after `grace_s`."""
    own_groups = {os.getpgid(0)}
    groups = set()
    for proc in procs:
        with contextlib.suppress(OSError, psutil.Error):
            if _alive(proc) and os.getpgid(proc.pid) == proc.pid and proc.pid not in own_groups:
                groups.add(proc.pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pgid in groups:
            with contextlib.suppress(OSError):
                os.killpg(pgid, sig)
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                if _alive(proc):
                    proc.send_signal(sig)
        deadline = time.monotonic() + grace_s
        while any(_alive(p) for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        procs = [p for p in procs if _alive(p)]
        if not procs:
            return


def main(argv: list[str]) -> int:
    """The guard process: `python -P parity/runtime/guard.py PARENT_PID`, commands on stdin."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C; the guard outlives it
    procs, folders = _watch(int(argv[0]), sys.stdin.fileno())
    terminate(procs)
    for folder in folders:  # after the processes that wrote there
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
