"""MoE expert compute (family "moe"): grouped expert GEMMs and the top-k combine. HF's eager
experts run one GEMM per expert over however many tokens chose it, so bits follow companions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from parity.kernels.grad import exact
from parity.kernels.switch import impl

ExpertsForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def experts_forward(experts: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, native: ExpertsForward) -> torch.Tensor:
    """Expert MLPs weighted and summed: hidden [N, H], top_k_* [N, k] -> [N, H] (HF's fused layout);
    `native` when family "moe" is off.
    """
    fn = impl("moe", "experts", hidden.device.type)
    if fn is None:
        return native(hidden, top_k_index, top_k_weights)
    # under autograd: the kernel's bits, the HF experts' derivative (`native` reads the module's
    # own gate_up_proj and down_proj, which are among the inputs: see parity.kernels.grad)
    return exact(lambda: fn(hidden, top_k_index, top_k_weights, experts.gate_up_proj, experts.down_proj,
                            experts.act_fn),
                 lambda h, w, _gate_up, _down: native(h, top_k_index, w),
                 hidden, top_k_weights, experts.gate_up_proj, experts.down_proj)
