"""Batch-invariant kernels behind one switch (`with kernels.invariant(): ...`).

Inside it every op of a model loaded by `parity.models.loading.load_model`, and the sampler's
draw, computes each token bitwise independently of batch size, companions, row position, padding
and prefill vs decode. Families (`FAMILIES`) switch independently to attribute drift. Ops are
registered per device type (CPU always, Triton where a GPU is; `kernels.register` for others).
The ops models call and the device kernels never import each other (import-linter).
"""

import importlib.util

import torch

from parity.kernels import cpu, cpu_attention, cpu_sampling
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
           "register", "triton_available"]


def prepare(model: torch.nn.Module) -> None:
    """Load-time work a device's kernels need for `model` (call once its weights sit on the device):
    on CUDA, probe every bias-free linear weight shape for the proven cuBLASLt route
    (`parity.kernels.triton.matmul.prepare`); on CPU, keep freed heap memory for the kernels'
    temporaries (`cpu.keep_freed_memory`), after refusing an ATEN_CPU_CAPABILITY that ATen ignored
    (`cpu.check_capability`)."""
    if any(p.device.type == "cpu" for p in model.parameters()):
        cpu.check_capability()
        cpu.keep_freed_memory()
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and m.bias is None]
    cuda = [w for w in weights if w.is_cuda]
    if cuda and triton_available():
        from parity.kernels.triton import matmul  # Triton is optional (CUDA machines only)

        matmul.prepare({(w.dtype, *w.shape) for w in cuda}, cuda[0].device)
        groups = [[m.weight for m in module.parity_group] for module in model.modules()
                  if getattr(module, "parity_group", None)]
        matmul.prove_groups({(g[0].dtype, g[0].shape[1], tuple(w.shape[0] for w in g)) for g in groups
                             if all(w.is_cuda for w in g)}, cuda[0].device)


def triton_available() -> bool:
    """Whether Triton is installed (the CUDA kernels need it)."""
    return importlib.util.find_spec("triton") is not None


def _unfused(*args: object) -> None:
    """CPU has no grouped or fused launch: the caller runs the pieces (`ops.linears` each product by
    `linear`, `ops.norm_rotary` the two norms and the rotation)."""
    return None


def _register_cpu() -> None:
    """Register the CPU kernels for device type "cpu"."""
    for family, op, fn in (
        ("matmul", "linear", cpu.linear),
        ("matmul", "linears", _unfused),
        ("rmsnorm", "rms_norm", cpu.rms_norm),
        ("rmsnorm", "add_rms_norm", cpu.add_rms_norm),
        ("softmax", "softmax", cpu.softmax),
        ("softmax", "log_softmax", cpu.log_softmax),
        ("softmax", "cumsum", cpu.cumsum),
        ("pointwise", "activation", cpu.activation),
        ("pointwise", "gated", cpu.gated),
        ("pointwise", "gumbel_argmax", cpu_sampling.gumbel_argmax),
        ("pointwise", "log_softmax_draw", cpu_sampling.log_softmax_draw),
        ("moe", "topk", cpu.topk),
        ("moe", "experts", cpu.experts),
        ("rotary", "rotary", cpu.rotary),
        ("rotary", "apply", cpu.apply_rotary),
        ("rotary", "norm_apply", _unfused),
        ("attention", "attention", cpu_attention.attention),
        ("attention", "write_kv", cpu_attention.write_kv),
    ):
        register(family, op, "cpu", fn)


def _register_cuda() -> None:
    """Register the Triton kernels for device type "cuda" where a GPU and Triton are present."""
    if torch.cuda.is_available() and triton_available():
        from parity.kernels import triton  # Triton is optional (CUDA machines only)

        triton.register()


_register_cpu()
_register_cuda()
