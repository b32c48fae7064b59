"""The gold forward: each response token's logprob computed as exactly as the hardware allows, to
tell which side of a train/rollout mismatch moved.

Same tokens, weights and logprob definition (resolved as for the training forward), but stock
transformers with SDPA in a wide dtype: float64 on CPU, float32 without TF32 or reduced-precision
reductions on CUDA; it shares no kernel with either side. transformers' float32 islands (RMSNorm,
rotary cos/sin, MoE router softmax) are widened (`_exact`); scaled RoPE keeps float32 frequencies
(6e-8 relative). A LoRA adapter is merged in float64, rounded once. MoE routes are the gold's own.

`decide`: with `gold=None` it runs when its estimate, 2 x parameters x tokens / `GOLD_FLOPS`
(docs/PRECISION.md), is under `ALWAYS_SECONDS` or `DEFAULT_SHARE` of the row's seconds.
"""

from __future__ import annotations

import copy
import os
import types
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from parity.core.errors import ConfigError, InputError
from parity.core.strict import check_choice
from parity.core.types import Rollout
from parity.engine import sampler
from parity.engine.inputs import check_length, check_positive_int, check_token_ids, kernel_scope
from parity.engine.train import (
    as_list,
    check_recorded_model,
    logprob_definitions,
    pairs_and_modes,
    scoring_adapter,
)
from parity.models.checkpoints import resolve_model
from parity.models.loading import SUPPORTED_ARCHITECTURES, LoadedModel, check_device
from parity.models.lora import LoraSpec, adapter_deltas, check_adapter
from parity.models.patches import STATIC_ROPE_TYPES
from parity.models.routing import ROUTERS

#: the gold's dtype on each device type: float64 where the hardware computes it at full speed
#: relative to the model (CPU), float32 with every reduced-precision shortcut off on CUDA.
GOLD_DTYPES: dict[str, str] = {"cpu": "float64", "cuda": "float32"}
#: the dtypes a caller may ask the gold for (float32 on CPU: the sanity check of the float64 one).
ALLOWED_DTYPES: tuple[str, ...] = ("float64", "float32")
#: padded tokens per micro-batch: enough rows for full-width GEMMs on the tiny models, while a
#: float64 SmolLM2 micro-batch's activations stay near 100 MB.
BATCH_TOKENS = 4096

#: share of a row's time the gold may cost to run when nobody asked (`decide`).
DEFAULT_SHARE = 0.2
#: an estimate under this many seconds runs whatever the row took: a second is noise next to any
#: row (an engine start alone takes ~25 s on CPU), and a fixed bar keeps the built-in models' rows
#: from gaining or losing their gold with the machine's load (a warm tiny forward takes ~0.1 s).
ALWAYS_SECONDS = 1.0
#: the gold forward's throughput, 2 x parameters x tokens per second, end to end
#: (`benchmarks/test_gold_speed.py`, docs/PERF.md "Gold forward"). CPU: float64 on the one thread the
#: gold runs on (`_gold_settings`), SmolLM2 measured 4.7e10 wall (6.3e10 CPU time), rounded down.
#: CUDA: float32 without TF32, not yet measured: 10% of the H200's 67e12 fp32 peak until the
#: benchmark's CUDA rows replace it.
GOLD_FLOPS: dict[str, float] = {"cpu": 4.0e10, "cuda": 6.7e12}

Pair = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class GoldDecision:
    """Whether a row runs the gold and why: run; estimated_seconds (2 x parameters x tokens /
    `GOLD_FLOPS`); row_seconds (what the row spent before it: sampling and the training forward);
    reason, one clause a report shows."""

    run: bool
    estimated_seconds: float
    row_seconds: float
    reason: str


def decide(gold: bool | None, *, parameters: int, tokens: int, row_seconds: float,
           device: str) -> GoldDecision:
    """Whether the gold runs: `gold` when given; None runs it when its estimate is under
    `ALWAYS_SECONDS` or `DEFAULT_SHARE` of `row_seconds`.
    """
    estimate = 2.0 * parameters * tokens / GOLD_FLOPS[torch.device(device).type]
    if gold is not None:
        return GoldDecision(bool(gold), estimate, row_seconds, f"gold={gold} was asked for")
    size = f"({parameters:,} parameters x {tokens:,} tokens)"
    if estimate < ALWAYS_SECONDS:
        return GoldDecision(True, estimate, row_seconds,
                            f"by default: estimated {estimate:.3g} s, under {ALWAYS_SECONDS:g} s {size}")
    run = estimate <= DEFAULT_SHARE * row_seconds
    relation = "<=" if run else ">"
    return GoldDecision(run, estimate, row_seconds,
                        f"by default: estimated {estimate:.3g} s {relation} {DEFAULT_SHARE:.0%} of the row's "
                        f"{row_seconds:.3g} s {size}")


def gold_logprobs(model: str | os.PathLike[str] | LoadedModel,
                  sequences: Sequence[Rollout | tuple[Sequence[int], Sequence[int]]], *,
                  device: str = "cpu", dtype: str | None = None, logprobs_mode: str | None = None,
                  temperature: float | Sequence[float | None] | None = None,
                  top_k: int | Sequence[int | None] | None = None,
                  top_p: float | Sequence[float | None] | None = None,
                  batch_tokens: int = BATCH_TOKENS,
                  lora: str | os.PathLike[str] | LoraSpec | None = None) -> list[np.ndarray]:
    """Gold logprobs of each sequence's response tokens, float64 `[len(response)]` each, in input order.

    model: a name or checkpoint (read in the gold dtype), or a `LoadedModel` (current weights
    upcast; a TP shard is refused). The definition arguments and `lora` resolve as
    `train_forward`'s. dtype: None is `GOLD_DTYPES[device]`. batch_tokens: a memory bound only. A
    token outside the gold's own support (or not its argmax at temperature 0) gets -inf.
    """
    device = check_device(device)
    sequences = as_list(sequences)
    kind = torch.device(device).type
    dtype = gold_dtype(device) if dtype is None else check_choice(dtype, ALLOWED_DTYPES, "gold dtype")
    batch_tokens = check_positive_int(batch_tokens, "batch_tokens")
    pairs, modes = pairs_and_modes(sequences, logprobs_mode)
    definitions = logprob_definitions(sequences, modes, temperature, top_k, top_p)
    adapter = scoring_adapter(sequences, lora, model)
    check_recorded_model(sequences, model)
    if adapter is not None and not isinstance(adapter, LoraSpec):
        base = model.path if isinstance(model, LoadedModel) else resolve_model(model)
        adapter = check_adapter(adapter, base)
    module = gold_model(model, dtype=dtype, device=device, lora=adapter)
    for i, (prompt, response) in enumerate(pairs):
        where = f"sequences[{i}]"
        if not prompt:
            raise InputError(f"{where}: prompt_ids is empty; give at least one prompt token")
        check_token_ids(prompt + response, module.parity_gold, where)
        check_length(len(prompt) + len(response), module.parity_gold, where)
    out: list[np.ndarray | None] = [None] * len(pairs)
    with torch.inference_mode(), kernel_scope("native"), _gold_settings(kind):
        for batch in _micro_batches([len(p) + len(r) for p, r in pairs], batch_tokens):
            params = sampler.RowParams.of(*zip(*(definitions[i] for i in batch)))
            scored = _score(module, [pairs[i] for i in batch], [modes[i] for i in batch], params)
            for i, lp in zip(batch, scored):
                out[i] = lp
    return out


def gold_dtype(device: str) -> str:
    """The gold's dtype on `device` (`GOLD_DTYPES` of its type)."""
    return GOLD_DTYPES[torch.device(device).type]


def _micro_batches(lengths: list[int], budget: int) -> Iterator[list[int]]:
    """Sequence indices longest first, each group's padded size within `budget`, so padding stays small."""
    group: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        if group and (len(group) + 1) * lengths[group[0]] > budget:
            yield group
            group = []
        group.append(i)
    if group:
        yield group


def _score(module: PreTrainedModel, pairs: list[Pair], modes: list[str], params: sampler.RowParams
           ) -> list[np.ndarray]:
    """One right-padded forward of `pairs` (a causal model's real tokens never see the padding after
    them, so no mask); each sequence's response logprobs, LM head on response rows only.
    """
    lengths = [len(p) + len(r) for p, r in pairs]
    width = max(lengths)
    device = module.device
    ids = torch.zeros((len(pairs), width), dtype=torch.int64)
    for i, (prompt, response) in enumerate(pairs):
        ids[i, :lengths[i]] = torch.tensor([*prompt, *response])
    hidden = module.model(input_ids=ids.to(device), use_cache=False).last_hidden_state
    hidden = hidden.reshape(-1, hidden.shape[-1])
    # the logits at position j predict token j + 1: response token t sits at len(prompt) + t
    rows = [i * width + len(p) - 1 + t for i, (p, r) in enumerate(pairs) for t in range(len(r))]
    counts = [len(r) for _, r in pairs]
    tokens = torch.tensor([t for _, r in pairs for t in r], dtype=torch.int64, device=device)
    # int64 even when empty: a batch of empty responses indexes no rows (a float tensor cannot index)
    logits = module.lm_head(hidden[torch.tensor(rows, dtype=torch.int64, device=device)])
    row_params = params.repeat(counts)
    processed = sampler.processed_logprobs(logits, row_params)
    row_modes = [m for m, c in zip(modes, counts) for _ in range(c)]
    picked = sampler.reported_logprobs(logits, processed, tokens, row_modes)
    return [lp.numpy() for lp in picked.to("cpu", torch.float64).split(counts)]


@contextmanager
def _gold_settings(kind: str) -> Iterator[None]:
    """The gold's settings, restored on exit. CPU: one intra-op thread, since a float64 GEMM splits its
    sums by thread (tiny-llama's last bits differ between 1 and 2) and `GOLD_FLOPS` is that rate.
    CUDA: IEEE float32 (no TF32), full-precision fp16/bf16 reductions, SDPA's math backend.
    """
    if kind != "cuda":
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel  # CUDA only: the CPU path returned above

    matmul = torch.backends.cuda.matmul
    saved = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32,
             matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction)
    try:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = False
        matmul.allow_fp16_reduced_precision_reduction = False
        matmul.allow_bf16_reduced_precision_reduction = False
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.set_float32_matmul_precision(saved[0])
        (torch.backends.cudnn.allow_tf32, matmul.allow_fp16_reduced_precision_reduction,
         matmul.allow_bf16_reduced_precision_reduction) = saved[1:]


# -- the gold model ---------------------------------------------------------------------------------

#: checkpoint (path, dtype, device) -> its gold model.
_from_checkpoint: dict[tuple[str, str, str], PreTrainedModel] = {}
#: a LoadedModel's module -> (dtype, device) -> its gold model, refreshed from its weights on every use.
_from_memory: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, str], PreTrainedModel]] = \
    weakref.WeakKeyDictionary()


def gold_model(model: str | os.PathLike[str] | LoadedModel, *, dtype: str, device: str,
               lora: LoraSpec | None = None) -> PreTrainedModel:
    """The stock transformers model of `model` in `dtype` on `device` with SDPA, widened islands and
    `lora` merged; cached per (path, dtype, device, adapter); a LoadedModel's copy takes its current
    weights on every call.
    """
    torch_dtype = getattr(torch, dtype)
    if isinstance(model, LoadedModel):
        if model.tensor_parallel_size is not None:
            raise ConfigError(f"the gold forward needs the whole model, not tensor-parallel rank "
                              f"{model.tensor_parallel_rank} of {model.tensor_parallel_size}; pass the "
                              "checkpoint path or an unsharded LoadedModel")
        copies = _from_memory.setdefault(model.model, {})
        gold = copies.get((dtype, device))
        if gold is None:
            config = copy.deepcopy(model.config)
            gold = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation="sdpa",
                                                       experts_implementation="eager")
            gold = _exact(gold.to(device).eval(), model.name, model.path)
            copies[(dtype, device)] = gold
        with torch.no_grad():
            gold.load_state_dict(model.model.state_dict())  # copy_ upcasts: the weights as they are now
        return _merged(gold, lora)
    path = resolve_model(model)
    key = (str(path.resolve()), dtype, device, None if lora is None else lora.hash)
    if key not in _from_checkpoint:
        config = AutoConfig.from_pretrained(path)
        architectures = set(getattr(config, "architectures", None) or ())
        if not architectures & SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"model {os.fspath(model)!r} has architectures {sorted(architectures)}; the "
                              f"gold forward supports {sorted(SUPPORTED_ARCHITECTURES)}")
        gold = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa",
                                                       experts_implementation="eager")
        _from_checkpoint[key] = _merged(_exact(gold.to(device).eval(), os.fspath(model), path), lora)
    return _from_checkpoint[key]


def _merged(module: PreTrainedModel, lora: LoraSpec | None) -> PreTrainedModel:
    """`module` with the adapter's float64 updates added in place (rounded once)."""
    if lora is None:
        return module
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, delta in adapter_deltas(lora).items():
            weight = params[name]
            weight.copy_((weight.double() + torch.from_numpy(delta).to(weight.device)).to(weight.dtype))
    return module


def _exact(module: PreTrainedModel, name: str, path: os.PathLike[str]) -> PreTrainedModel:
    """`module` with RMSNorms, rotary and softmax routers computing in the wider of its dtype and float32."""
    for sub in module.modules():
        kind = type(sub).__name__
        if kind.endswith("RMSNorm"):
            sub.forward = types.MethodType(_rms_norm, sub)
        elif kind.endswith("RotaryEmbedding"):
            if sub.rope_type not in STATIC_ROPE_TYPES:
                raise ConfigError(f"rope_type {sub.rope_type!r} is position-dependent at run time; the gold "
                                  f"forward supports {sorted(STATIC_ROPE_TYPES)}")
            sub.gold_inv_freq = _inv_freq(sub, module.config)
            sub.forward = types.MethodType(_rotary, sub)
        elif kind in ROUTERS:
            spec = ROUTERS[kind]
            if spec.score != "softmax":
                raise ConfigError(f"the gold forward supports softmax MoE routers, not {kind}")
            sub.gold_spec = spec
            sub.forward = types.MethodType(_softmax_router, sub)
    config = module.config
    module.parity_gold = types.SimpleNamespace(  # what check_token_ids / check_length read
        name=name, path=path, vocab_size=int(config.vocab_size), max_len=int(config.max_position_embeddings))
    return module


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _rms_norm(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm with its float32 upcast made the wider of x's dtype and float32."""
    h = x.to(_wide(x.dtype))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(x.dtype)


def _inv_freq(rotary: nn.Module, config: Any) -> torch.Tensor:
    """Rotary inverse frequencies in float64 (default RoPE recomputed; scaled types upcast)."""
    given = rotary.inv_freq.to(torch.float64)
    if rotary.rope_type == "default":
        base = float(config.rope_parameters["rope_theta"])
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        exact = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64, device=given.device) / dim)
        if exact.shape == given.shape and torch.allclose(exact, given, rtol=1e-6, atol=0.0):
            return exact
    return given


def _rotary(self: nn.Module, x: torch.Tensor, position_ids: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, L, D] computed in float64 (float32's angle error is ~1e-4 rad at position 2,000)."""
    freqs = position_ids[..., None].to(torch.float64) * self.gold_inv_freq.to(x.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def _softmax_router(self: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' softmax top-k router with the softmax in the wider of the logits' dtype and float32."""
    hidden = hidden.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden, self.weight)
    probs = torch.softmax(logits.to(_wide(logits.dtype)), dim=-1)
    weights, experts = torch.topk(probs, self.top_k, dim=-1)
    spec = self.gold_spec
    if spec.normalize_attr is None or getattr(self, spec.normalize_attr):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if spec.weights_in_logits_dtype:
        weights = weights.to(logits.dtype)
    return logits, weights, experts
