"""The "parity" attention function for HF models, over parity's own KV cache.

A caller packs a step's tokens into one forward with an `AttentionBatch` (`parity_batch`); each
token is written at (its slot, its absolute position) and attends to its slot's positions
0..position. Family on: the device's invariant online softmax; off: stock SDPA (flash reading
slots in place on CUDA fp16/bf16, `flash_over_cache`, no invariance claim; else `gathered_sdpa`).
Without `parity_batch` each row is one unpadded sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, PretrainedConfig

from parity.core.errors import BackendUnavailableError
from parity.kernels.grad import exact, needs_grad
from parity.kernels.switch import impl

#: name under which the attention function is registered with transformers.
ATTENTION_NAME = "parity"
#: KV positions per block: cache capacity and the span a step reads are multiples of it.
KV_BLOCK = 32
#: a step's varlen batch for flash (`varlen_entries`): cu_q, cu_k, used.
Entries = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class KVCache:
    """Per-layer keys and values, each [slots, kv_heads, capacity, head_dim], at absolute positions."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    block: int = KV_BLOCK

    @classmethod
    def allocate(cls, config: PretrainedConfig, num_slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str, block: int = KV_BLOCK) -> KVCache:
        """Zeroed cache for `num_slots` sequences of up to `max_len` positions (rounded up to `block`)."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        capacity = -(-max_len // block) * block
        shape = (num_slots, config.num_key_value_heads, capacity, head_dim)
        layers = range(config.num_hidden_layers)
        return cls(keys=tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in layers),
                   values=tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in layers),
                   block=block)

    @property
    def num_slots(self) -> int:
        return self.keys[0].shape[0]

    @property
    def kv_heads(self) -> int:
        return self.keys[0].shape[1]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]


@dataclass(frozen=True)
class AttentionBatch:
    """Where each token of a packed forward lives: slots, positions [T] int64. The stock paths size
    launches by span (cached positions read, whole blocks) and max_run (longest run bound).
    """

    cache: KVCache
    slots: torch.Tensor
    positions: torch.Tensor
    span: int
    max_run: int

    @cached_property
    def flash_entries(self) -> Entries:
        """`varlen_entries` of this step, made once per forward (every layer reads the same runs);
        compacted to one entry per run outside CUDA-graph capture."""
        return varlen_entries(self.slots, self.positions, self.cache.kv_heads, self.cache.capacity,
                              compact=not _capturing(self.slots))

    @cached_property
    def kv_rows(self) -> torch.Tensor:
        """[T, Hkv] rows of each token's key (and value) in a layer's cache viewed as [S * Hkv * C, D]."""
        hkv = self.cache.kv_heads
        heads = torch.arange(hkv, device=self.slots.device)
        return (self.slots[:, None] * hkv + heads) * self.cache.capacity + self.positions[:, None]

    @classmethod
    def make(cls, cache: KVCache, slots: torch.Tensor, positions: torch.Tensor) -> AttentionBatch:
        """Span and longest run read off the device (a host sync)."""
        span = (int(positions.max()) // cache.block + 1) * cache.block
        _, ends = _runs(slots, positions)
        max_run = int((ends - torch.arange(ends.shape[0], device=ends.device)).max())
        return cls(cache=cache, slots=slots, positions=positions, span=span, max_run=max_run)


def _capturing(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def native_reads_span(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the stock attention's launch depends on `span` (gathered SDPA) rather than on
    `max_run` (flash over the cache): CUDA graphs of a step are captured per value of that fact."""
    return not _flash_fits(torch.device(device).type, dtype)


def _flash_fits(device_type: str, dtype: torch.dtype) -> bool:
    return device_type == "cuda" and dtype in (torch.float16, torch.bfloat16)


def _runs(slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether each token [T] starts a run, and one past its run's last token (device ops only)."""
    t = slots.shape[0]
    index = torch.arange(t, device=slots.device)
    starts = torch.ones(t, dtype=torch.bool, device=slots.device)
    starts[1:] = (slots[1:] != slots[:-1]) | (positions[1:] != positions[:-1] + 1)
    # the first run start at or after each token, by a reversed running minimum
    next_start = torch.where(starts, index, t).flip(0).cummin(0).values.flip(0)
    return starts, torch.cat([next_start[1:], next_start.new_full((1,), t)])


def write_kv(k_rows: torch.Tensor, v_rows: torch.Tensor, rows: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor) -> None:
    """k_rows[rows] = key and v_rows[rows] = value: a layer's caches viewed as [S * Hkv * C, D], rows
    [N] (`AttentionBatch.kv_rows`), key/value [N, D]; one launch where the device has one (not
    under autograd: the stock copies carry the keys' and values' gradients)."""
    try:
        fn = None if needs_grad(key, value) else impl("attention", "write_kv", key.device.type)
    except BackendUnavailableError:  # a device registered (`kernels.register`) without a cache write
        fn = None
    if fn is not None:
        fn(k_rows, v_rows, rows, key, value)
        return
    # one row copy per (token, KV head): an indexed assignment would launch a gather-scatter pair
    k_rows.index_copy_(0, rows, key)
    v_rows.index_copy_(0, rows, value)


def attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
           positions: torch.Tensor, span: int, max_run: int, scaling: float,
           entries: Callable[[], Entries] | None = None) -> torch.Tensor:
    """query [T, Hq, D] over cached K/V [S, Hkv, C, D] -> [T, Hq, D], causal by absolute position."""
    fn = impl("attention", "attention", query.device.type)
    if fn is not None:
        # under autograd: the kernel's bits, the gathered SDPA's derivative (parity.kernels.grad)
        return exact(lambda: fn(query, k_cache, v_cache, slots, positions, span, scaling, max_run=max_run),
                     lambda q, k, v: gathered_sdpa(q, k, v, slots, positions, span, scaling),
                     query, k_cache, v_cache)
    if _flash_fits(query.device.type, query.dtype):
        return flash_over_cache(query, k_cache, v_cache, slots, positions, max_run, scaling,
                                entries() if entries else None)
    return gathered_sdpa(query, k_cache, v_cache, slots, positions, span, scaling)


def flash_over_cache(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor, max_run: int, scaling: float,
                     entries: Entries | None = None) -> torch.Tensor:
    """Stock flash attention (torch's varlen kernel) reading each run's slot in place: query [T, Hq, D]
    over K/V [S, Hkv, C, D] -> [T, Hq, D], nothing copied.

    A run's first token owns its queries and reads keys 0..last through `cache_rows`; the causal mask
    is bottom-right aligned, so query i of L sees keys up to its own position. Flash's tiling follows
    the batch: the fast baseline, no invariance claim. Steps above MAX_FLASH_ENTRIES run in slices.
    """
    if query.shape[0] > MAX_FLASH_ENTRIES:
        # one launch per slice of tokens: a run cut in two is two runs, each still ending at its
        # own last position, so the bottom-right causal mask stays right
        return torch.cat([flash_over_cache(query[i:i + MAX_FLASH_ENTRIES], k_cache, v_cache,
                                           slots[i:i + MAX_FLASH_ENTRIES], positions[i:i + MAX_FLASH_ENTRIES],
                                           max_run, scaling)
                          for i in range(0, query.shape[0], MAX_FLASH_ENTRIES)])
    cu_q, cu_k, used = entries or varlen_entries(slots, positions, k_cache.shape[1], k_cache.shape[2])
    return torch.ops.aten._flash_attention_forward(
        query, cache_rows(k_cache), cache_rows(v_cache), cu_q, cu_k, max_run, k_cache.shape[2], 0.0, True,
        False, scale=scaling, seqused_k=used)[0]


#: varlen entries per flash launch: the kernel's grid puts them on its y axis (at most 65535 blocks).
MAX_FLASH_ENTRIES = 65535


def cache_rows(cache: torch.Tensor) -> torch.Tensor:
    """A contiguous [S, Hkv, C, D] cache as flash's key layout [R, Hkv, D], no copy: row
    s * Hkv * C + p, head h is slot s's key at position p of head h (row stride D, head stride C * D)."""
    num_slots, hkv, capacity, d = cache.shape
    return cache.as_strided(((num_slots - 1) * hkv * capacity + capacity, hkv, d), (d, capacity * d, 1))


def varlen_entries(slots: torch.Tensor, positions: torch.Tensor, kv_heads: int, capacity: int,
                   compact: bool = False) -> Entries:
    """The varlen batch of `flash_over_cache`, int32: cu_q [T + 1] (a run's first token owns its rows),
    cu_k [T + 1] (its slot's position 0 in `cache_rows`), used [T] (keys read). compact: one entry
    per run (a host sync, never inside a CUDA graph).
    """
    t = slots.shape[0]
    starts, ends = _runs(slots, positions)
    index = torch.arange(t, device=slots.device)
    if compact:
        first = index[starts]  # one entry per run, at its first token
        entry_slots, entry_ends = slots[first], ends[first]
    else:
        first = torch.where(starts, index, ends)  # a run's first token owns the run; the others none
        entry_slots, entry_ends = slots, ends
    cu_q = torch.cat([first, first.new_full((1,), t)])
    cu_k = torch.cat([entry_slots * (kv_heads * capacity), first.new_zeros(1)])
    return cu_q.to(torch.int32), cu_k.to(torch.int32), (positions[entry_ends - 1] + 1).to(torch.int32)


def gathered_sdpa(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                  positions: torch.Tensor, span: int, scaling: float) -> torch.Tensor:
    """Stock SDPA over each token's own copy of its slot's first `span` positions: query [T, Hq, D]
    over K/V [S, Hkv, C, D] -> [T, Hq, D] (the gather copies T * Hkv * span * D elements a layer)."""
    keys = k_cache[slots, :, :span]  # [T, Hkv, span, D]
    values = v_cache[slots, :, :span]
    visible = torch.arange(span, device=query.device).unsqueeze(0) <= positions.unsqueeze(1)
    out = F.scaled_dot_product_attention(query.unsqueeze(2), keys, values,
                                         attn_mask=visible[:, None, None, :], scale=scaling, enable_gqa=True)
    return out.squeeze(2)


def parity_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                     **kwargs: object) -> tuple[torch.Tensor, None]:
    """HF attention-function signature: query [B, Hq, L, D], key/value [B, Hkv, S, D] -> [B, L, Hq, D]
    (S = L with `parity_batch`, else queries are the last L positions); weights None.
    """
    b, hq, length, d = query.shape
    q = query.transpose(1, 2).reshape(b * length, hq, d)
    batch = kwargs.get("parity_batch")
    if isinstance(batch, AttentionBatch):
        k_cache = batch.cache.keys[module.layer_idx]
        v_cache = batch.cache.values[module.layer_idx]
        write_kv(k_cache.view(-1, d), v_cache.view(-1, d), batch.kv_rows.reshape(-1),
                 key.transpose(1, 2).reshape(-1, d), value.transpose(1, 2).reshape(-1, d))
        out = attend(q, k_cache, v_cache, batch.slots, batch.positions, batch.span, batch.max_run, scaling,
                     lambda: batch.flash_entries)
    else:
        total = key.shape[2]
        capacity = -(-total // KV_BLOCK) * KV_BLOCK
        pad = (0, 0, 0, capacity - total)
        slots = torch.arange(b, device=q.device).repeat_interleave(length)
        positions = (torch.arange(length, device=q.device) + (total - length)).repeat(b)
        out = attend(q, F.pad(key, pad), F.pad(value, pad), slots, positions, capacity, length, scaling)
    return out.view(b, length, hq, d), None


AttentionInterface.register(ATTENTION_NAME, parity_attention)
