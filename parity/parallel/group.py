"""The launcher: k rank processes in one torch.distributed group, driven from the calling process.

`RankGroup(size, device_type, factory)` starts its rank processes (CPU on Linux: forked by the
caller's zygote, `parity.parallel.zygote`; else fresh `python -m parity.parallel.rank`; gloo or NCCL
over loopback, rank 0 serving the rendezvous on a port it binds itself), builds `factory(comm)` on
each, and `call(method, *args)` runs it in lockstep, returning rank 0's result once every rank holds
the same tokens (`rank.agreement`). A rank that raises or dies brings the group down at once
(peers may block in a collective) with a `TensorParallelError` carrying its traceback; Ctrl-C
kills the ranks first; the guard kills them with the caller even on SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, Listener, wait
from typing import Any

from parity.core.errors import BackendError, ConfigError
from parity.parallel.wire import receive, send
from parity.parallel.zygote import ForkedRank, zygote
from parity.runtime import guard
from parity.runtime.processes import LOOPBACK

#: seconds ranks get to leave after close() before they are killed.
CLOSE_GRACE_S = 10.0
#: seconds the ranks get to connect back after they are started.
CONNECT_TIMEOUT_S = 120.0
#: seconds between checks, while the ranks connect, that none of them has exited.
CONNECT_POLL_S = 0.25
#: environment variable carrying the caller's address and key to a rank ("host:port:hexkey").
ADDRESS_ENV = "PARITY_TP_CALLER"


def check_rank_device(device: str, size: int | None) -> None:
    """ConfigError unless `size` ranks can honour `device`: on CUDA rank r takes visible GPU r and
    places its shard on the current GPU, so an index ("cuda:1") or fewer visible GPUs than ranks cannot
    be honoured (checked before any rank starts)."""
    kind, _, index = str(device).partition(":")
    if size is None or size < 2 or kind != "cuda":
        return
    if index:
        first = int(index) if index.isdigit() else 0
        visible = ",".join(str(first + r) for r in range(size))
        raise ConfigError(f"device={str(device)!r} with tensor_parallel_size={size}: rank r runs on visible "
                          f"GPU r (cuda:0..cuda:{size - 1}), not on the GPU the index names; pass "
                          "device='cuda' and choose the GPUs with CUDA_VISIBLE_DEVICES (e.g. "
                          f"CUDA_VISIBLE_DEVICES={visible})")
    import torch  # only for a CUDA layout: the caller has loaded it already

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < size:
        raise ConfigError(f"tensor_parallel_size={size} on device='cuda' needs {size} visible GPUs (one per "
                          f"rank); this machine shows {count}: lower tensor_parallel_size or make more GPUs "
                          "visible (CUDA_VISIBLE_DEVICES)")


class TensorParallelError(BackendError):
    """A rank of a tensor-parallel group failed or died; the group has been stopped."""


class RankGroup:
    """`size` rank processes, each holding `factory(Comm(rank, size))` (picklable); device_type "cpu"
    (gloo) or "cuda" (NCCL, rank r on GPU r).
    """

    def __init__(self, size: int, device_type: str, factory: Callable[[Any], Any]) -> None:
        self.size = size
        self._procs: list[subprocess.Popen[bytes] | ForkedRank] = []
        self._conns: list[Connection] = []
        key = secrets.token_bytes(32)
        try:
            with Listener((LOOPBACK, 0), authkey=key) as listener:
                host, caller_port = listener.address
                env = {**os.environ, ADDRESS_ENV: f"{host}:{caller_port}:{key.hex()}"}
                for rank in range(size):
                    proc: subprocess.Popen[bytes] | ForkedRank
                    # forked from preloaded imports on Linux (as torch's DataLoader workers are);
                    # a CUDA context does not survive a fork, and macOS frameworks are not fork-safe
                    if device_type == "cpu" and sys.platform == "linux":
                        proc = zygote().spawn(rank, env)
                    else:
                        proc = subprocess.Popen([sys.executable, "-m", "parity.parallel.rank", str(rank)],
                                                stdin=subprocess.DEVNULL, env=env, close_fds=True)
                    self._procs.append(proc)  # first: kill() reaches it even if tracking fails
                    guard.track(proc.pid)
                by_rank: dict[int, Connection] = {}
                listener._listener._socket.settimeout(CONNECT_POLL_S)
                deadline = time.monotonic() + CONNECT_TIMEOUT_S
                while len(by_rank) < size:
                    try:
                        conn = listener.accept()
                    except TimeoutError:
                        self._check_starting(deadline)
                        continue
                    by_rank[receive(conn)] = conn
                self._conns = [by_rank[r] for r in range(size)]
            # rank 0 binds the rendezvous store's port itself (one picked here could be taken before it binds)
            send(self._conns[0], (size, None, device_type, factory))
            (port,) = self._collect("start", [0])
            for conn in self._conns[1:]:
                send(conn, (size, port, device_type, factory))
            self._collect("start")
        except BaseException:
            self.kill()
            raise

    def _check_starting(self, deadline: float) -> None:
        """TensorParallelError once a rank has exited before connecting back, or the time is up."""
        for rank, proc in enumerate(self._procs):
            code = proc.poll()
            if code is not None:
                raise TensorParallelError(f"tensor-parallel rank {rank} of {self.size} exited (exit code "
                                          f"{code}) before it connected; stopped the group (its output above "
                                          "says why)")
        if time.monotonic() > deadline:
            raise TensorParallelError(f"the tensor-parallel ranks did not connect within "
                                      f"{CONNECT_TIMEOUT_S:.0f} s; stopped the group")

    @property
    def pids(self) -> list[int]:
        """The rank processes' ids, in rank order."""
        return [p.pid for p in self._procs]

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """`method(*args, **kwargs)` on every rank's object; rank 0's return value."""
        if not self._procs:
            raise TensorParallelError("the tensor-parallel group is closed; start a new one")
        try:
            for conn in self._conns:
                send(conn, (method, args, kwargs))
            replies = self._collect(method)
        except BaseException:
            self.kill()
            raise
        result, expected = replies[0]
        for rank, (_, held) in enumerate(replies[1:], 1):
            if held != expected:
                self.kill()
                raise TensorParallelError(self._disagreement(method, rank, result, expected, held))
        return result

    def _disagreement(self, method: str, rank: int, result: Any, expected: Any, held: Any) -> str:
        """Why rank `rank`'s tokens differ from rank 0's, naming the first rollout that differs."""
        where = ""
        if isinstance(expected, tuple) and isinstance(held, tuple) and len(expected) == len(held):
            i = next(i for i, (a, b) in enumerate(zip(expected, held, strict=True)) if a != b)
            item = result[i]
            where = (f" (first at result {i}: request {getattr(item, 'request_id', '?')!r}, sample "
                     f"{getattr(item, 'sample_index', '?')})")
        return (f"tensor-parallel rank {rank} of {self.size} holds other token ids than rank 0 after {method}"
                f"{where}, so each rank fed other tokens to its next steps and rank 0's logprobs mix "
                "partials of both; stopped the group. A multi-turn injection (Inject.fn, a tool) that "
                "does not return the same ids for the same ids so far on every rank causes this (or ranks "
                "on unlike devices): make it deterministic, or run with tensor_parallel_size=1")

    def _collect(self, what: str, ranks: list[int] | None = None, deadline: float | None = None) -> list[Any]:
        """One reply per rank (of `ranks`, default all); the first error or death (a closed connection)
        stops the group and raises, as does a rank still silent at `deadline` (time.monotonic())."""
        replies: dict[int, Any] = {}
        waiting = {self._conns[rank]: rank for rank in (range(self.size) if ranks is None else ranks)}
        while waiting:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            ready_conns = wait(list(waiting), left)
            if not ready_conns:
                self.kill()
                raise TensorParallelError(f"tensor-parallel ranks {sorted(waiting.values())} of {self.size} "
                                          f"did not answer {what} within the time given; killed the group")
            for ready in ready_conns:
                rank = waiting.pop(ready)
                try:
                    status, value = receive(ready)
                except (EOFError, OSError):
                    proc, now = self._procs[rank], time.monotonic()
                    try:
                        code = proc.wait(CLOSE_GRACE_S if deadline is None else max(deadline - now, 0.0))
                    except subprocess.TimeoutExpired:
                        code = None
                    self.kill()
                    raise TensorParallelError(f"tensor-parallel rank {rank} of {self.size} died in {what} "
                                              f"(exit code {code}); stopped the group") from None
                if status == "error":
                    self.kill()
                    raise TensorParallelError(f"tensor-parallel rank {rank} of {self.size} failed in "
                                              f"{what}; stopped the group. Its traceback:\n{value}")
                replies[rank] = value
        return [replies[r] for r in sorted(replies)]

    def close(self) -> None:
        """Stop every rank in order (each destroys its process group); ranks that have not replied and
        exited within CLOSE_GRACE_S in all (one hung in destroy_process_group, as NCCL can) are
        killed (SIGKILL), so close() returns within about that. Idempotent."""
        if not self._procs:
            return
        deadline = time.monotonic() + CLOSE_GRACE_S
        try:
            for conn in self._conns:
                send(conn, None)
            self._collect("close", deadline=deadline)
            for proc in self._procs:
                proc.wait(max(deadline - time.monotonic(), 0.0))
        except (OSError, TensorParallelError, subprocess.TimeoutExpired):
            pass
        finally:
            self.kill()

    def kill(self) -> None:
        """Kill every rank still running (SIGKILL) and reap it (one that outlives CLOSE_GRACE_S after
        its SIGKILL, stuck in the kernel, is left to the guard). Idempotent."""
        procs, self._procs = self._procs, []
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        deadline = time.monotonic() + CLOSE_GRACE_S
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(deadline - time.monotonic(), 0.0))
        for conn in self._conns:
            conn.close()
        self._conns = []

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
