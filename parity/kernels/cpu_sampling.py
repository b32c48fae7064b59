"""The sampler's Gumbel-max draw on CPU, batch-invariant: the noise's logs in the vector body only.

The noise is `parity.kernels.sampling`'s (the same hash bits); what CPU adds is the rounding of
its two float64 logs. Like every transcendental op here (`cpu.pointwise`), an element's result
would depend on whether it lands in the vectorized body or the scalar tail of a thread's chunk;
the buffer is padded to a multiple of POINTWISE_ALIGN and the logs run in place over pieces that
stay on one thread (`cpu.pointwise_`), so every element goes through the vector body whatever the
batch. The hash is computed a few rows at a time, in place, into that padded buffer: a step's
noise is [N, vocab] float64, and whole-batch temporaries would be fresh allocations every step.
"""

from __future__ import annotations

import torch

from parity.kernels.cpu import POINTWISE_ALIGN, pointwise_
from parity.kernels.sampling import mix32_, token_words

#: rows of the [N, vocab] hash computed at a time: two int64 rows of a 49k vocabulary (0.8 MB per
#: temporary) stay in cache and are updated in place, where whole-batch temporaries (12 MB each at
#: 32 x 49k, a dozen per step) are fresh allocations that fault in every page on every step.
_HASH_ROWS = 2


def gumbel_noise(state: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise [N, vocab] float64; row i is a function of state[i] (its key's hash state) only.

    state [N] int64 on the CPU. Each (row, token id) is hashed to 53 random bits, u = (bits +
    0.5) / 2^53 lies in (0, 1), and the noise is -log(-log(u)), the logs through `pointwise_`.
    """
    rows, total = state.shape[0], state.shape[0] * vocab
    words = token_words(vocab, state.device)
    flat = torch.empty(total + (-total) % POINTWISE_ALIGN, dtype=torch.float64, device=state.device)
    flat[total:] = 2.0**52  # padding: u = 1/2 after the scaling below, so its logs stay finite
    bits = flat[:total].view(rows, vocab)
    column = state.unsqueeze(1)
    for start in range(0, rows, _HASH_ROWS):
        block = column[start:start + _HASH_ROWS]
        high, low = block ^ words[0], block ^ words[1]
        scratch = torch.empty_like(high)
        mix32_(high, scratch)
        mix32_(low, scratch)
        high.bitwise_left_shift_(21).bitwise_or_(low.bitwise_right_shift_(11))
        bits[start:start + _HASH_ROWS].copy_(high)  # int64 -> float64: exact below 2^53
    flat.add_(0.5).div_(2.0**53)
    pointwise_(lambda u: u.log_().neg_().log_().neg_(), flat)
    return bits


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
