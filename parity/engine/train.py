"""The training side: teacher-forced response logprobs through the same HF model classes.

Micro-batches are right- or left-padded [B, L] or packed into one row, each one prefill; padding
goes to a scratch KV slot. With invariant kernels the result equals the reference engine's
rollout logprobs bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from parity.core.errors import AdapterError, ConfigError, InputError
from parity.core.strict import check_choice, check_dtype, replace_fields
from parity.core.top_k import check_top_k
from parity.core.types import LOGPROBS_MODES, Pair, Rollout, as_pairs
from parity.drift.distribution import TrainerView
from parity.drift.routes import check_routes
from parity.engine import forward, sampler
from parity.engine.inputs import (
    KernelMode,
    check_length,
    check_positive_int,
    check_token_ids,
    kernel_families,
    kernel_scope,
)
from parity.engine.views import device_view
from parity.kernels.attention import KVCache
from parity.models import routing
from parity.models.checkpoints import check_sampled_with, resolve_model
from parity.models.loading import LoadedModel, check_device, is_shared, load_model
from parity.models.lora import LoraSpec, check_adapter, check_without_tensor_parallel
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

LAYOUTS: tuple[str, ...] = ("right", "left", "packed")


@dataclass(frozen=True)
class TrainConfig:
    """How `train_forward` executes: the numerical settings, the same for every sequence of a call.

    kernels: "invariant", "native" or family names. micro_batch_size: None is one forward.
    layout: "right"/"left" padding `[micro_batch, max_len]` or "packed" `[1, total_tokens]`.
    tensor_parallel_size, tp_reduction, reduction_groups: as `EngineConfig`'s; None takes the layout
    the Rollouts record (`scoring_layout`), else the whole model.
    grad: True records autograd (the same bits: `parity.kernels.grad`); not with tensor parallelism.
    """

    dtype: str = "float32"
    device: str = "cpu"
    kernels: KernelMode = "invariant"
    micro_batch_size: int | None = None
    layout: str = "right"
    tensor_parallel_size: int | None = None
    tp_reduction: str | None = None
    reduction_groups: int | None = None
    grad: bool = False

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        object.__setattr__(self, "device", check_device(self.device))
        kernel_families(self.kernels)
        if self.micro_batch_size is not None:
            check_positive_int(self.micro_batch_size, "micro_batch_size")
        check_choice(self.layout, LAYOUTS, "layout")
        if self.tensor_parallel_size is not None:
            check_degree(self.tensor_parallel_size)
        if self.tp_reduction is not None:
            check_choice(self.tp_reduction, REDUCTIONS, "tp_reduction")
        if self.reduction_groups is not None:
            check_reduction_groups(self.reduction_groups, self.tensor_parallel_size)
        if not isinstance(self.grad, bool):
            raise ConfigError(f"grad must be True or False, got {self.grad!r}")
        check_rank_device(self.device, self.tensor_parallel_size)
        if self.grad and self.tensor_parallel_size is not None:
            raise ConfigError("grad=True runs the model in this process; leave tensor_parallel_size unset")

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with `changes` applied (validated again); an unknown setting is a ConfigError
        listing the settings."""
        return replace_fields(self, changes, where="train_forward", what="training setting")


#: train_forward's keywords that define the logprobs and carry data, beside the `TrainConfig` settings.
DEFINITION_KEYWORDS = ("logprobs_mode", "temperature", "top_k", "top_p", "record_routes", "router_replay",
                       "routes", "lora", "distribution")


@dataclass(frozen=True)
class TrainResult:
    """What `train_forward` returns: one entry per input sequence, in input order.

    logprobs: float32 `[len(response)]`. routes: int32 `[len(prompt) + len(response) - 1,
    moe_layers, top_k]` with `record_routes` (None otherwise or dense). views: `TrainerView`s with
    `distribution=True`.
    """

    logprobs: list[torch.Tensor]
    routes: list[torch.Tensor | None] | None = None
    views: list[TrainerView] | None = None


def pairs_and_modes(sequences: Sequence[Any], logprobs_mode: str | None) -> tuple[list[Pair], list[str]]:
    """(prompt, response) id tuples and the logprobs mode of each sequence (for the training and
    the gold forward)."""
    if logprobs_mode is not None and logprobs_mode not in LOGPROBS_MODES:
        raise ConfigError(f"logprobs_mode must be one of {LOGPROBS_MODES} or None, got {logprobs_mode!r}")
    pairs = as_pairs(sequences)  # checked: a list of Rollouts or pairs of token-id lists
    modes = [logprobs_mode or (item.logprobs_mode if isinstance(item, Rollout) else "processed")
             for item in sequences]
    return pairs, modes


def as_list(sequences: Any) -> Any:
    """A deque or other sequence as a list (the checks of what Rollouts record read lists and tuples)."""
    if isinstance(sequences, Sequence) and not isinstance(sequences, (str, bytes, list, tuple)):
        return list(sequences)
    return sequences


def _per_sequence(value: Any, n: int, name: str) -> list[Any]:
    """A scalar broadcast to n sequences, or a list of exactly n values."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise InputError(f"{name} has {len(value)} values for {n} sequences; give one per sequence "
                             f"or a single value")
        return list(value)
    return [value] * n


#: the logprob definition of a pair, which records no sampling: an unmodified softmax.
UNMODIFIED: tuple[float, int, float] = (1.0, 0, 1.0)


def logprob_definitions(sequences: Sequence[Any], modes: list[str], temperature: Any, top_k: Any,
                        top_p: Any) -> list[tuple[float, int, float]]:
    """(temperature, top_k, top_p) each sequence is scored under: a Rollout's record, else the explicit
    values, else (pairs) `UNMODIFIED`. A contradiction is a ConfigError; a processed-mode Rollout
    with neither is an InputError.
    """
    n = len(modes)
    given = {name: _per_sequence(value, n, name)
             for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p))}
    out = []
    for i, (item, mode) in enumerate(zip(sequences, modes)):
        where = f"sequences[{i}]"
        explicit = {name: values[i] for name, values in given.items() if values[i] is not None}
        record = item.sampling if isinstance(item, Rollout) else None
        if record is not None:
            for name, value in explicit.items():
                if value != getattr(record, name):
                    raise ConfigError(
                        f"{where}: {name}={value!r} contradicts {name}={getattr(record, name)!r}, which "
                        f"rollout {item.request_id!r}/{item.sample_index} was sampled with; leave {name} "
                        "unset to score each rollout under its own sampling")
            params = (record.temperature, record.top_k, record.top_p)
        elif isinstance(item, Rollout) and mode == "processed" and not explicit:
            raise InputError(
                f"{where}: rollout {item.request_id!r}/{item.sample_index} has processed logprobs but no "
                "record of the sampling they depend on (Rollout.sampling); pass temperature=, top_k= and "
                "top_p= as it was sampled (parity score: --temperature, --top-k, --top-p), or score it "
                "with logprobs_mode='raw'")
        else:
            params = (explicit.get("temperature", UNMODIFIED[0]), explicit.get("top_k", UNMODIFIED[1]),
                      explicit.get("top_p", UNMODIFIED[2]))
        _check_params(*params, where)
        if mode == "processed":
            sampler.check_temperature(params[0], where)
        out.append(params)
    return out


def _check_params(temperature: float, top_k: int, top_p: float, where: str) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature < 0:
        raise ConfigError(f"{where}: temperature must be a finite number >= 0 (0 = greedy), "
                          f"got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ConfigError(f"{where}: top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ConfigError(f"{where}: top_p must be in (0, 1] (1 = off), got {top_p!r}")


#: rollout meta keys of the layout a reference engine sampled in: `reduction_groups` (None: the
#: whole model; k: parity's TP-invariant layout summing k groups) and `tp_reduction`.
LAYOUT_META = ("reduction_groups", "tp_reduction")


def scoring_layout(sequences: Sequence[Any], tensor_parallel_size: int | None, tp_reduction: str | None,
                   reduction_groups: int | None) -> tuple[int | None, str, int]:
    """(tensor_parallel_size, tp_reduction, reduction_groups) to score in: as recorded, else given, else
    the whole model. A contradiction is a ConfigError (the drift would be the layout's); mixed
    records are an InputError.
    """
    items = sequences if isinstance(sequences, (list, tuple)) else ()  # anything else: as_pairs' error
    recorded = set()
    for item in items:
        if isinstance(item, Rollout) and "reduction_groups" in item.meta:
            groups, reduction = item.meta["reduction_groups"], item.meta.get("tp_reduction") or "canonical"
            if not (groups is None or (isinstance(groups, int) and not isinstance(groups, bool))) \
                    or not isinstance(reduction, str):
                raise InputError(f"rollout {item.request_id!r}/{item.sample_index}: meta reduction_groups="
                                 f"{groups!r}, tp_reduction={reduction!r} is not a layout (an integer or "
                                 "null, and a name); fix or drop these meta keys")
            recorded.add((groups, reduction))
    if not recorded:
        return (tensor_parallel_size, "canonical" if tp_reduction is None else tp_reduction,
                REDUCTION_GROUPS if reduction_groups is None else reduction_groups)
    if len(recorded) > 1:
        seen = ", ".join(sorted("whole model" if g is None else f"{g} reduction groups ({r})"
                                for g, r in recorded))
        raise InputError(f"the rollouts were sampled in different tensor-parallel layouts ({seen}); "
                         "score the rollouts of each layout in a call of their own")
    groups, reduction = recorded.pop()
    if groups is None:
        if tensor_parallel_size is not None:
            raise ConfigError(f"tensor_parallel_size={tensor_parallel_size} contradicts the rollouts' "
                              "record: they were sampled by the whole model (meta reduction_groups=None); "
                              "leave tensor_parallel_size unset to score them in the layout they record")
        return None, "canonical", REDUCTION_GROUPS
    for name, given, mine in (("reduction_groups", reduction_groups, groups),
                              ("tp_reduction", tp_reduction, reduction)):
        if given is not None and given != mine:
            raise ConfigError(f"{name}={given!r} contradicts the rollouts' record ({name}={mine!r}, the "
                              f"tensor-parallel layout they were sampled in); leave {name} unset to score "
                              "them in the layout they record")
    return 1 if tensor_parallel_size is None else tensor_parallel_size, reduction, groups


def scoring_adapter(sequences: Sequence[Any], lora: str | os.PathLike[str] | LoraSpec | None,
                    model: str | os.PathLike[str] | LoadedModel) -> str | os.PathLike[str] | LoraSpec | None:
    """The LoRA adapter to score with: the recorded one, else `lora`, else a LoadedModel's. Another
    hash, or a recorded adapter changed or gone, is a ConfigError (it would measure the adapters'
    difference); mixed records are an InputError.
    """
    items = sequences if isinstance(sequences, (list, tuple)) else ()  # anything else: as_pairs' error
    rollouts = [item for item in items if isinstance(item, Rollout)]
    recorded = {(item.meta.get("lora") or {}).get("hash") for item in rollouts if "lora" in item.meta}
    if not recorded:
        return lora
    if len(recorded) > 1 or len(rollouts) != sum("lora" in item.meta for item in rollouts):
        raise InputError("the rollouts were sampled with different LoRA adapters (or some with one and some "
                         "without); score the rollouts of each adapter in a call of their own")
    (wanted,) = recorded
    record = next(item.meta["lora"] for item in rollouts)
    path = model.path if isinstance(model, LoadedModel) else resolve_model(model)
    given = lora if lora is not None else getattr(model, "lora", None)
    if given is not None:
        spec = given if isinstance(given, LoraSpec) else check_adapter(given, path)
        if spec.hash != wanted:
            raise ConfigError(f"LoRA adapter {str(spec.path)!r} (hash {spec.hash}) contradicts the rollouts' "
                              f"record: they were sampled with adapter {record.get('path')!r} (hash "
                              f"{wanted}); leave lora unset to score them with the adapter they record")
        return spec
    try:
        spec = check_adapter(record.get("path", ""), path)
    except AdapterError as exc:
        raise ConfigError(f"the rollouts were sampled with LoRA adapter {record.get('path')!r} (hash "
                          f"{wanted}), which cannot be read here ({exc}); pass lora= (--lora) its "
                          "directory") from exc
    if spec.hash != wanted:
        raise ConfigError(f"the rollouts were sampled with LoRA adapter {record.get('path')!r} (hash "
                          f"{wanted}), but that directory now holds hash {spec.hash}; pass lora= (--lora) "
                          "the adapter they were sampled with")
    return spec


def check_recorded_model(sequences: Sequence[Any], model: str | os.PathLike[str] | LoadedModel) -> None:
    """ConfigError when Rollouts record the hash of the model they were sampled with (meta
    "model_hash") and a model given by name or path has another (`check_sampled_with`); a LoadedModel
    (a policy being trained, its weights no longer the checkpoint's) is not compared."""
    if isinstance(model, LoadedModel) or not isinstance(sequences, (list, tuple)):
        return
    check_sampled_with(model, hashes=[item.meta.get("model_hash") for item in sequences
                                      if isinstance(item, Rollout)])


def check_own_weights(model: Any, config: TrainConfig) -> None:
    """ConfigError when a LoadedModel is to be scored in another dtype or on another device than its
    own: `load_model` would read its checkpoint again, and the weights it holds now (a policy being
    trained, an engine's pushed weights) would be silently replaced by the checkpoint's."""
    if isinstance(model, LoadedModel) and (model.dtype != config.dtype or model.device != config.device):
        raise ConfigError(f"model is a LoadedModel in {model.dtype} on {model.device}, but the training "
                          f"forward was asked for {config.dtype} on {config.device}: it would score the "
                          f"checkpoint {str(model.path)!r} instead of the weights the LoadedModel holds; "
                          f"pass dtype={model.dtype!r} and device={model.device!r}, or the checkpoint's name "
                          "or path to score the checkpoint")


def train_forward(model: str | LoadedModel,
                  sequences: Sequence[Rollout | tuple[Sequence[int], Sequence[int]]],
                  config: TrainConfig | None = None, *,
                  logprobs_mode: str | None = None,
                  temperature: float | Sequence[float | None] | None = None,
                  top_k: int | Sequence[int | None] | None = None,
                  top_p: float | Sequence[float | None] | None = None,
                  record_routes: bool = False,
                  router_replay: str | routing.RouterReplay | None = None,
                  routes: Sequence[Any] | None = None,
                  lora: str | os.PathLike[str] | LoraSpec | None = None,
                  distribution: bool = False,
                  **settings: Any) -> TrainResult:
    """Teacher-forced logprobs of each sequence's response tokens (`TrainResult.logprobs`).

    sequences: Rollouts or (prompt_ids, response_ids) pairs. Keyword `settings` override `config`'s
    fields (unknown ones: ConfigError). Rollouts are scored in the layout, sampling and adapter they
    record (`scoring_layout`, `logprob_definitions`, `scoring_adapter`); a contradicting value is a
    ConfigError. temperature/top_k/top_p: for sequences without a record (pairs: unmodified
    softmax); a processed-mode Rollout with neither is an InputError, never guessed.
    logprobs_mode: None is each Rollout's own. record_routes: `TrainResult.routes`.
    router_replay: None, "R3", "R2" or a `RouterReplay` (`parity.models.routing`).
    lora: for a model given by name (not with tensor parallelism).
    distribution: `TrainResult.views` against each Rollout's `top_k_ids`.
    """
    unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(TrainConfig)})
    if unknown:  # a typo of a logprob-definition keyword lands here too: list both kinds
        raise ConfigError(f"train_forward: unknown argument(s) {unknown}; the training settings are "
                          f"{sorted(f.name for f in dataclasses.fields(TrainConfig))} and the other keywords "
                          f"{list(DEFINITION_KEYWORDS)}")
    config = (config or TrainConfig()).replace(**settings)
    sequences = as_list(sequences)
    check_own_weights(model, config)
    tp, reduction, groups = scoring_layout(sequences, config.tensor_parallel_size, config.tp_reduction,
                                           config.reduction_groups)
    config = replace(config, tensor_parallel_size=tp, tp_reduction=reduction, reduction_groups=groups)
    lora = scoring_adapter(sequences, lora, model)
    check_recorded_model(sequences, model)
    options = dict(logprobs_mode=logprobs_mode, temperature=temperature, top_k=top_k, top_p=top_p,
                   record_routes=record_routes, router_replay=router_replay, routes=routes,
                   distribution=distribution)
    if distribution and not all(isinstance(s, Rollout) and s.top_k_ids is not None for s in sequences):
        raise InputError("train_forward(distribution=True) reads each rollout's engine top-k: every sequence "
                         "must be a Rollout with top_k_ids (sample with top_k_logprobs > 0)")
    if lora is not None or getattr(model, "lora", None) is not None:
        check_without_tensor_parallel(tp, "tensor_parallel_size")
    check_shard_layout(model, tp, reduction, groups)  # a shard of another layout: its own sum, mislabelled
    if tp is not None and not (isinstance(model, LoadedModel) and model.tensor_parallel_size == tp):
        if tp > 1:
            if isinstance(model, LoadedModel) and not is_shared(model):
                raise ConfigError("tensor_parallel_size > 1 loads the checkpoint in every rank, so the "
                                  "weights this private model copy holds now (a policy being trained, "
                                  "pushed weights) would not reach them; score it with "
                                  "tensor_parallel_size=None, or save its weights as a checkpoint and pass "
                                  "that path")
            whole = load_model(model, dtype=config.dtype, device="cpu")
            check_shardable(whole, tp)
            factory = functools.partial(_RankTrainer, str(whole.path), config)
            with RankGroup(tp, torch.device(config.device).type, factory) as ranks:
                return ranks.call("run", list(sequences), config, options)
        model = shard_model(model, Comm.single(), dtype=config.dtype, device=config.device,
                            reduction=reduction, reduction_groups=groups)
    lm = load_model(model, dtype=config.dtype, device=config.device, lora=lora)
    pairs, modes = pairs_and_modes(sequences, logprobs_mode)
    n = len(pairs)
    size = n if config.micro_batch_size is None else config.micro_batch_size
    definitions = logprob_definitions(sequences, modes, temperature, top_k, top_p)
    for i, (prompt, response) in enumerate(pairs):
        where = f"sequences[{i}]"
        if not prompt:
            raise InputError(f"{where}: prompt_ids is empty; give at least one prompt token")
        check_token_ids(prompt + response, lm, where)
        check_length(len(prompt) + len(response), lm, where)
        if distribution:  # an id past the vocabulary would index the trainer's rows out of bounds
            check_top_k(sequences[i].top_k_ids, sequences[i].top_k_logprobs, where, vocab_size=lm.vocab_size)
    replay = routing.RouterReplay.of(router_replay)
    forced = replay_routes(lm, sequences, [len(p) + len(r) for p, r in pairs], replay, routes)
    logprobs: list[torch.Tensor] = []
    recorded: list[torch.Tensor | None] = []
    views: list[TrainerView] = []
    with torch.inference_mode(not config.grad), kernel_scope(config.kernels):
        for start in range(0, n, max(size, 1)):
            part = range(start, min(n, start + size))
            params = sampler.RowParams(tuple(float(definitions[i][0]) for i in part),
                                       tuple(definitions[i][1] for i in part),
                                       tuple(float(definitions[i][2]) for i in part))
            lp, rt, vw = _micro_batch(lm, [pairs[i] for i in part], [modes[i] for i in part], params,
                                      config.layout, record_routes and lm.is_moe, replay,
                                      None if forced is None else [forced[i] for i in part],
                                      [sequences[i].top_k_ids for i in part] if distribution else None)
            logprobs.extend(lp)
            recorded.extend(rt if rt else [None] * len(part))
            views.extend(vw)
    return TrainResult(logprobs, recorded if record_routes else None, views if distribution else None)


def _micro_batch(lm: LoadedModel, pairs: list[Pair], modes: list[str], params: sampler.RowParams,
                 layout: str, want_routes: bool, replay: routing.RouterReplay | None = None,
                 forced: list[torch.Tensor] | None = None, top_k_ids: list[np.ndarray] | None = None
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[TrainerView]]:
    """One prefill of `pairs` in `layout`: per-sequence response logprobs, routes and views if asked."""
    lengths = [len(p) + len(r) for p, r in pairs]
    b, width = len(pairs), max(lengths)
    scratch = b  # the KV slot every padding token writes to
    pad_id = getattr(lm.config, "pad_token_id", None) or 0
    if layout == "packed":
        ids = [t for p, r in pairs for t in (*p, *r)]
        input_ids = torch.tensor([ids])
        position_ids = torch.tensor([[pos for length in lengths for pos in range(length)]])
        slots = torch.tensor([i for i, length in enumerate(lengths) for _ in range(length)])
        first = [sum(lengths[:i]) for i in range(b)]
    else:
        input_ids = torch.full((b, width), pad_id)
        position_ids = torch.zeros((b, width), dtype=torch.int64)
        slots = torch.full((b, width), scratch)
        first = []
        for i, ((prompt, response), length) in enumerate(zip(pairs, lengths)):
            col = 0 if layout == "right" else width - length
            input_ids[i, col:col + length] = torch.tensor([*prompt, *response])
            position_ids[i, col:col + length] = torch.arange(length)
            slots[i, col:col + length] = i
            first.append(i * width + col)
        slots = slots.reshape(-1)
    device = lm.device

    def run() -> torch.Tensor:
        # a fresh cache per forward: router replay R2 runs the micro-batch twice
        cache = KVCache.allocate(lm.config, b + 1, width, lm.torch_dtype, device)
        return forward.final_hidden(lm, input_ids.to(device), position_ids.to(device), cache,
                                    slots.to(device))

    hidden, all_routes = routing.run_routed(run, lm.num_moe_layers, replay=replay,
                                            spans=list(zip(first, forced or [])), rows=input_ids.numel(),
                                            device=device, record=want_routes)
    # The logits at position j predict token j + 1: response token t sits at len(prompt) + t.
    rows = [first[i] + len(p) - 1 + t for i, (p, r) in enumerate(pairs) for t in range(len(r))]
    counts = [len(r) for _, r in pairs]
    tokens = torch.tensor([t for _, r in pairs for t in r], dtype=torch.int64)
    row_params = params.repeat(counts)
    logits = forward.logits(lm, hidden[rows])
    processed = sampler.processed_logprobs(logits, row_params)
    row_modes = [m for m, c in zip(modes, counts) for _ in range(c)]
    table = sampler.reported_table(logits, processed, row_modes)
    picked = table.gather(1, tokens.to(logits.device).unsqueeze(1)).squeeze(1)
    logprobs = list(picked.cpu().split(counts))
    views = [] if top_k_ids is None else [
        device_view(rows, torch.as_tensor(ids, dtype=torch.int64, device=rows.device),
                    sampled.to(rows.device))
        for rows, ids, sampled in zip(table.split(counts), top_k_ids, tokens.split(counts))]
    if not want_routes:
        return logprobs, [], views
    all_routes = all_routes.cpu()
    return logprobs, [all_routes[first[i]:first[i] + length - 1] for i, length in enumerate(lengths)], views


class _RankTrainer:
    """One rank of a tensor-parallel training forward (built inside a `RankGroup` rank process)."""

    def __init__(self, path: str, config: TrainConfig, comm: Comm) -> None:
        self.lm = shard_model(path, comm, dtype=config.dtype, device=config.device,
                              reduction=config.tp_reduction, reduction_groups=config.reduction_groups)

    def run(self, sequences: list[Any], config: TrainConfig, options: dict[str, Any]) -> TrainResult:
        """`train_forward` on this rank's shard (`config` holds its degree and groups, so it runs here)."""
        return train_forward(self.lm, sequences, config, **options)


def replay_routes(lm: LoadedModel, sequences: Sequence[Any], lengths: Sequence[int],
                  replay: routing.RouterReplay | None,
                  routes: Sequence[Any] | None) -> list[torch.Tensor] | None:
    """The checked expert ids R3 forces per sequence, int64 `[length - 1, moe_layers, top_k]` (`routes`
    override recorded ones); None unless R3. Dense models or bad shapes raise a ParityError.
    """
    if routes is not None and (replay is None or replay.mode != "R3"):
        raise ConfigError("routes= are forced only with router_replay='R3'")
    if replay is None:
        return None
    if not lm.is_moe:
        raise ConfigError(f"router_replay={replay.mode!r} needs an MoE model; {lm.name!r} is dense "
                          "(it has no routers)")
    if replay.mode != "R3":
        return None
    if routes is not None and len(routes) != len(sequences):
        raise InputError(f"routes has {len(routes)} arrays for {len(sequences)} sequences; "
                         "give one per sequence")
    forced = []
    for i, (item, length) in enumerate(zip(sequences, lengths)):
        given = routes[i] if routes is not None else getattr(item, "routed_experts", None)
        if given is None:
            raise InputError(f"sequences[{i}] has no routed_experts to replay; sample with routes recorded "
                             "(ReferenceEngine(record_routes=True), a backend's return_routed_experts) or "
                             "pass routes=")
        ids = check_routes(given, positions=length - 1, moe_layers=lm.num_moe_layers, top_k=lm.moe_top_k,
                           num_experts=lm.num_experts, where=f"sequences[{i}] routed_experts")
        forced.append(torch.from_numpy(ids).to(torch.int64))
    return forced
