"""Which process is running a run: an exclusive `flock` on `<history>.<run_id>.lock` for the run's
life (released by the kernel however the owner dies), holding pid and host for the refusal.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from pathlib import Path


class RunLock:
    """The claim of this process on run `run_id` of the history at `history`."""

    def __init__(self, history: str | os.PathLike[str], run_id: str) -> None:
        history = Path(history)
        self.path = history.with_name(f"{history.name}.{run_id}.lock")
        self._fd: int | None = None

    def acquire(self) -> bool:
        """Take the lock without waiting; False when another live process holds it."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            # the previous owner removes the file on release; if it did so between our open and
            # our lock, we hold a lock on a file nobody else can find: open the new one instead
            try:
                current = os.stat(self.path).st_ino
            except FileNotFoundError:
                current = None
            if current == os.fstat(fd).st_ino:
                os.ftruncate(fd, 0)
                os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
                self._fd = fd
                return True
            os.close(fd)

    def owner(self) -> str:
        """Who holds the lock, as its file says ("pid 123 on host"), for messages."""
        try:
            return self.path.read_text().strip() or "starting up"
        except OSError:
            return "unknown"

    def release(self) -> None:
        """Give the lock up and remove its file (removed first, while still held; see `acquire`)."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None
