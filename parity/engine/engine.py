"""The reference rollout engine: continuous batching with chunked prefill over a slot KV cache.

Each step packs, for every running sequence, either its next prefill chunk (up to `chunk_size`
prompt tokens) or its last sampled token, into one [1, T] forward. A sequence whose known
tokens are all computed after the step gets its next token sampled from the logits of its last
row. Finished sequences free their slot for the next waiting one (FIFO), so batch composition
changes every step; with invariant kernels no token's numbers depend on it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from parity.engine import forward, sampler
from parity.engine.inputs import (
    KernelMode,
    check_length,
    check_positive_int,
    check_token_ids,
    kernel_families,
    kernel_label,
    kernel_scope,
)
from parity.engine.train import train_forward
from parity.errors import InputError
from parity.kernels.attention import KVCache
from parity.models import routing
from parity.models.loading import LoadedModel, load_model
from parity.types import Request, Rollout


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings. chunk_size: prompt tokens per sequence per step; max_num_seqs: running sequences."""

    dtype: str = "float32"
    device: str = "cpu"
    kernels: KernelMode = "invariant"
    max_num_seqs: int = 16
    chunk_size: int = 64
    record_routes: bool = False

    def __post_init__(self) -> None:
        check_positive_int(self.max_num_seqs, "max_num_seqs")
        check_positive_int(self.chunk_size, "chunk_size")
        kernel_families(self.kernels)


@dataclass
class _Sequence:
    """One sample being generated (mutable scheduler state)."""

    request: Request
    sample_index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routes: list[torch.Tensor] = field(default_factory=list)
    computed: int = 0
    slot: int = -1
    finish_reason: str | None = None

    @property
    def known(self) -> list[int]:
        return [*self.request.prompt_ids, *self.tokens]


class ReferenceEngine:
    """Batch-invariant rollout engine over the same HF model classes as the training forward.

    generate(requests) -> rollouts ordered by (request order, sample_index); with invariant
    kernels each rollout's logprobs equal `train_forward(kernels="invariant")` bit for bit.
    kernels: "invariant", "native" or a collection of family names to switch on;
    max_num_seqs: sequences running at once (KV slots); chunk_size: prompt tokens per sequence
    per step; record_routes: put each rollout's chosen experts in `routed_experts` (MoE).
    """

    backend = "reference"

    def __init__(self, model: str | LoadedModel, *, dtype: str = "float32", device: str = "cpu",
                 kernels: KernelMode = "invariant", max_num_seqs: int = 16, chunk_size: int = 64,
                 record_routes: bool = False) -> None:
        self.config = EngineConfig(dtype=dtype, device=device, kernels=kernels, max_num_seqs=max_num_seqs,
                                   chunk_size=chunk_size, record_routes=record_routes)
        self.lm = load_model(model, dtype=dtype, device=device)
        self._cache: KVCache | None = None

    def __enter__(self) -> ReferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the KV cache (the loaded model stays in load_model's cache)."""
        self._cache = None

    def _reserve(self, max_len: int) -> None:
        """Make the KV cache hold `max_len` positions per slot (grown on demand, never past max_len
        of the model: a cache for the model's full context can be far larger than a workload needs)."""
        if self._cache is None or self._cache.capacity < max_len:
            self._cache = KVCache.allocate(self.lm.config, self.config.max_num_seqs, max_len,
                                           self.lm.torch_dtype, self.config.device)

    def _check(self, requests: list[Request]) -> None:
        if not isinstance(requests, (list, tuple)):
            raise InputError(f"generate() takes a list of parity.Request, got {type(requests).__name__}")
        for i, request in enumerate(requests):
            if not isinstance(request, Request):
                raise InputError(f"requests[{i}] is a {type(request).__name__}, not a parity.Request")
            where = f"request {request.request_id!r}"
            check_token_ids(request.prompt_ids, self.lm, where + " prompt_ids")
            check_length(len(request.prompt_ids) + request.sampling.max_tokens, self.lm,
                         where + " (prompt + max_tokens)")

    def generate(self, requests: list[Request]) -> list[Rollout]:
        """Sample every request n times; one Rollout per (request, sample_index), in that order."""
        self._check(requests)
        sequences = [_Sequence(request, i) for request in requests for i in range(request.sampling.n)]
        if sequences:
            self._reserve(max(len(s.request.prompt_ids) + s.request.sampling.max_tokens for s in sequences))
        waiting = deque(sequences)
        running: list[_Sequence] = []
        free = list(range(self.config.max_num_seqs))
        with torch.inference_mode(), kernel_scope(self.config.kernels):
            while waiting or running:
                while waiting and free:
                    seq = waiting.popleft()
                    seq.slot = free.pop(0)
                    running.append(seq)
                self._step(running)
                for seq in [s for s in running if s.finish_reason is not None]:
                    running.remove(seq)
                    free.append(seq.slot)
                    free.sort()
        return [self._rollout(seq) for seq in sequences]

    def _step(self, running: list[_Sequence]) -> None:
        """One packed forward over `running`; samples a token for every sequence that completes."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[tuple[_Sequence, int, int]] = []
        for seq in running:
            known = seq.known
            start = seq.computed
            count = min(self.config.chunk_size, len(known) - start)
            spans.append((seq, len(ids), count))
            ids.extend(known[start:start + count])
            positions.extend(range(start, start + count))
            slots.extend([seq.slot] * count)
            seq.computed += count
        input_ids = torch.tensor([ids], device=self.config.device)
        position_ids = torch.tensor([positions], device=self.config.device)
        slot_ids = torch.tensor(slots, device=self.config.device)
        if self.config.record_routes and self.lm.is_moe:
            with routing.capture(self.lm.num_moe_layers) as recorder:
                hidden = forward.final_hidden(self.lm, input_ids, position_ids, self._cache, slot_ids)
            routes = recorder.routes()
            for seq, offset, count in spans:
                seq.routes.append(routes[offset:offset + count].cpu())
        else:
            hidden = forward.final_hidden(self.lm, input_ids, position_ids, self._cache, slot_ids)
        ready = [(seq, offset + count - 1) for seq, offset, count in spans
                 if seq.computed == len(seq.request.prompt_ids) + len(seq.tokens)]
        if ready:
            self._sample([seq for seq, _ in ready], hidden[[row for _, row in ready]])

    def _sample(self, seqs: list[_Sequence], hidden: torch.Tensor) -> None:
        logits = forward.logits(self.lm, hidden)
        params = [s.request.sampling for s in seqs]
        row_params = sampler.RowParams(tuple(p.temperature for p in params), tuple(p.top_k for p in params),
                                       tuple(p.top_p for p in params))
        processed = sampler.processed_logprobs(logits, row_params)
        keys = [None if s.request.sampling.temperature == 0 else
                (s.request.sampling.seed, s.sample_index, s.computed) for s in seqs]
        tokens = sampler.sample(processed, keys)
        logprobs = sampler.reported_logprobs(logits, processed, tokens, [p.logprobs_mode for p in params])
        for seq, token, logprob in zip(seqs, tokens.tolist(), logprobs.tolist()):
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            sampling = seq.request.sampling
            eos = not sampling.ignore_eos and token in self.lm.eos_token_ids
            if eos or token in sampling.stop_token_ids:
                seq.finish_reason = "stop"
            elif len(seq.tokens) == sampling.max_tokens:
                seq.finish_reason = "length"

    def _rollout(self, seq: _Sequence) -> Rollout:
        routes = None
        if self.config.record_routes and self.lm.is_moe:
            routes = torch.cat(seq.routes).numpy().astype(np.int32)
        meta: dict[str, Any] = {
            "dtype": self.config.dtype, "kernels": kernel_label(self.config.kernels),
            "device": self.config.device, "chunk_size": self.config.chunk_size,
            "max_num_seqs": self.config.max_num_seqs, "model": self.lm.name, "model_hash": self.lm.model_hash,
        }
        return Rollout(request_id=seq.request.request_id, sample_index=seq.sample_index,
                       prompt_ids=seq.request.prompt_ids, token_ids=tuple(seq.tokens),
                       logprobs=tuple(seq.logprobs), finish_reason=seq.finish_reason or "length",
                       backend=self.backend, logprobs_mode=seq.request.sampling.logprobs_mode,
                       routed_experts=routes, meta=meta)

    def score(self, sequences: list, **options: Any) -> list[torch.Tensor]:
        """Teacher-forced response logprobs: `train_forward` with this engine's dtype, device, kernels."""
        options.setdefault("kernels", self.config.kernels)
        return train_forward(self.lm, sequences, dtype=self.config.dtype, device=self.config.device,
                             **options)
