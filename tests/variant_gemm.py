"""Stock linear layers whose reduction order varies on purpose, for negative controls.

Whether a CPU BLAS splits a GEMM's sum by thread count or by problem size depends on the host (an
AVX2-only EPYC gives the same float64 bits at 1 and 2 threads, an AMX Xeon does not), so a control
that waits for the host's BLAS to vary passes on one machine and fails on another. These replace
`torch.nn.functional.linear` (which `parity.kernels.ops.linear` calls when the matmul family is off)
with the same product summed over K in explicit chunks, the chunk count chosen from the thread
count or the row count: the variation a real BLAS may or may not have, made certain.
"""

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

_stock_linear = F.linear


def split_k_linear(parts: Callable[[torch.Tensor], int]) -> Callable[..., torch.Tensor]:
    """`F.linear` with its K sum split into `parts(x)` chunks added in order. x: [..., K];
    weight: [N, K]; bias: [N] or None."""

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        chunks = max(1, min(parts(x), x.shape[-1]))
        out = None
        for xs, ws in zip(x.tensor_split(chunks, dim=-1), weight.tensor_split(chunks, dim=-1)):
            partial = _stock_linear(xs, ws)
            out = partial if out is None else out + partial
        return out if bias is None else out + bias

    return linear


def by_threads(x: torch.Tensor) -> int:
    """One chunk per intra-op thread, as a BLAS that gives each thread a slice of K."""
    return torch.get_num_threads()


def by_rows(x: torch.Tensor, rows: int = 64) -> int:
    """Two chunks from `rows` rows of x up, as a BLAS that switches to split-K for larger problems."""
    return 1 if x.numel() // x.shape[-1] < rows else 2


def use(monkeypatch: pytest.MonkeyPatch, parts: Callable[[torch.Tensor], int]) -> None:
    """Make the stock linear layer split its sum by `parts` for the rest of the test."""
    monkeypatch.setattr(F, "linear", split_k_linear(parts))
