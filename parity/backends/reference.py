"""parity's own batch-invariant engine behind the backend contract: the zero-mismatch baseline.

No translation is needed: the engine speaks parity's `Request`/`Rollout` natively (per-sample
noise keyed by (seed, sample index, position), both logprob modes, routes). `score` is the
training forward itself, so with invariant kernels `score(rollouts)` equals the rollouts'
logprobs bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch

import parity
from parity.backends.base import Backend, check_score_mode
from parity.types import Request, Rollout


class ReferenceBackend(Backend):
    """`parity.engine.ReferenceEngine` for generate, `parity.engine.train_forward` for score.

    kernels: "invariant" (the baseline) or "native" (stock torch ops, for contrast).
    record_routes: return MoE routed experts per position.
    """

    name = "reference"

    def __init__(self, model: str | Path, *, dtype: str = "bfloat16", device: str = "cpu",
                 kernels: str = "invariant", max_num_seqs: int = 16, chunk_size: int = 64,
                 record_routes: bool = False) -> None:
        super().__init__(model, dtype=dtype)
        from parity.engine import ReferenceEngine

        self._engine = ReferenceEngine(self.model_path, dtype=dtype, device=device, kernels=kernels,
                                       max_num_seqs=max_num_seqs, chunk_size=chunk_size,
                                       record_routes=record_routes)
        self.kernels = kernels
        self.device = device
        self.meta.update({
            "backend_version": parity.__version__, "torch_version": torch.__version__, "device": device,
            "attention_backend": f"parity ({kernels})", "batch_invariant": kernels == "invariant",
            "tensor_parallel_size": 1, "enable_prefix_caching": False, "kernels": kernels,
        })

    def generate(self, requests: Sequence[Request]) -> list[Rollout]:
        return [dataclasses.replace(r, meta={**self.meta, **r.meta})
                for r in self._engine.generate(list(requests))]

    def score(self, sequences: Sequence[Rollout | tuple[Sequence[int], Sequence[int]]], *,
              logprobs_mode: str = "raw", temperature: float = 1.0, top_k: int = 0,
              top_p: float = 1.0) -> list[torch.Tensor]:
        """The training forward with this backend's dtype, device and kernels."""
        from parity.engine import train_forward

        check_score_mode(logprobs_mode, temperature, top_k, top_p)
        return train_forward(self._engine.lm, list(sequences), dtype=self.dtype, device=self.device,
                             kernels=self.kernels, logprobs_mode=logprobs_mode, temperature=temperature,
                             top_k=top_k, top_p=top_p)

    def close(self) -> None:
        self._engine.close()
