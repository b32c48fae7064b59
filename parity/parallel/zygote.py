"""The zygote: one preloaded process per caller that forks its CPU rank processes.

A CPU rank started as a fresh interpreter spends ~4-5 CPU-s importing torch, transformers' modeling
code and parity's engine before it loads its shard. The zygote imports them once (`PRELOAD`) and
forks every rank from that state. A forked rank is the process it replaces: the zygote was started
with the caller's environment and working directory and is replaced when either changes (whatever
a module reads at import is what a fresh start reads); the rank gets the caller's current stdout and
stderr (passed as descriptors, so a redirect made after the zygote started still holds), /dev/null
as stdin, and the caller's environment. CUDA ranks keep fresh interpreters (`RankGroup`).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

from parity.core.errors import BackendError
from parity.parallel import rank
from parity.runtime import guard

#: what every rank imports before its factory runs (the ~4-5 CPU-s a fresh rank spends).
PRELOAD = ("torch", "torch.distributed", "parity.parallel.comm",
           "parity.engine.engine", "parity.engine.train")
#: variables that differ between otherwise equal calls and that nothing reads at import (pytest's
#: per-test marker): a change of them alone keeps the zygote.
VOLATILE = frozenset({"PYTEST_CURRENT_TEST"})
_HEADER = struct.Struct("!I")


def _send(sock: socket.socket, obj: Any, fds: list[int] | None = None) -> None:
    """One length-prefixed pickled message, with `fds` riding on its first bytes."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    socket.send_fds(sock, [_HEADER.pack(len(data))], fds or [])
    sock.sendall(data)


def _receive(sock: socket.socket) -> tuple[Any, list[int]]:
    """The next message and the descriptors sent with it; EOFError when the peer is gone."""
    header, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 2)
    while len(header) < _HEADER.size:  # a stream may split the header; the fds came with its start
        more = sock.recv(_HEADER.size - len(header))
        if not more:
            break
        header += more
    if len(header) < _HEADER.size:
        raise EOFError("the peer closed the connection")
    (size,) = _HEADER.unpack(header)
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError("the peer closed the connection")
        data += chunk
    return pickle.loads(data), fds


def _key() -> tuple[Any, ...]:
    """What a zygote must share with the caller for its forks to be the processes a fresh start makes."""
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k not in VOLATILE))
    return sys.executable, os.getcwd(), env


class ForkedRank:
    """A rank forked by the zygote, with the part of `subprocess.Popen` the launcher uses."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self._zygote, self.pid, self.returncode = zygote, pid, None

    def poll(self) -> int | None:
        try:
            return self.wait(0.0)
        except subprocess.TimeoutExpired:
            return None

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code (negative: the signal), once the rank is gone and reaped; None when the zygote
        is gone (its ranks are the guard's then). `subprocess.TimeoutExpired` after `timeout` s."""
        if self.returncode is None:
            code = self._zygote.wait(self.pid, timeout)
            if code == "running":
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout or 0.0)
            self.returncode = code
            self._zygote.reaped(self.pid)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


class Zygote:
    """The caller's handle on its zygote process (`zygote()` keeps one per process and key)."""

    def __init__(self) -> None:
        self.key, self.owner = _key(), os.getpid()
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen([sys.executable, "-m", "parity.parallel.zygote", str(theirs.fileno())],
                                      stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),), close_fds=True)
        theirs.close()
        guard.track(self._proc.pid)  # its ranks are its descendants: they die with the caller too
        self._sock, self._lock = ours, threading.Lock()
        self.running: set[int] = set()
        self.retired = False  # replaced by a zygote of another key: it closes once its ranks are gone
        self.broken = False  # an exchange was interrupted: its reply would answer the next request

    def alive(self) -> bool:
        return not self.broken and self._proc.poll() is None

    def _ask(self, message: tuple[Any, ...], fds: list[int] | None = None) -> Any:
        with self._lock:
            if self.broken:
                raise BackendError(f"parity's rank zygote (pid {self._proc.pid}) was interrupted in a "
                                   "request; a new one serves new groups")
            try:
                _send(self._sock, message, fds)
                return _receive(self._sock)[0]
            except (EOFError, OSError):
                code = self._proc.poll()
                raise BackendError(f"parity's rank zygote (pid {self._proc.pid}) is gone (exit code {code}); "
                                   "its output above says why") from None
            except BaseException:  # Ctrl-C between request and reply: the stream is out of step for good
                self.broken = True  # `zygote()` retires it (closing it kills the rank it may have forked)
                raise

    def spawn(self, index: int, env: dict[str, str]) -> ForkedRank:
        """Fork rank `index` with environment `env`, in the caller's working directory."""
        stdio = [fd if _is_open(fd) else os.open(os.devnull, os.O_WRONLY) for fd in (1, 2)]
        try:
            pid = self._ask(("spawn", index, env, os.getcwd()), stdio)
        finally:
            for fd in stdio:
                if fd not in (1, 2):
                    os.close(fd)
        self.running.add(pid)
        return ForkedRank(self, pid)

    def reaped(self, pid: int) -> None:
        self.running.discard(pid)
        if self.retired and not self.running:
            self.close()

    def wait(self, pid: int, timeout: float | None) -> int | str | None:
        try:
            return self._ask(("wait", pid, timeout))
        except BackendError:
            return None

    def close(self) -> None:
        """Stop the zygote (it kills any rank still running) and reap it. Idempotent."""
        if self._sock.fileno() == -1:
            return
        self._sock.close()
        try:
            self._proc.wait(10.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


_ZYGOTE: Zygote | None = None
_ZYGOTE_LOCK = threading.Lock()
#: every zygote this process started, retired ones included: closed at exit
_STARTED: list[Zygote] = []


def zygote() -> Zygote:
    """This process's zygote for its current environment and directory, started on first use (and
    again after a fork, a change of either, or its death)."""
    global _ZYGOTE
    with _ZYGOTE_LOCK:
        current = _ZYGOTE
        if current is None or current.owner != os.getpid() or current.key != _key() or not current.alive():
            if current is not None and current.owner == os.getpid():
                current.retired = True  # a live group of the old environment keeps its ranks
                if not current.running:
                    current.close()
            _STARTED[:] = [z for z in _STARTED if z.owner == os.getpid() and z.alive()]
            _ZYGOTE = Zygote()
            _STARTED.append(_ZYGOTE)
        return _ZYGOTE


def _close() -> None:
    global _ZYGOTE
    with _ZYGOTE_LOCK:
        for started in _STARTED:
            if started.owner == os.getpid():
                started.close()
        _STARTED.clear()
        _ZYGOTE = None


atexit.register(_close)  # closes only this process's zygotes (a forked child's list holds its parent's)


def _child(sock: socket.socket, rank_index: int, env: dict[str, str], cwd: str, stdio: list[int]) -> None:
    """The forked rank: the caller's stdio, directory and environment, then the rank's own main."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as a fresh interpreter starts
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        sock.close()
        for target, fd in zip((1, 2), stdio, strict=True):
            os.dup2(fd, target)
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        rank.main(rank_index)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reap(pid: int, timeout: float | None, codes: dict[int, int]) -> int | str:
    """The exit code of child `pid` once it is gone, or "running" after `timeout` s."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while pid not in codes:
        done, status = os.waitpid(pid, 0 if deadline is None else os.WNOHANG)
        if done:
            codes[pid] = os.waitstatus_to_exitcode(status)
        elif time.monotonic() >= deadline:  # type: ignore[operator]
            return "running"
        else:
            time.sleep(0.01)
    return codes[pid]


class _Terminated(Exception):
    """SIGTERM reached the zygote: it stops, and takes its ranks with it."""


def _terminated(signum: int, frame: Any) -> None:
    raise _Terminated


def main(argv: list[str]) -> int:
    """The zygote process: `python -m parity.parallel.zygote FD`, requests on the socket FD; on EOF
    or SIGTERM it SIGKILLs the ranks it forked that are still there, then exits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller stops its groups on Ctrl-C
    rank.set_environment()  # before torch.distributed loads, as in a fresh rank
    for module in PRELOAD:
        importlib.import_module(module)
    sock = socket.socket(fileno=int(argv[0]))
    children: set[int] = set()
    codes: dict[int, int] = {}
    signal.signal(signal.SIGTERM, _terminated)  # before: no rank yet, the default exit is right
    try:
        while True:
            try:
                message, fds = _receive(sock)
            except (EOFError, OSError):
                break
            if message[0] == "spawn":
                _, index, env, cwd = message
                # held from the fork until the child is in `children` (and in the child until it resets it)
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
                pid = os.fork()
                if pid == 0:
                    _child(sock, index, env, cwd, fds)
                children.add(pid)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
                for fd in fds:
                    os.close(fd)
                _send(sock, pid)
            else:
                _, pid, timeout = message
                _send(sock, _reap(pid, timeout, codes) if pid in children else None)
    except (_Terminated, OSError):  # SIGTERM, or the caller went while we replied
        pass
    finally:  # the caller is gone, closed us or SIGTERM came: no rank outlives us
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for pid in children - set(codes):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
