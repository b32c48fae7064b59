"""The sampler's Gumbel noise, defined once: a counter-based hash of each row's key and token id.

A row's key (seed, sample index, position) folds into a 32-bit state (`mix32`); token v gets 53
bits from the state and v alone, u = (bits + 0.5) / 2^53, noise -log(-log(u)). The hash is exact
integer arithmetic on every device; the two float64 logs are the device's own. `gumbel_argmax`
here is the stock draw (family "pointwise" off).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
#: rows of the [N, vocab] hash computed at a time on CPU: two int64 rows of a 49k vocabulary (0.8 MB
#: per temporary) stay in cache and are updated in place, where whole-batch temporaries (12 MB each
#: at 32 x 49k, a dozen per step) are fresh allocations that fault in every page on every step.
_HASH_ROWS = 2


def mix32_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """A 32-bit xorshift-multiply hash in place on int64 `x` in [0, 2^32) (`scratch` avoids temporaries):
    odd multipliers below 2^31 never overflow int64, so results are the same on every device.
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


def uniform(state: torch.Tensor, vocab: int, align: int = 1) -> torch.Tensor:
    """u [N * vocab + padding] float64 in (0, 1), row-major; padded to `align` with u = 1/2 (finite
    logs). Hashed `_HASH_ROWS` rows at a time on CPU, all at once elsewhere: the same bits.
    """
    rows, total = state.shape[0], state.shape[0] * vocab
    words = token_words(vocab, state.device)
    flat = torch.empty(total + (-total) % align, dtype=torch.float64, device=state.device)
    flat[total:] = 2.0**52  # padding: u = 1/2 after the scaling below
    bits = flat[:total].view(rows, vocab)
    column = state.unsqueeze(1)
    step = _HASH_ROWS if state.device.type == "cpu" else max(rows, 1)
    for start in range(0, rows, step):
        block = column[start:start + step]
        high, low = block ^ words[0], block ^ words[1]
        scratch = torch.empty_like(high)
        mix32_(high, scratch)
        mix32_(low, scratch)
        high.bitwise_left_shift_(21).bitwise_or_(low.bitwise_right_shift_(11))
        bits[start:start + step].copy_(high)  # int64 -> float64: exact below 2^53
    return flat.add_(0.5).div_(2.0**53)


def gumbel_argmax(scores: torch.Tensor, state: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
    """argmax(scores [N, V] + noise) per row -> [N] int64, ties to the lower id: the stock draw. Its
    logs run over the whole buffer, so on CPU a last bit may follow the thread split: invariant only
    where family "pointwise" replaces it.
    """
    n, vocab = scores.shape
    noise = uniform(state, vocab).log_().neg_().log_().neg_().view(n, vocab)
    # noise + float64(score) in place of score + noise: the same sum (IEEE addition commutes, and
    # float32 -> float64 is exact), without two more [N, V] float64 temporaries.
    return noise.masked_fill_(~noisy.unsqueeze(1), 0.0).add_(scores).argmax(dim=-1)
