"""The trainer's full distribution at each response position, reduced on its device to the
`parity.drift.distribution.TrainerView` the full-distribution drift reads (the same reduction as
NumPy's `trainer_view`, so `[N, V]` rows never leave the device)."""

from __future__ import annotations

import numpy as np
import torch

from parity.drift.distribution import TrainerView
from parity.engine.sampler import top_k_rows


def device_view(table: torch.Tensor, engine_ids: torch.Tensor, sampled: torch.Tensor) -> TrainerView:
    """`TrainerView` of logprob rows `table` [N, V] (the rollout's processing, -inf outside the support),
    the engine's top-k ids [N, k] int64 and the sampled ids [N] int64, on `table`'s device; entropy
    in float64. The trainer's own top-k breaks ties to the lower id, as the engine's (`top_k_rows`) and
    NumPy's `trainer_view` do, so tied rows name the same ids on both sides."""
    rows = table.double()
    n, k = rows.shape[0], min(engine_ids.shape[1], rows.shape[1])
    top = top_k_rows(rows, k) if n and k else ([], [])
    ids, values = np.asarray(top[0], np.int64).reshape(n, k), np.asarray(top[1], np.float64).reshape(n, k)
    probs = rows.exp()
    entropy = -torch.where(probs > 0, probs * rows, torch.zeros_like(rows)).sum(dim=1)
    chosen = rows.gather(1, sampled.unsqueeze(1))
    rank = (rows > chosen).sum(dim=1)

    def host(x: torch.Tensor) -> np.ndarray:
        return x.cpu().numpy()

    return TrainerView(at_engine=host(rows.gather(1, engine_ids)), top_ids=ids,
                       top_logprobs=values, entropy=host(entropy), sampled_rank=host(rank),
                       sampled_ids=host(sampled))
