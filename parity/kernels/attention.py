"""The "parity" attention function for HF models, over parity's own KV cache.

Registered with `transformers.AttentionInterface` as `"parity"`. A caller packs every token of
a step (any mix of sequences, prefill chunks and decode tokens) into one forward and passes an
`AttentionBatch` as the `parity_batch` keyword of `model(...)`; transformers hands it down to
this function in every layer. Each token is written to the cache at (its sequence slot, its
absolute position) and attends to its own slot's positions 0..position. Family "attention" on:
the block-ordered online softmax of the device's invariant kernel; off: stock SDPA over the
same cache.

Without `parity_batch` (a plain `model(input_ids)` or `generate` call) each batch row is one
unpadded sequence whose queries are the last positions of the keys HF passes in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, PretrainedConfig

from parity.kernels.switch import impl

#: name under which the attention function is registered with transformers.
ATTENTION_NAME = "parity"
#: KV positions per block: cache capacity and the span a step reads are multiples of it.
KV_BLOCK = 32


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
    def capacity(self) -> int:
        return self.keys[0].shape[2]


@dataclass(frozen=True)
class AttentionBatch:
    """Where each token of a packed forward lives: slots, positions [T] int64 (T = batch * seq tokens).

    span: cached positions the step reads, the highest position rounded up to whole blocks.
    """

    cache: KVCache
    slots: torch.Tensor
    positions: torch.Tensor
    span: int

    @classmethod
    def make(cls, cache: KVCache, slots: torch.Tensor, positions: torch.Tensor) -> AttentionBatch:
        span = (int(positions.max()) // cache.block + 1) * cache.block
        return cls(cache=cache, slots=slots, positions=positions, span=span)


def attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
           positions: torch.Tensor, span: int, scaling: float) -> torch.Tensor:
    """query [T, Hq, D] over cached K/V [S, Hkv, C, D] -> [T, Hq, D]; causal by absolute position.

    Reads cached positions [0, span) of each token's slot; span must exceed every position.
    """
    fn = impl("attention", "attention", query.device.type)
    if fn is not None:
        return fn(query, k_cache, v_cache, slots, positions, span, scaling)
    keys = k_cache[slots, :, :span]  # [T, Hkv, span, D]
    values = v_cache[slots, :, :span]
    visible = torch.arange(span, device=query.device).unsqueeze(0) <= positions.unsqueeze(1)
    out = F.scaled_dot_product_attention(query.unsqueeze(2), keys, values,
                                         attn_mask=visible[:, None, None, :], scale=scaling, enable_gqa=True)
    return out.squeeze(2)


def parity_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                     **kwargs: object) -> tuple[torch.Tensor, None]:
    """HF attention-function signature: query [B, Hq, L, D], key/value [B, Hkv, S, D] -> [B, L, Hq, D].

    S = L when a `parity_batch` is given (this step's tokens only); otherwise S >= L keys of
    which the queries are the last L positions. The second return value (attention weights) is None.
    """
    b, hq, length, d = query.shape
    q = query.transpose(1, 2).reshape(b * length, hq, d)
    batch = kwargs.get("parity_batch")
    if isinstance(batch, AttentionBatch):
        k_cache = batch.cache.keys[module.layer_idx]
        v_cache = batch.cache.values[module.layer_idx]
        hkv = key.shape[1]
        k_cache[batch.slots, :, batch.positions] = key.transpose(1, 2).reshape(-1, hkv, d)
        v_cache[batch.slots, :, batch.positions] = value.transpose(1, 2).reshape(-1, hkv, d)
        out = attend(q, k_cache, v_cache, batch.slots, batch.positions, batch.span, scaling)
    else:
        total = key.shape[2]
        capacity = -(-total // KV_BLOCK) * KV_BLOCK
        pad = (0, 0, 0, capacity - total)
        slots = torch.arange(b, device=q.device).repeat_interleave(length)
        positions = (torch.arange(length, device=q.device) + (total - length)).repeat(b)
        out = attend(q, F.pad(key, pad), F.pad(value, pad), slots, positions, capacity, scaling)
    return out.view(b, length, hq, d), None


AttentionInterface.register(ATTENTION_NAME, parity_attention)
