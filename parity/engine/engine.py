"""The reference rollout engine: continuous batching with chunked prefill over a slot KV cache.

Each step packs, for every running sequence, either its next prefill chunk (up to `chunk_size`
prompt tokens) or its last sampled token, into one [1, T] forward of at most
`max_num_batched_tokens` tokens (sequences past that budget wait for the next step). A sequence
whose known tokens are all computed after the step gets its next token sampled from the logits
of its last row. Finished sequences free their slot for the next waiting one (FIFO), so batch
composition changes every step; with invariant kernels no token's numbers depend on it.

Per step the host makes one asynchronous copy of the inputs and one device->host copy of the
sampled tokens and logprobs (the scheduler needs them); sampling runs on all rows at once.
Steps of up to `max_num_seqs` tokens (all decode steps) replay CUDA graphs on a GPU
(`parity.engine.graphs`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from parity.engine import forward, sampler
from parity.engine.graphs import StepGraphs
from parity.engine.inputs import (
    KernelMode,
    check_length,
    check_positive_int,
    check_token_ids,
    device_tensor,
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
    """Engine settings. chunk_size: prompt tokens per sequence per step; max_num_seqs: running
    sequences; max_num_batched_tokens: tokens per step (bounds a prefill step's activations and
    attention workspace); graphs: run steps of up to max_num_seqs tokens padded to fixed sizes,
    replayed from CUDA graphs on a GPU (None: on for CUDA dense models; never while recording MoE
    routes; True on CPU runs the padded steps eagerly)."""

    dtype: str = "float32"
    device: str = "cpu"
    kernels: KernelMode = "invariant"
    max_num_seqs: int = 16
    chunk_size: int = 64
    record_routes: bool = False
    max_num_batched_tokens: int = 8192
    graphs: bool | None = None

    def __post_init__(self) -> None:
        check_positive_int(self.max_num_seqs, "max_num_seqs")
        check_positive_int(self.chunk_size, "chunk_size")
        check_positive_int(self.max_num_batched_tokens, "max_num_batched_tokens")
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
    def length(self) -> int:
        """Known tokens: prompt plus sampled."""
        return len(self.request.prompt_ids) + len(self.tokens)

    def chunk(self, count: int) -> list[int]:
        """The next `count` known tokens not yet computed (without copying the whole sequence)."""
        prompt = self.request.prompt_ids
        head = list(prompt[self.computed:self.computed + count])
        start = max(self.computed - len(prompt), 0)
        return head + self.tokens[start:start + count - len(head)]


class ReferenceEngine:
    """Batch-invariant rollout engine over the same HF model classes as the training forward.

    generate(requests) -> rollouts ordered by (request order, sample_index); with invariant
    kernels each rollout's logprobs equal `train_forward(kernels="invariant")` bit for bit.
    kernels: "invariant", "native" or a collection of family names to switch on;
    max_num_seqs: sequences running at once (KV slots); chunk_size: prompt tokens per sequence
    per step; record_routes: put each rollout's chosen experts in `routed_experts` (MoE);
    max_num_batched_tokens: tokens per step; graphs: see `EngineConfig`.
    """

    backend = "reference"

    def __init__(self, model: str | LoadedModel, *, dtype: str = "float32", device: str = "cpu",
                 kernels: KernelMode = "invariant", max_num_seqs: int = 16, chunk_size: int = 64,
                 record_routes: bool = False, max_num_batched_tokens: int = 8192,
                 graphs: bool | None = None) -> None:
        self.config = EngineConfig(dtype=dtype, device=device, kernels=kernels, max_num_seqs=max_num_seqs,
                                   chunk_size=chunk_size, record_routes=record_routes,
                                   max_num_batched_tokens=max_num_batched_tokens, graphs=graphs)
        self.lm = load_model(model, dtype=dtype, device=device)
        self._cache: KVCache | None = None
        self._graphs: StepGraphs | None = None

    def __enter__(self) -> ReferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the KV cache and the step graphs (the loaded model stays in load_model's cache)."""
        self._cache = None
        self._graphs = None

    def _use_graphs(self) -> bool:
        if self.config.record_routes and self.lm.is_moe:
            return False  # route recording hooks the eager forward
        if self.config.graphs is not None:
            return self.config.graphs
        # Dense only by default: the native MoE path reads expert counts on the host (not capturable).
        return torch.device(self.config.device).type == "cuda" and not self.lm.is_moe

    def _reserve(self, max_len: int) -> None:
        """Make the KV cache hold `max_len` positions per slot (grown on demand, never past max_len
        of the model: a cache for the model's full context can be far larger than a workload needs).
        The last slot belongs to no sequence: padding tokens of fixed-size steps write there."""
        if self._cache is None or self._cache.capacity < max_len:
            slots = self.config.max_num_seqs
            self._cache = KVCache.allocate(self.lm.config, slots + 1, max_len, self.lm.torch_dtype,
                                           self.config.device)
            native_attention = "attention" not in kernel_families(self.config.kernels)
            self._graphs = (StepGraphs(self.lm, self._cache, slots, slots, span_buckets=native_attention)
                            if self._use_graphs() else None)

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
        """One packed forward over `running` (within the token budget); samples a token for every
        sequence that completes."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[tuple[_Sequence, int, int]] = []
        budget = self.config.max_num_batched_tokens
        for seq in running:
            count = min(self.config.chunk_size, seq.length - seq.computed, budget)
            if count == 0:
                break
            budget -= count
            spans.append((seq, len(ids), count))
            ids.extend(seq.chunk(count))
            positions.extend(range(seq.computed, seq.computed + count))
            slots.extend([seq.slot] * count)
            seq.computed += count
        hidden = self._forward(ids, positions, slots, spans)
        ready = [(seq, offset + count - 1) for seq, offset, count in spans if seq.computed == seq.length]
        if ready:
            rows = device_tensor([row for _, row in ready], torch.int64, hidden.device)
            self._sample([seq for seq, _ in ready], hidden.index_select(0, rows))

    def _forward(self, ids: list[int], positions: list[int], slots: list[int],
                 spans: list[tuple[_Sequence, int, int]]) -> torch.Tensor:
        """Hidden states [>= T, H] of the step's T packed tokens (rows past T: padding of a fixed-size
        step)."""
        if self._graphs is not None and self._graphs.fits(len(ids)):
            return self._graphs.run(ids, positions, slots)
        device = self.config.device
        input_ids = device_tensor([ids], torch.int64, device)
        position_ids = device_tensor([positions], torch.int64, device)
        slot_ids = device_tensor(slots, torch.int64, device)
        span = (max(positions) // self._cache.block + 1) * self._cache.block
        if not (self.config.record_routes and self.lm.is_moe):
            return forward.final_hidden(self.lm, input_ids, position_ids, self._cache, slot_ids, span)
        with routing.capture(self.lm.num_moe_layers) as recorder:
            hidden = forward.final_hidden(self.lm, input_ids, position_ids, self._cache, slot_ids, span)
        routes = recorder.routes().cpu()  # one device->host copy for the whole step
        for seq, offset, count in spans:
            seq.routes.append(routes[offset:offset + count])
        return hidden

    def _sample(self, seqs: list[_Sequence], hidden: torch.Tensor) -> None:
        """Sample one token for each of `seqs` from its hidden row [N, H]; one device->host copy."""
        logits = forward.logits(self.lm, hidden)
        params = [s.request.sampling for s in seqs]
        row_params = sampler.RowParams(tuple(p.temperature for p in params), tuple(p.top_k for p in params),
                                       tuple(p.top_p for p in params))
        processed = sampler.processed_logprobs(logits, row_params)
        keys = [None if p.temperature == 0 else (p.seed, s.sample_index, s.computed)
                for s, p in zip(seqs, params)]
        tokens = sampler.sample(processed, keys)
        logprobs = sampler.reported_logprobs(logits, processed, tokens, [p.logprobs_mode for p in params])
        # float64 holds every token id and every float32 logprob exactly: one copy carries both.
        both = torch.stack([tokens.to(torch.float64), logprobs.to(torch.float64)])
        host_tokens, host_logprobs = both.tolist()
        for seq, token, logprob in zip(seqs, map(int, host_tokens), host_logprobs):
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
            "max_num_batched_tokens": self.config.max_num_batched_tokens,
            "step_graphs": "off" if self._graphs is None else self._graphs.status,
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
                             **options).logprobs
