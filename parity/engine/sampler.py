"""Token log-probabilities and sampling, shared by the engine and the training forward.

`processed_logprobs` and `reported_logprobs` are the one definition both sides use to turn logits
into log-probabilities, so with row-invariant logits they agree bit for bit. Every op in them
works row by row: elementwise ops, a stable per-row sort, and the softmax family's kernels for
each reduction over the vocabulary (the top-p prefix sum, the renormalizing sum, the
logsumexp), which fix their order of additions per row. A stock CUDA scan would not: it picks its
block shape from the row count, so a decode step and a training forward would round the top-p
mass differently.

Sampling noise is a counter-based hash of (request seed, sample index, absolute position, token
id), so a sample's tokens never depend on what else shares the batch. The hash bits are the same
on every device; the two float64 logs that turn them into Gumbel noise are each device's own
(torch on CPU, one Triton kernel on CUDA), so tokens could differ across devices only where two
noisy scores of a row come within a rounding of each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from parity.engine.inputs import device_tensor
from parity.kernels import ops
from parity.kernels.cpu import POINTWISE_ALIGN, pointwise_

NEG_INF = float("-inf")


@dataclass(frozen=True)
class RowParams:
    """Sampling parameters of each logits row: temperature >= 0 (0 = greedy), top_k >= 0 (0 = off),
    top_p in (0, 1] (1 = off). Kept on the host, so deciding which steps run costs no device sync."""

    temperature: tuple[float, ...]
    top_k: tuple[int, ...]
    top_p: tuple[float, ...]

    @classmethod
    def of(cls, temperature: Sequence[float], top_k: Sequence[int], top_p: Sequence[float]) -> RowParams:
        """From per-row sequences of values."""
        return cls(tuple(float(t) for t in temperature), tuple(int(k) for k in top_k),
                   tuple(float(p) for p in top_p))

    def repeat(self, counts: list[int]) -> RowParams:
        """Row i repeated counts[i] times (one row per response token of sequence i)."""
        return RowParams(*(tuple(v for v, c in zip(values, counts) for _ in range(c))
                           for values in (self.temperature, self.top_k, self.top_p)))


def processed_logprobs(logits: torch.Tensor, params: RowParams) -> torch.Tensor:
    """Log-probs [N, V] of the distribution sampled from: temperature, then top-k, then top-p, renormalized.

    logits [N, V] float32, or float64 in the gold forward: temperature and top-p are taken in the
    logits' dtype, so a float64 gold divides by the exact temperature. Temperature 0 (greedy) is a
    point mass on the first argmax: logprob 0 there and -inf elsewhere. Top-k keeps every token whose
    scaled logit ties the k-th largest. Top-p keeps the most likely tokens (ties in vocab order) while
    the mass before them is < top_p.
    """
    device = logits.device
    greedy = [t == 0 for t in params.temperature]
    temperature = device_tensor([1.0 if g else t for g, t in zip(greedy, params.temperature)],
                                logits.dtype, device)
    z = logits / temperature.unsqueeze(1)
    any_k = any(k > 0 for k in params.top_k)
    any_p = any(p < 1 for p in params.top_p)
    if any_k or any_p:
        sorted_z, order = torch.sort(z, dim=-1, descending=True, stable=True)
    if any_k:
        top_k = device_tensor(params.top_k, torch.int64, device)
        kth = sorted_z.gather(1, (top_k.clamp(min=1, max=z.shape[1]) - 1).unsqueeze(1))
        z = z.masked_fill((top_k > 0).unsqueeze(1) & (z < kth), NEG_INF)
    if any_p:
        top_p = device_tensor(params.top_p, logits.dtype, device).unsqueeze(1)
        # top-k masking removed only the smallest entries, so `order` still sorts the survivors.
        probs_sorted = ops.softmax(z).gather(1, order)
        mass_before = F.pad(ops.cumsum(probs_sorted)[:, :-1], (1, 0))
        drop_sorted = (top_p < 1) & (mass_before >= top_p)
        z = z.masked_fill(torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted), NEG_INF)
    logprobs = ops.log_softmax(z)
    if any(greedy):
        argmax = logits.argmax(dim=-1, keepdim=True)
        point = torch.full_like(logits, NEG_INF).scatter(1, argmax, 0.0)
        greedy_rows = device_tensor(greedy, torch.bool, device).unsqueeze(1)
        logprobs = torch.where(greedy_rows, point, logprobs)
    return logprobs


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax [N, V] of the unmodified logits [N, V] float32 (logprobs_mode "raw")."""
    return ops.log_softmax(logits)


def reported_logprobs(logits: torch.Tensor, processed: torch.Tensor, tokens: torch.Tensor,
                      modes: list[str]) -> torch.Tensor:
    """The logprob [N] of each row's token in that row's logprobs mode.

    logits, processed [N, V]; tokens [N] int64; modes: "processed" or "raw" (log_softmax of the
    unmodified logits) per row.
    """
    table = processed
    if "raw" in modes:
        raw_rows = device_tensor([m == "raw" for m in modes], torch.bool, logits.device).unsqueeze(1)
        table = torch.where(raw_rows, raw_logprobs(logits), processed)
    return table.gather(1, tokens.unsqueeze(1)).squeeze(1)


_MASK32 = 0xFFFFFFFF


def _mix32_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
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


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """`_mix32_` of a copy of x: for the small key and token-word tensors, where x may be a view."""
    return _mix32_(x.clone(), torch.empty_like(x))


def _key_state(keys: Sequence[tuple[int, int, int]], device: torch.device | str) -> torch.Tensor:
    """The hash state [N] int64 of each key (seed, sample index, position): 32-bit words folded by _mix32."""
    rows = device_tensor([[seed & _MASK32, (seed >> 32) & _MASK32, sample & _MASK32, position & _MASK32]
                          for seed, sample, position in keys], torch.int64, device).view(-1, 4)
    state = _mix32(rows[:, 3])
    for column in (2, 1, 0):
        state = _mix32(rows[:, column] ^ state)
    return state


#: (vocab, device) -> the per-token hash words [2, vocab] int64, the same for every step.
_TOKEN_WORDS: dict[tuple[int, str], torch.Tensor] = {}


def _token_words(vocab: int, device: torch.device | str) -> torch.Tensor:
    """_mix32(2 * token) and _mix32(2 * token + 1) for every token id [2, vocab] (cached per device)."""
    key = (vocab, str(device))
    if key not in _TOKEN_WORDS:
        token = torch.arange(vocab, dtype=torch.int64, device=device)
        _TOKEN_WORDS[key] = torch.stack([_mix32(2 * token), _mix32(2 * token + 1)])
    return _TOKEN_WORDS[key]


#: rows of the [N, vocab] hash computed at a time: two int64 rows of a 49k vocabulary (0.8 MB per
#: temporary) stay in cache and are updated in place, where whole-batch temporaries (12 MB each at
#: 32 x 49k, a dozen per step) are fresh allocations that fault in every page on every step.
_HASH_ROWS = 2


def gumbel_noise(keys: Sequence[tuple[int, int, int]], vocab: int, device: torch.device | str = "cpu"
                 ) -> torch.Tensor:
    """Gumbel noise [N, vocab] float64; row i is a function of keys[i] = (seed, sample index, position) only.

    Counter-based: each (key, token id) is hashed to 53 random bits, u = (bits + 0.5) / 2^53 lies
    in (0, 1), and the noise is -log(-log(u)), so no element's bits depend on its place in the
    batch. The logs run through `pointwise_` (every element in the vector body, never a scalar
    tail; a CUDA elementwise op runs the same code for every element, so this is only needed on
    CPU but harmless elsewhere).
    """
    rows, total = len(keys), len(keys) * vocab
    state = _key_state(keys, device).unsqueeze(1)
    words = _token_words(vocab, device)
    flat = torch.empty(total + (-total) % POINTWISE_ALIGN, dtype=torch.float64, device=device)
    flat[total:] = 2.0**52  # padding: u = 1/2 after the scaling below, so its logs stay finite
    bits = flat[:total].view(rows, vocab)
    for start in range(0, rows, _HASH_ROWS):
        block = state[start:start + _HASH_ROWS]
        high, low = block ^ words[0], block ^ words[1]
        scratch = torch.empty_like(high)
        _mix32_(high, scratch)
        _mix32_(low, scratch)
        high.bitwise_left_shift_(21).bitwise_or_(low.bitwise_right_shift_(11))
        bits[start:start + _HASH_ROWS].copy_(high)  # int64 -> float64: exact below 2^53
    flat.add_(0.5).div_(2.0**53)
    pointwise_(lambda u: u.log_().neg_().log_().neg_(), flat)
    return bits


def sample(processed: torch.Tensor, keys: Sequence[tuple[int, int, int] | None]) -> torch.Tensor:
    """One token per row of processed log-probs [N, V] by the Gumbel-max trick -> [N] int64.

    Row i's Gumbel noise comes from its key (seed, sample index, position) alone; a None key
    (greedy) adds no noise. Ties go to the lower token id. All rows are drawn at once: a greedy
    row gets the noise of a dummy key, masked off, so no per-row indexing reaches the host. On
    CUDA one Triton kernel draws the same noise and takes the argmax without writing the noise
    to memory (`parity.kernels.triton.sampling`).
    """
    device = processed.device
    noisy = [key is not None for key in keys]
    if device.type == "cuda":
        from parity.kernels.triton.sampling import gumbel_argmax

        state = _key_state([key or (0, 0, 0) for key in keys], device)
        return gumbel_argmax(processed, state, device_tensor(noisy, torch.bool, device))
    if not any(noisy):
        return processed.argmax(dim=-1)
    # noise + float64(score) in place of score + noise: the same sum (IEEE addition commutes, and
    # float32 -> float64 is exact), without two more [N, V] float64 temporaries.
    noise = gumbel_noise([key or (0, 0, 0) for key in keys], processed.shape[1], device)
    if not all(noisy):
        noise.masked_fill_(~device_tensor(noisy, torch.bool, device).unsqueeze(1), 0.0)
    return noise.add_(processed).argmax(dim=-1)
