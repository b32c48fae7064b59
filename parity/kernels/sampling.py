"""The sampler's Gumbel noise, defined once: a counter-based hash of each row's key and token id.

A row's key (seed, sample index, position) folds into a 32-bit state (`mix32`); token v gets 53
bits from the state and v alone, u = (bits + 0.5) / 2^53, noise -log(-log(u)). The hash is exact
integer arithmetic on every device (on CPU in numpy uint32, `hash_span`: the bits of the int64
torch form); the two float64 logs are the device's own. `gumbel_argmax` here is the stock draw
(family "pointwise" off).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch

_MASK32 = 0xFFFFFFFF
#: (shift, odd multiplier) rounds of the xorshift-multiply hash `mix32_`, then a last xorshift.
_ROUNDS = ((16, 0x7FEB352D), (15, 0x68E31DA5))
_LAST_SHIFT = 16
#: tokens per span of the CPU hash (a multiple of the invariant draw's pieces): their float64 values
#: (2 MB) split over two cores' caches, where whole-batch temporaries (12 MB at 32 x 49k) are fresh
#: allocations that fault in every page on every step.
HASH_SPAN = 262144
#: tokens numpy hashes at a time, on one thread: their words and scratch (256 KB each) stay in its cache.
_HASH_PART = 32768


def mix32_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """A 32-bit xorshift-multiply hash in place on int64 `x` in [0, 2^32) (`scratch` avoids temporaries):
    odd multipliers below 2^31 never overflow int64, so results are the same on every device.
    """
    for shift, multiplier in _ROUNDS:
        x.bitwise_xor_(torch.bitwise_right_shift(x, shift, out=scratch))
        x.mul_(multiplier).bitwise_and_(_MASK32)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, _LAST_SHIFT, out=scratch))


def mix32(x: torch.Tensor) -> torch.Tensor:
    """`mix32_` of a copy of x: for the small key and token-word tensors, where x may be a view."""
    return mix32_(x.clone(), torch.empty_like(x))


def mix32_words(x: np.ndarray) -> np.ndarray:
    """`mix32` of uint32 words in numpy (the same integers): for the few hundred keys of a step, where
    a torch op costs more in dispatch than in work."""
    out = _first_xorshift(x)
    _mix32_rest(out, np.empty_like(out))
    return out


def _mix32_rest(x: np.ndarray, scratch: np.ndarray) -> None:
    """`mix32_` in place on uint32 words after its first xorshift (`_first_xorshift`): numpy's uint32
    shifts are logical and its products wrap mod 2^32, the bits of the int64 form with its masks."""
    (_, first), (shift, second) = _ROUNDS
    np.multiply(x, np.uint32(first), out=x)
    np.bitwise_xor(x, np.right_shift(x, shift, out=scratch), out=x)
    np.multiply(x, np.uint32(second), out=x)
    np.bitwise_xor(x, np.right_shift(x, _LAST_SHIFT, out=scratch), out=x)


def _first_xorshift(x: np.ndarray) -> np.ndarray:
    """x ^ (x >> 16), `mix32_`'s first step, of uint32 words. It is linear over xor, so that of
    state ^ word is that of state ^ that of word: done once per row and once per token id."""
    return x ^ (x >> np.uint32(_ROUNDS[0][0]))


#: (vocab, device) -> the per-token hash words [2, vocab] int64, the same for every step.
_TOKEN_WORDS: dict[tuple[int, str], torch.Tensor] = {}
#: vocab -> `token_words32`.
_TOKEN_WORDS32: dict[int, np.ndarray] = {}


def token_words(vocab: int, device: torch.device | str) -> torch.Tensor:
    """mix32(2 * token) and mix32(2 * token + 1) for every token id [2, vocab] (cached per device)."""
    key = (vocab, str(device))
    if key not in _TOKEN_WORDS:
        token = torch.arange(vocab, dtype=torch.int64, device=device)
        _TOKEN_WORDS[key] = torch.stack([mix32(2 * token), mix32(2 * token + 1)])
    return _TOKEN_WORDS[key]


def token_words32(vocab: int) -> np.ndarray:
    """`token_words` on CPU after `_first_xorshift`, uint32 numpy [2, vocab] (cached)."""
    if vocab not in _TOKEN_WORDS32:
        _TOKEN_WORDS32[vocab] = _first_xorshift(token_words(vocab, "cpu").numpy().astype(np.uint32))
    return _TOKEN_WORDS32[vocab]


def hash_span(out: np.ndarray, state: np.ndarray, words: np.ndarray, start: int, scratch: np.ndarray) -> None:
    """The two hash words of the flat tokens start .. start + L - 1 of the row-major [N, vocab] grid into
    out [2, L] uint32: high = mix32(state ^ word0) and low = 2 * (mix32(state ^ word1) >> 11) + 1, so
    bits + 0.5 = (2^22 high + low) / 2 (state: `state_words` of the rows' `key_state`, words:
    `token_words32`); tokens past N * vocab get the words of u = 1/2. scratch: uint32 [2, >= L].
    """
    vocab = words.shape[1]
    real = max(min(out.shape[1], state.shape[0] * vocab - start), 0)
    done = 0
    row, column = divmod(start, vocab)
    if column and real:  # the end of a row begun in an earlier span
        done = min(vocab - column, real)
        np.bitwise_xor(words[:, column:column + done], state[row], out=out[:, :done])
        row += 1
    if (full := (real - done) // vocab):  # whole rows at once
        rows = out[:, done:done + full * vocab].reshape(2, full, vocab)  # a view: splits the last axis
        np.bitwise_xor(words[:, None, :], state[row:row + full, None], out=rows)
        done, row = done + full * vocab, row + full
    if done < real:  # the start of a row that goes on in the next span
        np.bitwise_xor(words[:, :real - done], state[row], out=out[:, done:real])
    _mix32_rest(out[:, :real], scratch[:, :real])
    np.bitwise_or(np.right_shift(out[1, :real], 10, out=out[1, :real]), 1, out=out[1, :real])
    out[0, real:] = 1 << 31  # 2^22 * 2^31 = 2^53 = 2 * 2^52: u = 1/2, finite logs
    out[1, real:] = 0


def state_words(state: torch.Tensor) -> np.ndarray:
    """Row states [N] int64 in [0, 2^32) after `_first_xorshift`, uint32 numpy (for `hash_span`)."""
    return _first_xorshift(state.cpu().numpy().astype(np.uint32))


#: each thread's span buffers (`HashSpans`), kept between calls: 6 MB of fresh pages a call otherwise.
_BUFFERS = threading.local()


class HashSpans:
    """u of the row-major [N, vocab] token grid on CPU (rows' states [N] int64), `HASH_SPAN` tokens
    at a time (`uniform_`), in the thread's buffers: one instance in use per thread at a time.
    `spare` [HASH_SPAN] float64 is free between calls of `uniform_`."""

    def __init__(self, state: torch.Tensor, vocab: int) -> None:
        self.states, self.words = state_words(state), token_words32(vocab)
        if not hasattr(_BUFFERS, "hashed"):
            with torch.inference_mode(False):  # normal tensors: updated in place in and out of the mode
                _BUFFERS.hashed = torch.empty(2, HASH_SPAN, dtype=torch.uint32)
                _BUFFERS.spare = torch.empty(HASH_SPAN, dtype=torch.float64)
            _BUFFERS.scratch = np.empty((2, _HASH_PART), np.uint32)
        self.hashed, self.scratch, self.spare = _BUFFERS.hashed, _BUFFERS.scratch, _BUFFERS.spare

    def uniform_(self, out: torch.Tensor, start: int) -> torch.Tensor:
        """u of the flat tokens start .. start + L - 1 into out [L <= HASH_SPAN] float64, in place.

        u = (2^22 high + low) * 2^-54 (`hash_span`'s words): float64 of each word and the product are
        exact, and the sum 2 bits + 1 (below 2^54) rounds once, to twice the rounding of bits + 0.5
        anywhere else, so this is the (bits + 0.5) / 2^53 of every device. Every op is exact or
        correctly rounded, so any thread split gives the same bits.
        """
        hashed, low = self.hashed[:, :out.numel()], self.spare[:out.numel()]
        for part in range(0, out.numel(), _HASH_PART):
            hash_span(hashed[:, part:part + _HASH_PART].numpy(), self.states, self.words, start + part,
                      self.scratch)
        out.copy_(hashed[0])
        low.copy_(hashed[1])  # converted first: an add of uint32 and float64 takes a slow mixed-type loop
        torch.add(low, out, alpha=2.0**22, out=out)
        return out.mul_(2.0**-54)


def uniform(state: torch.Tensor, vocab: int, align: int = 1) -> torch.Tensor:
    """u [N * vocab + padding] float64 in (0, 1), row-major; padded to `align` with u = 1/2 (finite
    logs). On CPU `HASH_SPAN` tokens at a time (`HashSpans`), elsewhere all at once: the same bits.
    """
    rows, total = state.shape[0], state.shape[0] * vocab
    flat = torch.empty(total + (-total) % align, dtype=torch.float64, device=state.device)
    if state.device.type == "cpu":
        spans = HashSpans(state, vocab)
        for start in range(0, flat.numel(), HASH_SPAN):
            spans.uniform_(flat[start:start + HASH_SPAN], start)
        return flat
    flat[total:] = 2.0**52  # padding: u = 1/2 after the scaling below
    column = state.unsqueeze(1)
    words = token_words(vocab, state.device)
    high, low = column ^ words[0], column ^ words[1]
    scratch = torch.empty_like(high)
    mix32_(high, scratch)
    mix32_(low, scratch)
    high.bitwise_left_shift_(21).bitwise_or_(low.bitwise_right_shift_(11))
    flat[:total].view(rows, vocab).copy_(high)  # int64 -> float64: exact below 2^53
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


def log_softmax_then_draw(logits: torch.Tensor, state: torch.Tensor, noisy: torch.Tensor,
                          log_softmax: Callable[[torch.Tensor], torch.Tensor],
                          draw: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The two ops a fused draw stands for: `draw` on `log_softmax` of the float32 logits [N, V], with
    the drawn tokens' log-probs: tokens [N] int64, log-probs [N] float32 (the caller's kernels)."""
    processed = log_softmax(logits.to(torch.float32))
    tokens = draw(processed, state, noisy)
    return tokens, processed.gather(1, tokens.unsqueeze(1)).squeeze(1)
