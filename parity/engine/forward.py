"""The one model call the engine and the training forward share: packed tokens in, logits out."""

from __future__ import annotations

import torch

from parity.kernels.attention import AttentionBatch, KVCache
from parity.models.loading import LoadedModel


def final_hidden(lm: LoadedModel, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache,
                 slots: torch.Tensor, span: int | None = None, max_run: int | None = None) -> torch.Tensor:
    """Last-layer hidden states [B * L, H] of input_ids, position_ids [B, L].

    Token (b, l) is written at (slots[b * L + l], position_ids[b, l]) and attends to its slot up to
    its position. span (cached positions read, whole blocks) and max_run (longest run bound): None
    reads them off the device (a host sync); larger values change no invariant result.
    """
    positions = position_ids.reshape(-1)
    if span is None or max_run is None:
        batch = AttentionBatch.make(cache, slots, positions)
    else:
        batch = AttentionBatch(cache=cache, slots=slots, positions=positions, span=span, max_run=max_run)
    out = lm.model.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, parity_batch=batch)
    hidden = out.last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1])


def head(lm: LoadedModel, hidden: torch.Tensor) -> torch.Tensor:
    """LM-head logits [N, V] in the model's dtype of hidden rows [N, H] (only the rows asked for)."""
    return lm.model.lm_head(hidden)


def logits(lm: LoadedModel, hidden: torch.Tensor) -> torch.Tensor:
    """LM-head logits [N, V] in float32 of hidden rows [N, H]."""
    return head(lm, hidden).to(torch.float32)
