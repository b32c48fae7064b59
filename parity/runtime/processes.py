"""A rollout server that parity starts: a free loopback port, a health wait, and a stop that leaves
no process behind. Its own process group (Ctrl-C reaches parity, which stops it in order), the
guard's tracking, a log quoted on a failed start, 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx
import psutil

from parity.core.errors import BackendError
from parity.runtime import guard

LOOPBACK = "127.0.0.1"
#: seconds between health probes while a server starts.
HEALTH_POLL_S = 0.5
#: lines of the server log quoted when it fails.
LOG_TAIL_LINES = 30


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """One server process parity launched, reachable at `url`; `argv` must bind `LOOPBACK` and `port`,
    `health_path` answers 200 once it can serve. Its log lies in a folder of its own, removed when it
    stops (by the guard, should parity die first); `folder_env` names a variable that points the server
    there for its temporary files too (socket files it would leave in /tmp).
    """

    def __init__(self, argv: Sequence[str], *, port: int, name: str, env: Mapping[str, str] | None = None,
                 health_path: str = "/health", folder_env: str | None = None) -> None:
        self.argv = tuple(argv)
        self.port = port
        self.name = name
        self.health_path = health_path
        self._dir = guard.owned_folder("parity-server-")
        self.env = {**(env or {}), **({folder_env: self._dir.name} if folder_env else {})}
        self.log_path = Path(self._dir.name) / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self, timeout_s: float) -> None:
        """Launch and wait for `health_path`; on any failure or interrupt the server is stopped first, and a
        failed start is a BackendError quoting the log.
        """
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                                          start_new_session=True, close_fds=True)
        guard.track(self._proc.pid)
        try:
            self._wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        other = ""  # set once a process not ours answered on the port
        with httpx.Client(trust_env=False, timeout=2.0) as client:
            while True:
                reason = self.exit_reason()
                if reason is not None:
                    raise BackendError(f"{self.name} failed to start: {reason}{other}\n{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.url + self.health_path).status_code == 200:
                        # the port was free when picked, but another server may have taken it since:
                        # its answers are not this server's
                        if self._listens() is not False:
                            return
                        other = (f"; another process (not {self.name}) answers on port {self.port}, "
                                 "which it took after parity picked it: start again")
                if time.monotonic() > deadline:
                    raise BackendError(f"{self.name} did not answer {self.health_path} within "
                                       f"{timeout_s:.0f} s{other}; stopped it. Last log lines:\n"
                                       f"{self.log_tail()}")
                time.sleep(HEALTH_POLL_S)

    def _listens(self) -> bool | None:
        """Whether the server or a descendant listens on `port`; None when the system does not say."""
        if self._proc is None:
            return False
        try:
            root = psutil.Process(self._proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return False
        for proc in procs:
            try:
                sockets = (getattr(proc, "net_connections", None) or proc.connections)(kind="tcp")
            except psutil.AccessDenied:
                return None
            except psutil.Error:
                continue
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == self.port for c in sockets):
                return True
        return False

    def exit_reason(self) -> str | None:
        """None while the server process runs, else how it ended (for error messages)."""
        if self._proc is None:
            return "not started"
        code = self._proc.poll()
        if code is None:
            return None
        if code < 0:
            return f"process {self._proc.pid} was killed by {signal.Signals(-code).name}"
        return f"process {self._proc.pid} exited with code {code}"

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last `lines` lines of the server's output."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after `grace_s`; idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(psutil.Error):
                tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
                guard.terminate(tree, grace_s)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self._dir.cleanup()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
