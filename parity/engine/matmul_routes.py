"""Which route the invariant linear takes for each weight shape of a model, and why (`parity kernels`):
on CUDA cuBLASLt without split-K where the load-time probe proved it row-invariant, else Triton (or
"refused": a weight whose rows Triton's TMA cannot load, on which the invariant linear raises); on CPU
bf16 tiles (AMX or AVX-512 BF16) where proven row-invariant, else float32 tiles.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from parity.core.errors import BackendUnavailableError, ConfigError
from parity.kernels import cpu_bf16, triton_available
from parity.models.loading import load_model
from parity.models.routing import ROUTERS


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
    """The route of every distinct (N, K, bias) linear weight of `model` loaded on `device` (MoE routers'
    included: their scores run through the same linear);
    cublaslt: set the process up for the cuBLASLt route first (CUDA only, before CUDA starts)."""
    cuda = device.startswith("cuda")
    if cuda:
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
    products = _products(lm.model)

    def key(product: tuple[torch.Tensor, torch.Tensor | None]) -> tuple:
        weight, bias = product
        return (weight.dtype, *weight.shape, bias is not None)

    shapes = Counter(map(key, products))
    one_of = {key(p): p for p in products}
    rows = []
    for (wdtype, n, k, has_bias), count in sorted(shapes.items(), key=lambda item: (-item[1], str(item[0]))):
        if cuda:  # the verdicts of the device the weight sits on (each device proves its own)
            path, why = route(wdtype, n, k, has_bias, one_of[(wdtype, n, k, has_bias)][0].device)
        else:
            path, why = cpu_bf16.route(*one_of[(wdtype, n, k, has_bias)])
        rows.append(LinearRoute(n=n, k=k, dtype=str(wdtype).removeprefix("torch."), has_bias=has_bias,
                                count=count, route=path, reason=why))
    return rows


def _products(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight, bias) of every product `ops.linear` runs for `model`: each nn.Linear, and each MoE
    router's scores (`parity.models.routing.route`: the router's weight, or its float32 copy for a
    sigmoid router, which scores in float32)."""
    products: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    for module in model.modules():
        if isinstance(module, nn.Linear):
            products.append((module.weight, module.bias))
        elif type(module).__name__ in ROUTERS:
            weight = module.weight
            products.append((weight if ROUTERS[type(module).__name__].score == "softmax"
                              else weight.to(torch.float32), None))
    return products
