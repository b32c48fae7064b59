"""Which route the invariant linear takes for each weight shape of a model, and why (`parity kernels`):
on CUDA cuBLASLt without split-K where the load-time probe proved it row-invariant, else Triton; on CPU
bf16 tiles (AMX or AVX-512 BF16) where proven row-invariant, else float32 tiles.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from torch import nn

from parity.core.errors import BackendUnavailableError, ConfigError
from parity.kernels import cpu_bf16
from parity.models.loading import load_model


@dataclass(frozen=True)
class LinearRoute:
    """One distinct linear weight shape: how many layers have it, and its route."""

    n: int
    k: int
    dtype: str
    has_bias: bool
    count: int
    route: str
    reason: str


def linear_routes(model: str, *, dtype: str = "bfloat16", device: str = "cuda",
                  cublaslt: bool = False) -> list[LinearRoute]:
    """The route of every distinct (N, K, bias) linear weight of `model` loaded on `device`;
    cublaslt: set the process up for the cuBLASLt route first (CUDA only, before CUDA starts)."""
    cuda = device.startswith("cuda")
    if cuda:
        import torch  # CUDA setup must precede CUDA's start: imported inside the branch that needs it

        from parity.kernels import triton_available

        if not torch.cuda.is_available():
            raise BackendUnavailableError("parity kernels: no CUDA device here; use --device cpu")

        if not triton_available():
            raise BackendUnavailableError("parity kernels: Triton is not installed; install triton for CUDA")
        from parity.kernels.triton.matmul import configure_cublaslt, route  # Triton: checked just above

        if cublaslt:
            configure_cublaslt()
    elif cublaslt:
        raise ConfigError("parity kernels: --cublaslt needs --device cuda")
    lm = load_model(model, dtype=dtype, device=device)
    linears = [m for m in lm.model.modules() if isinstance(m, nn.Linear)]

    def key(m: nn.Linear) -> tuple:
        return (m.weight.dtype, *m.weight.shape, m.bias is not None)

    shapes = Counter(map(key, linears))
    one_of = {key(m): m for m in linears}
    rows = []
    for (wdtype, n, k, has_bias), count in sorted(shapes.items(), key=lambda item: (-item[1], str(item[0]))):
        if cuda:
            path, why = route(wdtype, n, k, has_bias)
        else:
            linear = one_of[(wdtype, n, k, has_bias)]
            path, why = cpu_bf16.route(linear.weight, linear.bias)
        rows.append(LinearRoute(n=n, k=k, dtype=str(wdtype).removeprefix("torch."), has_bias=has_bias,
                                count=count, route=path, reason=why))
    return rows
