"""The sampler's Gumbel-max draw on CPU, batch-invariant: the noise's logs in the vector body only.

The noise is `parity.kernels.sampling`'s (the same hash bits, `uniform`); what CPU adds is the
rounding of its two float64 logs. Like every transcendental op here (`cpu.pointwise`), an
element's result would depend on whether it lands in the vectorized body or the scalar tail of a
thread's chunk; the buffer is padded to a multiple of POINTWISE_ALIGN and the logs run in place
over pieces that stay on one thread (`cpu.pointwise_`), so every element goes through the vector
body whatever the batch.
"""

from __future__ import annotations

import torch

from parity.kernels.cpu import POINTWISE_ALIGN, pointwise_
from parity.kernels.sampling import uniform


def gumbel_noise(state: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise [N, vocab] float64; row i is a function of state[i] (its key's hash state) only.

    state [N] int64 on the CPU; the noise is -log(-log(u)) of `uniform`'s u, the logs through
    `pointwise_`.
    """
    flat = uniform(state, vocab, POINTWISE_ALIGN)
    pointwise_(lambda u: u.log_().neg_().log_().neg_(), flat)
    return flat[:state.shape[0] * vocab].view(state.shape[0], vocab)


def gumbel_argmax(scores: torch.Tensor, state: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
    """argmax(scores + `gumbel_noise`) per row -> [N] int64, ties to the lower token id.

    scores [N, V] float32 or float64; state [N] int64; noisy [N] bool, False rows add no noise
    (greedy). A batch without noisy rows makes no noise at all.
    """
    if not bool(noisy.any()):
        return scores.argmax(dim=-1)
    # noise + float64(score) in place of score + noise: the same sum (IEEE addition commutes, and
    # float32 -> float64 is exact), without two more [N, V] float64 temporaries.
    noise = gumbel_noise(state, scores.shape[1])
    if not bool(noisy.all()):
        noise.masked_fill_(~noisy.unsqueeze(1), 0.0)
    return noise.add_(scores).argmax(dim=-1)
