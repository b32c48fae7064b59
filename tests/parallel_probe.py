"""A rank object for the launcher tests (imported by rank processes, so it lives outside test_*.py)."""

from __future__ import annotations

import os
import sys
import time

import torch

from parity.parallel import Comm


class Probe:
    """Answers on every rank of a `RankGroup`; each method misbehaves on demand on one rank."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def gather(self) -> list[int]:
        """Every rank's rank, through the group's all_gather."""
        return self.comm.all_gather(torch.tensor([self.comm.rank])).flatten().tolist()

    def fail_on(self, rank: int) -> int:
        if self.comm.rank == rank:
            raise RuntimeError(f"probe failure on rank {rank}")
        return self.comm.rank

    def exit_on(self, rank: int) -> int:
        if self.comm.rank == rank:
            os._exit(3)
        return self.comm.rank

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def environ(self, name: str) -> str | None:
        return os.environ.get(name)

    def cwd(self) -> str:
        return os.getcwd()

    def say(self, text: str) -> None:
        """`text` and the rank on its stdout and stderr (rank 0 alone)."""
        if self.comm.rank == 0:
            print(f"out {text}", flush=True)
            print(f"err {text}", file=sys.stderr, flush=True)
