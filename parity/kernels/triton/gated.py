"""A gated MLP's SiLU(gate) * up in one pass on CUDA, torch's bits (stock: two launches, and a
[tokens, intermediate] tensor written and read back between them).

torch rounds twice: silu(g) = g / (1 + exp(-g)) in fp32 (CUDA's accurate expf, IEEE division),
rounded to the tensor dtype; then the product, in fp32, rounded again. The kernel does the same
with libdevice's expf and `div_rn`. Elementwise, hence invariant.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import nn
from torch.nn import functional as F
from transformers.activations import SiLUActivation
from triton.language.extra.cuda import libdevice

#: elements of a row per program.
BLOCK = 1024


@triton.jit(do_not_specialize=["R"])
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, R, W, g_stride, u_stride, BLOCK: tl.constexpr,
                     LIBDEVICE: tl.constexpr):
    """Grid (R rows, column blocks); out is [R, W] contiguous."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < W
    g = tl.load(g_ptr + row * g_stride + cols, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    # Triton's own exp is ex2.approx (not torch's bits); the interpreter has no libdevice
    e = libdevice.exp(-gf) if LIBDEVICE else tl.exp(-gf)
    silu = tl.math.div_rn(gf, 1.0 + e).to(g.dtype, fp_downcast_rounding="rtne")
    u = tl.load(u_ptr + row * u_stride + cols, mask=ok, other=0.0)
    # a product of two bf16/fp16 values is exact in fp32: one rounding, as in torch
    out = silu.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + row * W + cols, out.to(g.dtype, fp_downcast_rounding="rtne"), mask=ok)


#: the SiLU modules HF models hold (`ACT2FN["silu"]` is transformers' own, whose forward is F.silu).
SILU_MODULES = (nn.SiLU, SiLUActivation)


def _is_silu(act: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    act = getattr(act, "act", act)  # a patched model's `ParityActivation` holds the module's own
    return type(act) in SILU_MODULES or act is F.silu


def gated(act: Callable[[torch.Tensor], torch.Tensor], gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up for gate, up [..., I] (rows may be strided, e.g. halves of one [R, 2I] product):
    one launch for SiLU on float tensors of one dtype, the stock two ops otherwise."""
    if not (_is_silu(act) and gate.shape == up.shape and gate.dim() and gate.numel()
            and gate.dtype == up.dtype and gate.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        return act(gate) * up
    g2, u2 = gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])
    if g2.stride(-1) != 1 or u2.stride(-1) != 1:
        return act(gate) * up
    rows, width = g2.shape
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    _silu_mul_kernel[(rows, triton.cdiv(width, BLOCK))](
        g2, u2, out, rows, width, g2.stride(0), u2.stride(0), BLOCK=BLOCK, LIBDEVICE=gate.is_cuda,
        num_warps=4)
    return out
