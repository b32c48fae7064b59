"""Round 7 of "no silent wrong numbers": how a CPU tensor-parallel group and its zygote end.

Each test failed on the code before its fix: `RankGroup.close()` waited for a rank hung in
`destroy_process_group` forever (its docstring said it killed ranks that hang), the zygote died on
SIGTERM leaving its forked ranks running (measured still alive 30 s later; 0.04 s after the fix),
and a Ctrl-C between a request to the zygote and its reply left the reply in the stream, so every
later request read the previous one's answer: the next group's `pids` named an exited rank and
missed a live one (which neither the guard nor `kill()` then knew).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
import torch.distributed as dist
from procs import alive

from parity.parallel import RankGroup
from parity.parallel import group as group_module
from parity.parallel import zygote as zygote_module

pytestmark = pytest.mark.slow


class Pid:
    """A rank object that tells its process id."""

    def __init__(self, comm) -> None:
        self.comm = comm

    def pid(self) -> int:
        return os.getpid()


class HangsInDestroy(Pid):
    """Its rank 1 hangs in `destroy_process_group` at close (as an NCCL rank can)."""

    def __init__(self, comm) -> None:
        super().__init__(comm)
        if comm.rank == 1:  # this rank process's torch.distributed only
            dist.destroy_process_group = lambda *args, **kwargs: time.sleep(3600)


def _wait_gone(procs: list[psutil.Process], seconds: float) -> list[psutil.Process]:
    deadline = time.monotonic() + seconds
    left = procs
    while left and time.monotonic() < deadline:
        left = [p for p in left if alive(p)]
        time.sleep(0.02)
    return left


def test_close_kills_a_rank_hung_in_destroy_within_the_grace(probe_path, monkeypatch) -> None:
    monkeypatch.setattr(group_module, "CLOSE_GRACE_S", 1.0)
    group = RankGroup(2, "cpu", HangsInDestroy)
    ranks = [psutil.Process(pid) for pid in group.pids]
    assert group.call("pid") == group.pids[0]
    closing = threading.Thread(target=group.close, daemon=True)
    start = time.monotonic()
    closing.start()
    try:
        closing.join(6.0)  # before: close() never returned
        took, hung = time.monotonic() - start, closing.is_alive()
    finally:
        for rank in ranks:  # on the old code: lets its close() end
            if alive(rank):
                rank.kill()
        closing.join(30)
    assert not hung and took < 4.0, f"close() took {took:.1f} s with a 1 s grace"
    assert not _wait_gone(ranks, 2.0)


def test_a_sigterm_to_the_zygote_takes_its_ranks_down(probe_path) -> None:
    group = RankGroup(2, "cpu", probe_path)
    try:
        ranks = [psutil.Process(pid) for pid in group.pids]
        (zygote,) = {rank.parent() for rank in ranks}
        zygote.send_signal(signal.SIGTERM)
        left = _wait_gone(ranks, 3.0)  # before: both still ran 30 s later
        assert not left, f"ranks {left} outlived their zygote"
        assert not _wait_gone([zygote], 10.0)  # the next group starts a new one
    finally:
        group.kill()


def test_an_interrupted_zygote_request_does_not_shift_the_next_groups_ranks(probe_path, monkeypatch) -> None:
    with RankGroup(2, "cpu", probe_path) as group:
        group.call("gather")  # the zygote is up
    receive = zygote_module._receive
    interrupts = iter([True])

    def ctrl_c_once(sock):
        if next(interrupts, False):
            raise KeyboardInterrupt  # Ctrl-C after the spawn request went, before its reply came
        return receive(sock)

    monkeypatch.setattr(zygote_module, "_receive", ctrl_c_once)
    with pytest.raises(KeyboardInterrupt):
        RankGroup(2, "cpu", Pid)
    with RankGroup(2, "cpu", Pid) as group:
        ranks = [psutil.Process(pid) for pid in group.pids]
        # before: pids[0] was the interrupted spawn's rank (exited), and rank 1 was not among them
        assert group.call("pid") == group.pids[0]
        assert all(alive(rank) for rank in ranks)
    assert not _wait_gone(ranks, 2.0)
