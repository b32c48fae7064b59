"""The trainer's side of the monitor's full-distribution drift (`parity.monitor.top_k`): its
log_softmax rows reduced, on their device, at the rollout's top-k ids (`train_top_k`).

Torch (the rows are the trainer's tensors); imported on use, never by `import parity.monitor`.
"""

from __future__ import annotations

from typing import Any

import torch

from parity.core.errors import InputError
from parity.drift.distribution import TrainerView
from parity.engine.views import device_view
from parity.monitor.arrays import host_array
from parity.monitor.top_k import token_ids


def train_top_k(train_logprobs: Any, rollout_top_k_ids: Any, responses: Any, response_mask: Any
                ) -> TrainerView:
    """The trainer's side of `Monitor.log(..., train_top_k=)`: its rows reduced at the counted positions.

    train_logprobs: torch tensor `[batch, response_len, V]`, the trainer's log_softmax under the
        rollout's processing (temperature applied, -inf outside a top-k/top-p support); any device,
        the reduction runs there. rollout_top_k_ids: `[batch, response_len, k]` the rollout's top-k
        ids; responses: `[batch, response_len]` the sampled ids; response_mask: 1 where a token counts.
    Returns a `TrainerView` of the counted positions in row-major order (`[N, k]`, `[N]`, on the
    host). For micro-batches, call it per micro-batch and pass the list, in batch order.
    """
    if not isinstance(train_logprobs, torch.Tensor) or train_logprobs.ndim != 3:
        raise InputError("train_logprobs must be a torch tensor [batch, response_len, vocab] (the trainer's "
                         f"log_softmax rows), got {getattr(train_logprobs, 'shape', type(train_logprobs))}")
    batch, length, vocab = train_logprobs.shape
    ids = token_ids(rollout_top_k_ids, "rollout_top_k_ids", (batch, length), top_k=True)
    sampled = token_ids(responses, "responses", (batch, length))
    mask = host_array(response_mask, "response_mask").astype(bool)
    if mask.shape != (batch, length):
        raise InputError(f"response_mask must be [{batch}, {length}] like train_logprobs, got "
                         f"{list(mask.shape)}")
    ids, sampled = ids[mask], sampled[mask]
    for name, values in (("rollout_top_k_ids", ids), ("responses", sampled)):
        if values.size and (values.min() < 0 or values.max() >= vocab):
            raise InputError(f"{name} holds an id outside the vocabulary [0, {vocab}) at a counted token; "
                             "the rollout's top-k and responses must come from the trainer's tokenizer")
    where = torch.as_tensor(mask, device=train_logprobs.device)
    device = train_logprobs.device
    return device_view(train_logprobs[where], torch.as_tensor(ids, device=device),
                       torch.as_tensor(sampled, device=device))
