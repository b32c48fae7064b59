"""The trainer's side of the monitor's full-distribution drift: its log_softmax rows reduced on
their device at the rollout's top-k ids (`train_top_k`). Torch; never imported by the package.
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
    """The trainer's side of `Monitor.log(..., train_top_k=)`: a `TrainerView` of the counted positions.

    train_logprobs: torch `[batch, response_len, V]` under the rollout's processing, any device;
    rollout_top_k_ids `[batch, response_len, k]`; responses `[batch, response_len]`. Per micro-batch,
    pass the list in batch order.
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
