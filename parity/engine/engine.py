"""The reference rollout engine: continuous batching with chunked prefill over a slot KV cache.

Each step the scheduler admits sequences into free slots and packs every running sequence's next
prefill chunk or last token into one [1, T] forward (at most `max_num_batched_tokens`); the engine
runs it (or replays a CUDA graph), samples from the last row of every sequence whose known tokens
are computed, and hands the tokens back. One async host->device copy and one device->host copy
per step. With `overlap` (CUDA), step N+1 is planned and launched while step N runs: its decode
rows take N's tokens on the device, and the host reads N's tokens afterwards.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from parity.core.errors import ConfigError, InputError, UnsupportedError
from parity.core.strict import check_dtype, replace_fields
from parity.core.turns import check_top_k_turns
from parity.core.types import Request, Rollout
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
from parity.engine.overlap import Draw, Fill, Routes
from parity.engine.scheduler import Scheduler, Sequence, Span, Step
from parity.engine.train import TrainConfig, train_forward
from parity.kernels.attention import KVCache
from parity.models import routing
from parity.models.loading import (
    LoadedModel,
    check_device,
    copy_model,
    is_shared,
    load_model,
    own_adapter,
    swap_adapter,
    tensor_digest,
)
from parity.models.lora import LoraSpec, adapter_text, check_without_tensor_parallel
from parity.parallel import (
    REDUCTION_GROUPS,
    REDUCTIONS,
    Comm,
    RankGroup,
    check_degree,
    check_reduction_groups,
    check_shardable,
    shard_model,
)
from parity.parallel.group import check_rank_device
from parity.parallel.shard import check_shard_layout


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings, the one spelling of them (the engine and the `reference` backend take them).

    kernels: "invariant", "native" or family names. max_num_seqs: KV slots. chunk_size: prompt
    tokens per sequence per step. max_num_batched_tokens: tokens per step. record_routes: MoE
    experts into `routed_experts`. graphs: fixed-size steps replayed from CUDA graphs (None: on for
    CUDA, for MoE only with parity's "moe" kernels; True on CPU runs them eagerly).
    tensor_parallel_size: None is in-process whole model; k in (1, 2, 4, 8) ranks give the same bits
    at every k, equal to `train_forward(tensor_parallel_size=1)`. tp_reduction: "canonical"
    (TP-invariant) or the "all_reduce" contrast. reduction_groups: K groups of the canonical sum
    (k must divide it); bits are the same across k for one value, not across values.
    lora: an adapter (not with tensor parallelism). overlap: plan and launch each step before the
    last one's tokens reach the host (None: on for CUDA; generates with multi-turn trajectories or
    top-k logprobs run step by step); the same bits either way.
    """

    dtype: str = "float32"
    device: str = "cpu"
    kernels: KernelMode = "invariant"
    max_num_seqs: int = 16
    chunk_size: int = 64
    record_routes: bool = False
    max_num_batched_tokens: int = 8192
    graphs: bool | None = None
    tensor_parallel_size: int | None = None
    tp_reduction: str = "canonical"
    reduction_groups: int = REDUCTION_GROUPS
    lora: str | None = None
    overlap: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.lora, os.PathLike):
            object.__setattr__(self, "lora", adapter_text(self.lora))  # a Path spelled like a name stays one
        if self.lora is not None and not isinstance(self.lora, str):
            raise ConfigError(f"lora must be an adapter directory or a built-in adapter name, got "
                              f"{self.lora!r}")
        if self.lora is not None:
            check_without_tensor_parallel(self.tensor_parallel_size, "tensor_parallel_size")
        check_dtype(self.dtype)
        check_device(self.device)
        if self.tensor_parallel_size is not None:
            check_degree(self.tensor_parallel_size)
        if self.tp_reduction not in REDUCTIONS:
            raise ConfigError(f"tp_reduction must be one of {REDUCTIONS}, got {self.tp_reduction!r}")
        check_reduction_groups(self.reduction_groups, self.tensor_parallel_size)
        check_rank_device(self.device, self.tensor_parallel_size)
        check_positive_int(self.max_num_seqs, "max_num_seqs")
        check_positive_int(self.chunk_size, "chunk_size")
        check_positive_int(self.max_num_batched_tokens, "max_num_batched_tokens")
        kernel_families(self.kernels)
        if not isinstance(self.record_routes, bool):
            raise ConfigError(f"record_routes must be true or false, got {self.record_routes!r}")
        for name in ("graphs", "overlap"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ConfigError(f"{name} must be true, false or None (automatic), got {value!r}")

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with `changes` applied (validated again); an unknown setting is a ConfigError."""
        return replace_fields(self, changes, where="engine", what="engine setting")

    def training(self) -> TrainConfig:
        """The training forward's settings whose logprobs equal this engine's rollouts' bit for bit:
        its dtype, device and kernels, and with tensor parallelism the canonical layout in one
        process (`tensor_parallel_size=1`, the bits of every degree) with its reduction and groups."""
        layout = {} if self.tensor_parallel_size is None else dict(
            tensor_parallel_size=1, tp_reduction=self.tp_reduction, reduction_groups=self.reduction_groups)
        return TrainConfig(dtype=self.dtype, device=self.device, kernels=self.kernels, **layout)


class ReferenceEngine:
    """Batch-invariant rollout engine over the same HF model classes as the training forward.

    generate(requests) -> rollouts ordered by (request, sample_index); with invariant kernels their
    logprobs equal `train_forward(kernels="invariant")` bit for bit. Keyword `settings` override
    `config`'s fields.
    """

    backend = "reference"

    def __init__(self, model: str | LoadedModel, config: EngineConfig | None = None, **settings: Any) -> None:
        self.config = config = (config or EngineConfig()).replace(**settings)
        tp = config.tensor_parallel_size
        self._cache: KVCache | None = None
        self._graphs: StepGraphs | None = None
        self._ranks: RankGroup | None = None
        self._private = False  # whether self.lm is this engine's own copy (after a weight update)
        self._own_adapter = False  # whether its adapter's tensors are (after an adapter swap)
        # a shard cut for another layout would run its own sum under this config's label
        check_shard_layout(model, tp, config.tp_reduction, config.reduction_groups)
        if tp is None or (isinstance(model, LoadedModel) and model.tensor_parallel_size == tp):
            self.lm = load_model(model, dtype=config.dtype, device=config.device, lora=config.lora)
        elif tp == 1:
            self.lm = shard_model(model, Comm.single(), dtype=config.dtype, device=config.device,
                                  reduction=config.tp_reduction, reduction_groups=config.reduction_groups)
        else:
            # this process keeps the whole model on the CPU for input checks; the ranks hold the shards
            if isinstance(model, LoadedModel) and not is_shared(model):
                raise ConfigError("tensor_parallel_size > 1 loads the checkpoint in every rank, so the "
                                  "weights this private model copy holds now would not reach them; run it "
                                  "with tensor_parallel_size=None or 1, or save its weights as a "
                                  "checkpoint and pass that path")
            self.lm = load_model(model, dtype=config.dtype, device="cpu")
            check_shardable(self.lm, tp)
            self._ranks = RankGroup(tp, torch.device(config.device).type,
                                    functools.partial(_rank_engine, str(self.lm.path), config))

    def load_adapter(self, lora: str | os.PathLike[str] | LoraSpec) -> None:
        """Apply another LoRA adapter of the same rank and modules from the next step on (an RL
        step's new adapter, `parity.models.loading.swap_adapter`); its rollouts record it."""
        previous = self.lm.lora
        if not (self._private or self._own_adapter):
            # the adapter's tensors of this engine's own (the base weights stay shared); graphs
            # captured the shared ones
            self.lm = own_adapter(self.lm)
            self._own_adapter = True
            self._cache = self._graphs = None
        self.lm = swap_adapter(self.lm, lora)
        self.config = self.config.replace(lora=str(self.lm.lora.path))
        if previous is not None and previous.scaling != self.lm.lora.scaling:
            self._cache = self._graphs = None  # captured graphs hold the scaling: capture again

    def __enter__(self) -> ReferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the KV cache and the step graphs (the loaded model stays in load_model's cache); stop
        the tensor-parallel ranks."""
        self._cache = None
        self._graphs = None
        if self._ranks is not None:
            self._ranks.close()
            self._ranks = None

    @property
    def _records_routes(self) -> bool:
        return self.config.record_routes and self.lm.is_moe

    def _use_graphs(self) -> bool:
        if (self.lm.tensor_parallel_size or 1) > 1:
            return False  # the ranks' collectives run eagerly
        if self.config.graphs is not None:
            return self.config.graphs
        # The stock MoE path reads expert counts on the host (not capturable); parity's MoE kernels
        # keep the routing bookkeeping on the device, so a MoE model replays graphs when they run.
        capturable = not self.lm.is_moe or "moe" in kernel_families(self.config.kernels)
        return torch.device(self.config.device).type == "cuda" and capturable

    def _reserve(self, max_len: int) -> None:
        """Grow the KV cache to `max_len` positions per slot (on demand: the full context can be far
        larger than a workload). The last slot is the padding tokens' own.
        """
        if self._cache is None or self._cache.capacity < max_len:
            slots = self.config.max_num_seqs
            self._cache = KVCache.allocate(self.lm.config, slots + 1, max_len, self.lm.torch_dtype,
                                           self.config.device)
            native_attention = "attention" not in kernel_families(self.config.kernels)
            self._graphs = (StepGraphs(self.lm, self._cache, slots, slots, stock_attention=native_attention,
                                       record_routes=self._records_routes)
                            if self._use_graphs() else None)

    def warm_up(self, max_length: int) -> int:
        """Prepare every shape a generate up to `max_length` positions runs (KV capacity, step graphs,
        eager steps at each power of two); pad tokens write only the pad slot, so no bits change.
        Returns the number of shapes (0 with tensor-parallel ranks).
        """
        check_length(max_length, self.lm, "warm_up max_length")
        if self._ranks is not None:
            return 0
        self._reserve(max_length)
        prepared = 0
        with torch.inference_mode(), kernel_scope(self.config.kernels):
            if self._graphs is not None:
                prepared += self._graphs.warm()
            largest = self._graphs.sizes[-1] if self._graphs is not None else 0
            budget = self.config.max_num_batched_tokens
            sizes = sorted(size for size in {*(2**k for k in range(budget.bit_length())), budget}
                           if largest < size <= budget)
            pad = self.config.max_num_seqs  # the slot no sequence is given
            for size in sizes:
                ids = torch.zeros((1, size), dtype=torch.int64, device=self.config.device)
                slots = torch.full((size,), pad, dtype=torch.int64, device=self.config.device)
                routing.run_routed(
                    lambda ids=ids, slots=slots, size=size: forward.final_hidden(
                        self.lm, ids, torch.zeros_like(ids), self._cache, slots, span=self._cache.block,
                        max_run=size),
                    self.lm.num_moe_layers, record=self._records_routes)
                prepared += 1
        if torch.device(self.config.device).type == "cuda":
            torch.cuda.synchronize(self.config.device)
        return prepared

    def _check(self, requests: list[Request]) -> None:
        if not isinstance(requests, (list, tuple)):
            raise InputError(f"generate() takes a list of parity.Request, got {type(requests).__name__}")
        seen: set[str] = set()
        for i, request in enumerate(requests):
            if not isinstance(request, Request):
                raise InputError(f"requests[{i}] is a {type(request).__name__}, not a parity.Request")
            where = f"request {request.request_id!r}"
            if request.request_id in seen:  # rollouts are keyed by (request_id, sample_index)
                raise InputError(f"{where} appears twice in one generate; request_id must be unique within "
                                 "a batch (its rollouts would share one key)")
            seen.add(request.request_id)
            sampling = request.sampling
            check_token_ids(request.prompt_ids, self.lm, where + " prompt_ids")
            # a stop id outside the vocabulary is never sampled: the response would silently run on
            check_token_ids(sampling.stop_token_ids, self.lm, where + " sampling.stop_token_ids")
            for i, turn in enumerate(request.turns):
                if getattr(turn, "token_ids", ()):
                    check_token_ids(turn.token_ids, self.lm, f"{where} turns[{i}]")
                check_token_ids(getattr(turn, "stop_token_ids", ()), self.lm,
                                f"{where} turns[{i}].stop_token_ids")
            if sampling.seed >= sampler.SEED_LIMIT:
                raise ConfigError(f"{where}: sampling.seed {sampling.seed} is 2^64 or more; the reference "
                                  f"engine hashes 64-bit seeds, so it would draw the samples of seed "
                                  f"{sampling.seed % sampler.SEED_LIMIT}; use a seed below 2^64")
            sampler.check_temperature(sampling.temperature, where + " sampling")
            check_length(len(request.prompt_ids) + request.sampling.max_tokens, self.lm,
                         where + " (prompt + max_tokens)")
            check_top_k_turns([request])

    def generate(self, requests: list[Request]) -> list[Rollout]:
        """Sample every request n times; one Rollout per (request, sample_index), in that order."""
        self._check(requests)
        if self._ranks is not None:
            return self._ranks.call("generate", list(requests))
        sequences = [Sequence(request, i, vocab_size=self.lm.vocab_size)  # tool replies are checked
                     for request in requests for i in range(request.sampling.n)]
        if sequences:
            self._reserve(max(seq.max_length for seq in sequences))
        config = self.config
        scheduler = Scheduler(sequences, max_num_seqs=config.max_num_seqs, chunk_size=config.chunk_size,
                              max_num_batched_tokens=config.max_num_batched_tokens,
                              eos_token_ids=self.lm.eos_token_ids, overlap=self._overlaps(requests))
        with torch.inference_mode(), kernel_scope(config.kernels):
            in_flight: Draw | None = None  # overlap: the last step's draw, read once the next is launched
            routed: Routes | None = None  # the last step's routes, kept once its draw is read
            while not scheduler.done or in_flight is not None:
                scheduler.admit()
                step = scheduler.plan()
                hidden, routes = self._forward(step, in_flight) if step.spans else (None, None)
                drawn = self._sample(step.ready, hidden) if step.ready else None
                if in_flight is not None:
                    self._clear(scheduler.finish(in_flight.ready, *in_flight.read()))
                if routed is not None:
                    routed.keep()
                routed = routes.live() if routes is not None else None
                if drawn is not None and not scheduler.overlap:
                    self._clear(scheduler.finish(drawn.ready, *drawn.read()))
                    drawn = None
                in_flight = drawn
            if routed is not None:
                routed.keep()
        return [self._rollout(seq) for seq in sequences]

    def _clear(self, stopped: list[Sequence]) -> None:
        """Zero the KV positions each stopped sequence wrote into its slot. Attention reads keys past
        a token's position with weight exactly 0, and 0 * inf is NaN: a float16 overflow in one
        sequence's values would reach the slot's next sequence (on CPU only in steps whose span covers
        the stale positions, so as a function of its batch). A free slot stays all zero, as allocated."""
        if stopped:
            torch._foreach_zero_([cache[seq.slot, :, :seq.computed] for seq in stopped
                                  for cache in (*self._cache.keys, *self._cache.values)])

    def _overlaps(self, requests: list[Request]) -> bool:
        """Whether this generate plans each step before the last one's tokens are read: the setting
        (None: on CUDA), and only where no token decides what the next step holds on the host."""
        wanted = self.config.overlap
        if wanted is None:
            wanted = torch.device(self.config.device).type == "cuda"
        return wanted and not any(r.turns or r.sampling.top_k_logprobs for r in requests)

    def _forward(self, step: Step, pending: Draw | None = None) -> tuple[torch.Tensor, Routes | None]:
        """Hidden states [>= T, H] of the step's T packed tokens (extra rows: padding) and, when
        recorded, their routes on the way to the host (one copy for the whole step). The ids of
        `step.fills` rows are taken from `pending`'s tokens on the device."""
        fill = pending.fill(step.fills) if step.fills else None
        if self._graphs is not None and self._graphs.fits(len(step.ids)):
            hidden, routes = self._graphs.run(step.ids, step.positions, step.slots, step.longest_run, fill)
        else:
            hidden, routes = self._eager_forward(step, fill)
        return hidden, None if routes is None else Routes.launch(step.spans, routes)

    def _eager_forward(self, step: Step, fill: Fill | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_forward` without graphs: hidden states [T, H] and, when recorded, routes [T, layers, k]."""
        device = self.config.device
        input_ids = device_tensor([step.ids], torch.int64, device)
        if fill is not None:
            fill.apply(input_ids[0])
        position_ids = device_tensor([step.positions], torch.int64, device)
        slot_ids = device_tensor(step.slots, torch.int64, device)
        span = (max(step.positions) // self._cache.block + 1) * self._cache.block
        return routing.run_routed(
            lambda: forward.final_hidden(self.lm, input_ids, position_ids, self._cache, slot_ids, span=span,
                                         max_run=step.longest_run),
            self.lm.num_moe_layers, record=self._records_routes)

    def _sample(self, ready: tuple[Span, ...], hidden: torch.Tensor) -> Draw:
        """One token and logprob per ready span from its last row, launched; `Draw.read` brings them
        to the host (one device->host copy)."""
        rows = device_tensor([span.last_row for span in ready], torch.int64, hidden.device)
        head = forward.head(self.lm, hidden.index_select(0, rows))
        seqs = [span.seq for span in ready]
        params = [s.request.sampling for s in seqs]
        row_params = sampler.RowParams(tuple(p.temperature for p in params), tuple(p.top_k for p in params),
                                       tuple(p.top_p for p in params))
        # The noise key's position is the sampled token's: every known token is computed.
        keys = [None if p.temperature == 0 else (p.seed, s.sample_index, s.computed)
                for s, p in zip(seqs, params)]
        k = max(p.top_k_logprobs for p in params)
        if not k and sampler.plain(row_params):
            return Draw.launch(ready, *sampler.sample_plain(head, keys))
        logits = head.to(torch.float32)
        processed = sampler.processed_logprobs(logits, row_params)
        tokens = sampler.sample(processed, keys)
        table = sampler.reported_table(logits, processed, [p.logprobs_mode for p in params])
        logprobs = table.gather(1, tokens.unsqueeze(1)).squeeze(1)
        if k:
            for seq, p, ids, values in zip(seqs, params, *sampler.top_k_rows(table, k)):
                if p.top_k_logprobs:
                    seq.top_k.append((ids[:p.top_k_logprobs], values[:p.top_k_logprobs]))
        return Draw.launch(ready, tokens, logprobs)

    def _rollout(self, seq: Sequence) -> Rollout:
        # A trajectory that ends on injected tokens never computes them, so its routes would not
        # cover every position: trajectories carry no routes.
        routes = None
        if self._records_routes and not seq.request.turns and seq.routes is not None:
            # a buffer filled to the end is the rollout's; one that stopped short gives its part
            filled = seq.routes_len
            routes = seq.routes if filled == len(seq.routes) else seq.routes[:filled].copy()
        config = self.config
        meta: dict[str, Any] = {
            "dtype": config.dtype, "kernels": kernel_label(config.kernels), "device": config.device,
            "chunk_size": config.chunk_size, "max_num_seqs": config.max_num_seqs, "model": self.lm.name,
            "model_hash": self.lm.model_hash, "max_num_batched_tokens": config.max_num_batched_tokens,
            "step_graphs": "off" if self._graphs is None else self._graphs.status,
        }
        # the layout these bits belong to, which scoring follows (`train.scoring_layout`): None groups
        # is the whole model
        tp = config.tensor_parallel_size
        meta.update(tensor_parallel_size=tp, tp_reduction=None if tp is None else config.tp_reduction,
                    reduction_groups=None if tp is None else config.reduction_groups)
        if self.lm.lora is not None:
            meta["lora"] = self.lm.lora.to_dict()
        return Rollout(request_id=seq.request.request_id, sample_index=seq.sample_index,
                       prompt_ids=seq.request.prompt_ids, token_ids=tuple(seq.tokens),
                       logprobs=tuple(seq.logprobs), finish_reason=seq.finish_reason or "length",
                       backend=self.backend, logprobs_mode=seq.request.sampling.logprobs_mode,
                       routed_experts=routes, meta=meta, sampling=seq.request.sampling,
                       response_mask=tuple(seq.mask) if seq.request.turns else None,
                       **top_k_fields(seq.top_k))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the model's parameters in place by name, cast to the engine's dtype; every
        name and shape is checked first. The first update makes a private copy of the shared model;
        later ones copy in place so the kernels' cached float32 copies (keyed on version counters) follow.
        """
        if self.config.tensor_parallel_size is not None:
            raise UnsupportedError("weight updates of a tensor-parallel reference engine are not supported; "
                                   "start the engine without tensor_parallel_size")
        tensors = dict(named_tensors)
        if not tensors:
            raise InputError("update_weights got no tensors; pass (parameter name, tensor) pairs")
        params = dict(self.lm.model.named_parameters())
        unknown = sorted(set(tensors) - set(params))
        if unknown:
            raise InputError(f"update_weights: the model has no parameter {unknown[0]!r} ({len(unknown)} "
                             f"unknown names); its parameters are named like {next(iter(params))!r}")
        for name, tensor in tensors.items():
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise InputError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the model's "
                                 f"parameter has {tuple(params[name].shape)}")
        if not self._private:
            self.lm = copy_model(self.lm)
            self._private = True
            self._cache = self._graphs = None  # graphs captured the shared model's parameters
            params = dict(self.lm.model.named_parameters())
        with torch.no_grad():
            for name, tensor in tensors.items():
                params[name].copy_(tensor)

    def weight_checksums(self) -> dict[str, str | None]:
        """sha256 of every parameter as the engine holds it (its dtype), by parameter name."""
        return {name: tensor_digest(p) for name, p in self.lm.model.named_parameters()}

    def score(self, sequences: list, **options: Any) -> list[torch.Tensor]:
        """Teacher-forced response logprobs: `train_forward` with this engine's settings
        (`EngineConfig.training`); `options` are train_forward's keyword arguments."""
        model = self.lm if self._ranks is None else self.lm.path
        return train_forward(model, sequences, self.config.training(), **options).logprobs


def top_k_fields(rows: list[tuple[list[int], list[float]]]) -> dict[str, Any]:
    """`Rollout` keyword arguments of per-token top-k rows (ids, logprobs); none without rows."""
    if not rows:
        return {}
    return {"top_k_ids": np.array([ids for ids, _ in rows], dtype=np.int64),
            "top_k_logprobs": np.array([values for _, values in rows], dtype=np.float64)}


def _rank_engine(path: str, config: EngineConfig, comm: Comm) -> ReferenceEngine:
    """One rank's engine over its shard (run inside a `RankGroup` rank process)."""
    lm = shard_model(path, comm, dtype=config.dtype, device=config.device, reduction=config.tp_reduction,
                     reduction_groups=config.reduction_groups)
    return ReferenceEngine(lm, config)
