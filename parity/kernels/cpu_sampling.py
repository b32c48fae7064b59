"""The sampler's Gumbel-max draw on CPU, batch-invariant: the noise's two float64 logs run in place
over aligned one-thread pieces (`cpu.pointwise_`), so every element goes through the vector body.
"""

from __future__ import annotations

import torch

from parity.kernels.cpu import POINTWISE_ALIGN, pointwise_
from parity.kernels.sampling import uniform


def gumbel_noise(state: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise [N, vocab] float64, -log(-log(u)); row i depends on state[i] only."""
    flat = uniform(state, vocab, POINTWISE_ALIGN)
    pointwise_(lambda u: u.log_().neg_().log_().neg_(), flat)
    return flat[:state.shape[0] * vocab].view(state.shape[0], vocab)


def gumbel_argmax(scores: torch.Tensor, state: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
    """argmax(scores [N, V] + `gumbel_noise`) per row -> [N] int64, ties to the lower id; rows not
    `noisy` (greedy) add no noise.
    """
    if not bool(noisy.any()):
        return scores.argmax(dim=-1)
    # noise + float64(score) in place of score + noise: the same sum (IEEE addition commutes, and
    # float32 -> float64 is exact), without two more [N, V] float64 temporaries.
    noise = gumbel_noise(state, scores.shape[1])
    if not bool(noisy.all()):
        noise.masked_fill_(~noisy.unsqueeze(1), 0.0)
    return noise.add_(scores).argmax(dim=-1)
