"""Batch-invariant kernels behind one switch.

    from parity import kernels
    with kernels.invariant():              # every family on; kernels.invariant(["matmul"]) for one
        logits = model(input_ids).logits

Inside the switch, every op of a model loaded with `parity.models.loading.load_model` computes
each token's outputs bitwise independently of batch size, batch companions, row position,
padding, and of full forward vs chunked prefill vs decode. Families (`FAMILIES`) switch
independently so drift can be attributed to one of them. Each family's op is looked up per
device type: CPU kernels live in `parity/kernels/cpu.py` and `cpu_attention.py`; another device
registers its own with `kernels.register(family, op, device_type, fn)`.
"""

import importlib.util

import torch

from parity.kernels import cpu as _cpu  # noqa: F401  (registers the CPU kernels)
from parity.kernels import cpu_attention as _cpu_attention  # noqa: F401  (and the CPU attention)
from parity.kernels.switch import (
    FAMILIES,
    disable,
    enable,
    enabled_families,
    impl,
    invariant,
    native,
    register,
)

__all__ = ["FAMILIES", "disable", "enable", "enabled_families", "impl", "invariant", "native", "prepare",
           "register"]


def prepare(model: torch.nn.Module) -> None:
    """Load-time work a device's kernels need for `model` (call once its weights sit on the device):
    on CUDA, probe every bias-free linear weight shape for the proven cuBLASLt route
    (`parity.kernels.triton.matmul.prepare`). Nothing to do on CPU."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and m.bias is None]
    cuda = [w for w in weights if w.is_cuda]
    if cuda and _triton_available():
        from parity.kernels.triton import matmul

        matmul.prepare({(w.dtype, *w.shape) for w in cuda}, cuda[0].device)


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _register_cuda() -> None:
    """Register the Triton kernels for device type "cuda" where a GPU and Triton are present."""
    if torch.cuda.is_available() and _triton_available():
        from parity.kernels import triton as _triton

        _triton.register()


_register_cuda()
