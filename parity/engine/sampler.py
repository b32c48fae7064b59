"""Token log-probabilities and sampling, shared by the engine and the training forward.

`processed_logprobs` and `reported_logprobs` are the one definition of both sides, row by row
(a stable per-row sort and the softmax family's fixed-order reductions: a stock CUDA scan picks
its block shape from the row count). Sampling noise hashes (seed, sample index, position, token
id), so a sample never depends on its batch; the hash bits are device-independent, the two
float64 logs per device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from parity.core.errors import ConfigError
from parity.engine.inputs import device_tensor, to_device
from parity.kernels import ops
from parity.kernels.sampling import mix32_words

NEG_INF = float("-inf")
#: the lowest temperature above 0 that samples: logits / temperature stay finite in float32 for every
#: |logit| up to 3.4e8 (below it a row overflows to inf and its log-probs are NaN; 0 is greedy).
MIN_TEMPERATURE = 1e-30
#: seeds are hashed as 64-bit words (`key_state`): a larger seed would draw the noise of seed mod 2^64.
SEED_LIMIT = 2**64


def check_temperature(temperature: float, where: str) -> None:
    """ConfigError for a temperature in (0, `MIN_TEMPERATURE`): its scaled logits overflow float32."""
    if 0 < temperature < MIN_TEMPERATURE:
        raise ConfigError(f"{where}: temperature {temperature!r} is below {MIN_TEMPERATURE:g}, where "
                          "logits / temperature overflow float32 and every log-prob is NaN; use "
                          f"temperature=0 (greedy) or at least {MIN_TEMPERATURE:g}")


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

    logits [N, V] float32 (float64 in the gold: the exact temperature). Temperature 0 is a point
    mass on the first argmax. Top-k keeps ties of the k-th; top-p keeps tokens (vocab order on ties)
    while the mass before them is < top_p.
    """
    device = logits.device
    greedy = [t == 0 for t in params.temperature]
    scale = [1.0 if g else t for g, t in zip(greedy, params.temperature)]
    # x / 1 == x exactly in IEEE arithmetic: at temperature 1 the division (a pass over [N, V]) is skipped.
    z = logits
    if any(t != 1.0 for t in scale):
        z = logits / device_tensor(scale, logits.dtype, device).unsqueeze(1)
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


def reported_table(logits: torch.Tensor, processed: torch.Tensor, modes: list[str]) -> torch.Tensor:
    """The logprobs [N, V] of each row in that row's logprobs mode ("processed" or "raw")."""
    if "raw" not in modes:
        return processed
    raw_rows = device_tensor([m == "raw" for m in modes], torch.bool, logits.device).unsqueeze(1)
    return torch.where(raw_rows, raw_logprobs(logits), processed)


def reported_logprobs(logits: torch.Tensor, processed: torch.Tensor, tokens: torch.Tensor,
                      modes: list[str]) -> torch.Tensor:
    """The logprob [N] of each row's token (`tokens` [N]) in that row's mode ("processed" or "raw")."""
    return reported_table(logits, processed, modes).gather(1, tokens.unsqueeze(1)).squeeze(1)


def top_k_rows(table: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """The k most likely ids and logprobs of each row of `table` [N, V] (descending, ties to the lower
    id; min(k, V) per row) on the host: one device->host copy.

    The engine asks for the largest k of its batch and keeps each row's own first k, so the ids must
    not depend on k: `torch.topk` orders equal values by its algorithm, which follows k (CPU: a partial
    sort below V / 64, else a selection), and the -inf of every id a greedy or top-k row drops are all
    ties. A row of k=3 alone reported ids [489, 1, 0], beside a k=20 row [489, 343, 325]. Only the
    values come from topk (their multiset is tie-free); the ids are chosen and ordered canonically.
    """
    n, vocab = table.shape
    k = min(k, vocab)
    values = torch.topk(table, k, dim=-1).values
    kth = values[:, -1:]
    above = table > kth
    at = table == kth
    # of the ids equal to the k-th value, the lowest ones fill the row up to k
    at &= torch.cumsum(at, dim=1) <= k - above.sum(dim=1, keepdim=True)
    chosen = above | at
    if not bool(values.isnan().any()):
        ids = chosen.nonzero()[:, 1].view(n, k)  # ascending per row
        picked = table.gather(1, ids)
        order = torch.sort(picked, dim=1, descending=True, stable=True).indices
        ids, values = ids.gather(1, order), picked.gather(1, order)
    else:  # NaN compares neither above nor equal: a full stable sort, NaN first as in topk
        values, ids = torch.sort(table, dim=1, descending=True, stable=True)
        ids, values = ids[:, :k], values[:, :k]
    both = torch.stack([ids.to(torch.float64), values.to(torch.float64)]).tolist()
    return [[int(t) for t in row] for row in both[0]], both[1]


def key_state(keys: Sequence[tuple[int, int, int]], device: torch.device | str) -> torch.Tensor:
    """The hash state [N] int64 of each key (seed, sample index, position): the 32-bit words (the
    position, the sample index, the seed's high then low half) folded by `mix32`; the Gumbel noise
    of a row is a function of its state alone. Hashed on the host in numpy (a few hundred integers:
    ~60 us a step at 256 keys, against ~220 us as a dozen torch ops), then copied to `device`."""
    seeds, samples, positions = zip(*keys) if keys else ((), (), ())
    seed = _words(seeds, np.uint64)
    state = mix32_words(_words(positions, np.uint32))
    for word in (_words(samples, np.uint32), (seed >> np.uint64(32)).astype(np.uint32),
                 seed.astype(np.uint32)):
        state = mix32_words(word ^ state)
    return to_device(torch.from_numpy(state.astype(np.int64)), device)


def _words(values: Sequence[int], dtype: type[np.unsignedinteger]) -> np.ndarray:
    """values as unsigned words of `dtype`, each taken mod 2^bits (one conversion where all fit)."""
    try:
        return np.array(values, dtype=dtype)
    except OverflowError:  # a value past the width, or negative: its low bits
        mask = int(np.iinfo(dtype).max)
        return np.array([v & mask for v in values], dtype=dtype)


def sample(processed: torch.Tensor, keys: Sequence[tuple[int, int, int] | None]) -> torch.Tensor:
    """One token per row of processed log-probs [N, V] by the Gumbel-max trick -> [N] int64.

    Row i's noise comes from its key (seed, sample index, position) alone; a None key (greedy) gets
    masked dummy noise, so nothing per row reaches the host. Ties go to the lower id. On CUDA one
    Triton kernel draws and takes the argmax.
    """
    device = processed.device
    state = key_state([key or (0, 0, 0) for key in keys], device)
    noisy = device_tensor([key is not None for key in keys], torch.bool, device)
    return ops.gumbel_argmax(processed, state, noisy)


def plain(params: RowParams) -> bool:
    """Whether every row samples log_softmax of its logits as they are: temperature 1, no top-k or
    top-p (its processed and raw log-probs are then one table)."""
    return (all(t == 1.0 for t in params.temperature) and not any(k > 0 for k in params.top_k)
            and all(p >= 1 for p in params.top_p))


def sample_plain(logits: torch.Tensor,
                 keys: Sequence[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample(processed_logprobs(logits))` for `plain` rows of logits [N, V] in the model's dtype, and
    the drawn tokens' log-probs: tokens [N] int64, log-probs [N] float32, the same bits (one fused
    pass over the logits on CUDA: `ops.log_softmax_draw`)."""
    state = key_state(keys, logits.device)
    noisy = torch.ones(len(keys), dtype=torch.bool, device=logits.device)
    return ops.log_softmax_draw(logits, state, noisy)
