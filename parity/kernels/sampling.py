"""The sampler's Gumbel noise, defined once: a counter-based hash of each row's key and token id.

The sampler folds a row's key (request seed, sample index, absolute position) into a 32-bit
hash state with `mix32` (`parity.engine.sampler.key_state`); token v of that row gets 53 random
bits from the state and v alone, u = (bits + 0.5) / 2^53 in (0, 1), and the noise
-log(-log(u)), so no element depends on its place in the batch. The hash is integer
arithmetic, exact on every device; the two float64 logs are the device's own.

`gumbel_argmax` here is the stock draw (plain torch ops) that `parity.kernels.ops.gumbel_argmax`
runs when family "pointwise" is off; the invariant draws are `cpu_sampling` (the logs in the
vector body only) and `triton.sampling` (one fused kernel, the noise never written to memory).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def mix32_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds), in place on int64 `x` holding values in [0, 2^32);
    `scratch` has x's shape and takes each shifted copy, so a round makes no temporary.

    The multipliers are odd and below 2^31, so a 32-bit value times one stays below 2^63: no
    int64 overflow, and every shift is of a non-negative number, so results are the same on
    every device.
    """
    for shift, multiplier in ((16, 0x7FEB352D), (15, 0x68E31DA5)):
        x.bitwise_xor_(torch.bitwise_right_shift(x, shift, out=scratch))
        x.mul_(multiplier).bitwise_and_(_MASK32)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=scratch))


def mix32(x: torch.Tensor) -> torch.Tensor:
    """`mix32_` of a copy of x: for the small key and token-word tensors, where x may be a view."""
    return mix32_(x.clone(), torch.empty_like(x))


#: (vocab, device) -> the per-token hash words [2, vocab] int64, the same for every step.
_TOKEN_WORDS: dict[tuple[int, str], torch.Tensor] = {}


def token_words(vocab: int, device: torch.device | str) -> torch.Tensor:
    """mix32(2 * token) and mix32(2 * token + 1) for every token id [2, vocab] (cached per device)."""
    key = (vocab, str(device))
    if key not in _TOKEN_WORDS:
        token = torch.arange(vocab, dtype=torch.int64, device=device)
        _TOKEN_WORDS[key] = torch.stack([mix32(2 * token), mix32(2 * token + 1)])
    return _TOKEN_WORDS[key]


def gumbel_argmax(scores: torch.Tensor, state: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
    """argmax(scores + noise) per row -> [N] int64, ties to the lower token id: the stock draw.

    scores [N, V] float32 or float64 (added to the noise in float64); state [N] int64, each row's
    hash state; noisy [N] bool, False rows add no noise (greedy). The formula as written, one op
    over whole [N, V] tensors per step; on CPU an element's logs may round by where the thread
    split puts it (vector body or scalar tail), so this is batch-invariant only where family
    "pointwise" replaces it.
    """
    words = token_words(scores.shape[1], scores.device)
    column = state.unsqueeze(1)
    high, low = column ^ words[0], column ^ words[1]
    scratch = torch.empty_like(high)
    mix32_(high, scratch)
    mix32_(low, scratch)
    bits = high.bitwise_left_shift_(21).bitwise_or_(low.bitwise_right_shift_(11))
    u = (bits.to(torch.float64) + 0.5) / 2.0**53  # 53 bits convert exactly; u lies strictly inside (0, 1)
    noise = -torch.log(-torch.log(u))
    return (noise.masked_fill(~noisy.unsqueeze(1), 0.0) + scores).argmax(dim=-1)
