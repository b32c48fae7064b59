"""The collectives a tensor-parallel model needs, for one rank of a group of `size` ranks:
`all_gather` (the canonical, exact exchange) and `all_reduce` (the stock contrast);
`Comm.single()` runs in-process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parity.core.errors import ConfigError


@dataclass(frozen=True)
class Comm:
    """Rank `rank` of `size` ranks; `size > 1` needs an initialized default process group."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        if not (isinstance(self.size, int) and self.size >= 1 and 0 <= self.rank < self.size):
            raise ConfigError(f"tensor parallel rank {self.rank!r} of size {self.size!r}: "
                              f"need 0 <= rank < size")

    @classmethod
    def single(cls) -> Comm:
        """The group of one: every collective is the identity."""
        return cls(0, 1)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: every rank's `x`, stacked in rank order (the same tensor on every rank)."""
        x = x.contiguous()
        if self.size == 1:
            return x.unsqueeze(0)
        if dist.get_backend() == "gloo":
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x)
            return torch.stack(parts)
        out = x.new_empty(self.size, *x.shape)
        dist.all_gather_into_tensor(out, x)
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` in the order the collective library picks (not TP-invariant)."""
        x = x.contiguous()
        if self.size > 1:
            dist.all_reduce(x)
        return x
