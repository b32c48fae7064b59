"""Shard a loaded model for one rank of a tensor-parallel group: a CPU copy with this rank's shards
(KV heads replicated past their count), run by the engine and training forward like any model.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any

import torch
from torch import nn

from parity.core.errors import ConfigError
from parity.models.loading import LoadedModel, is_shared, load_model
from parity.models.lora import check_without_tensor_parallel
from parity.parallel.comm import Comm
from parity.parallel.layers import (
    REDUCTION_GROUPS,
    REDUCTIONS,
    ExpertParallelExperts,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
)

#: tensor-parallel degrees parity supports (each must also divide `reduction_groups`).
TP_DEGREES: tuple[int, ...] = (1, 2, 4, 8)
COLUMN_MLP = ("gate_proj", "up_proj")

#: TP=1 shards of checkpoints: key -> (the loaded model it was cut from, the shard).
_single: dict[tuple[str, str, str, str, int, int], tuple[nn.Module, LoadedModel]] = {}


def check_degree(size: Any, where: str = "tensor_parallel_size") -> int:
    """`size` if it is a supported degree, else a ConfigError naming the choices."""
    if isinstance(size, bool) or size not in TP_DEGREES:
        raise ConfigError(f"{where} must be one of {TP_DEGREES} (or None: no tensor parallelism), "
                          f"got {size!r}")
    return int(size)


def check_reduction_groups(groups: Any, size: int | None = None) -> int:
    """`groups` if it is a positive integer that the degree `size` divides (None: any), else a ConfigError."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ConfigError(f"reduction_groups must be a positive integer (K groups of the row-parallel sum, "
                          f"default {REDUCTION_GROUPS}), got {groups!r}")
    if size is not None and groups % size:
        raise ConfigError(f"reduction_groups={groups} is not divisible by tensor_parallel_size={size}; "
                          f"choose reduction_groups a multiple of the degree (e.g. {REDUCTION_GROUPS}) "
                          f"or a degree that divides {groups}")
    return groups


def check_shard_layout(model: Any, size: int | None, reduction: str, groups: int) -> None:
    """ConfigError when `model` is a tensor-parallel shard cut for another layout than the one asked
    for (`size` None: the whole model): it would run in its own sum under the asked-for label."""
    if not isinstance(model, LoadedModel) or model.tensor_parallel_size is None:
        return
    have = (model.tensor_parallel_size, model.tp_reduction, model.reduction_groups)
    if size is None or have != (size, reduction, groups):
        asked = ("the whole model (tensor_parallel_size=None)" if size is None else
                 f"tensor_parallel_size={size}, tp_reduction={reduction!r}, reduction_groups={groups}")
        raise ConfigError(f"model {model.name!r} is a tensor-parallel shard (tensor_parallel_size={have[0]}, "
                          f"tp_reduction={have[1]!r}, reduction_groups={have[2]}) but {asked} was asked "
                          "for; pass its checkpoint path or the unsharded model, or ask for the shard's "
                          "own settings")


def _divides(size: int, count: int, what: str, name: str) -> None:
    if count % size:
        raise ConfigError(f"tensor_parallel_size={size} does not divide {name}'s {what} ({count}); "
                          f"choose a degree that divides it")


def check_shardable(lm: LoadedModel, size: int) -> None:
    """ConfigError unless `size` ranks can split `lm`'s heads, KV heads, experts and MLPs (checked before
    any rank starts; the per-layer dimensions are checked again while sharding)."""
    config = lm.config
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    _divides(size, heads, "attention heads", lm.name)
    if size > kv_heads:
        _divides(kv_heads, size, "KV heads' multiple (KV heads are replicated)", lm.name)
    else:
        _divides(size, kv_heads, "KV heads", lm.name)
    if lm.is_moe:
        _divides(size, lm.num_experts, "experts", lm.name)
    for name, module in lm.model.named_modules():  # as shard_model finds them: a rank would fail late
        if _is_mlp(module):
            _divides(size, module.gate_proj.out_features, "MLP intermediate size", f"{lm.name} {name}")


def _is_mlp(module: nn.Module) -> bool:
    """Whether `module` is a gated MLP that shard_model cuts (column gate/up, row down)."""
    return all(isinstance(getattr(module, p, None), nn.Linear) for p in (*COLUMN_MLP, "down_proj"))


def _slice(t: torch.Tensor | None, rank: int, size: int, dim: int = 0) -> torch.Tensor | None:
    return None if t is None else t.chunk(size, dim=dim)[rank].clone()


def _column(linear: nn.Linear, rows: slice) -> None:
    """Keep output rows `rows` of `linear` (column parallel)."""
    linear.weight = nn.Parameter(linear.weight[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias[rows].clone(), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _shard_attention(attn: nn.Module, config: Any, comm: Comm, name: str, reduction: str,
                     groups: int) -> None:
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    d = attn.head_dim
    per = heads // comm.size
    _column(attn.q_proj, slice(comm.rank * per * d, (comm.rank + 1) * per * d))
    kv_per = max(kv_heads // comm.size, 1)
    kv_first = comm.rank * kv_heads // comm.size  # with replication: the one head this rank's queries use
    for proj in (attn.k_proj, attn.v_proj):
        _column(proj, slice(kv_first * d, (kv_first + kv_per) * d))
    attn.num_key_value_groups = per // kv_per
    attn.o_proj = _row(attn.o_proj, comm, name, reduction, groups)


def _row(linear: nn.Linear, comm: Comm, name: str, reduction: str, groups: int) -> RowParallelLinear:
    if linear.in_features % groups:
        raise ConfigError(f"reduction_groups={groups} does not divide {name}'s input features "
                          f"({linear.in_features}); choose reduction_groups that divides them")
    return RowParallelLinear(_slice(linear.weight.detach(), comm.rank, comm.size, 1), linear.bias, comm,
                             groups=groups, reduction=reduction)


def _shard_mlp(mlp: nn.Module, comm: Comm, name: str, reduction: str, groups: int) -> None:
    inner = mlp.gate_proj.out_features
    _divides(comm.size, inner, "MLP intermediate size", name)
    rows = slice(comm.rank * inner // comm.size, (comm.rank + 1) * inner // comm.size)
    _column(mlp.gate_proj, rows)
    _column(mlp.up_proj, rows)
    mlp.down_proj = _row(mlp.down_proj, comm, name, reduction, groups)


def _shard_experts(experts: nn.Module, comm: Comm, name: str) -> ExpertParallelExperts:
    total = experts.gate_up_proj.shape[0]
    _divides(comm.size, total, "experts", name)
    count = total // comm.size
    experts.gate_up_proj = nn.Parameter(_slice(experts.gate_up_proj.detach(), comm.rank, comm.size),
                                        requires_grad=False)
    experts.down_proj = nn.Parameter(_slice(experts.down_proj.detach(), comm.rank, comm.size),
                                     requires_grad=False)
    experts.num_experts = count
    return ExpertParallelExperts(experts, comm.rank * count, count, comm)


def _vocab_rows(weight: torch.Tensor, comm: Comm) -> tuple[torch.Tensor, int]:
    """This rank's slice of a [V, H] vocabulary matrix, zero-padded so every slice has ceil(V / size) rows."""
    rows = -(-weight.shape[0] // comm.size)
    start = comm.rank * rows
    part = weight[start:start + rows].detach()
    if part.shape[0] < rows:
        part = torch.cat([part, part.new_zeros(rows - part.shape[0], part.shape[1])])
    return part.clone(), start


def shard_model(model: str | os.PathLike[str] | LoadedModel, comm: Comm, *, dtype: str = "float32",
                device: str = "cpu", reduction: str = "canonical",
                reduction_groups: int = REDUCTION_GROUPS) -> LoadedModel:
    """This rank's shard of `model` as a LoadedModel on `device`. reduction: "canonical" or the
    "all_reduce" contrast; reduction_groups: the degree must divide it. Cached for a group of one over
    the checkpoint's weights (not over a private copy's); a model that is a shard already is refused.
    """
    if reduction not in REDUCTIONS:
        raise ConfigError(f"tp_reduction must be one of {REDUCTIONS}, got {reduction!r}")
    check_degree(comm.size)
    check_reduction_groups(reduction_groups, comm.size)
    base = load_model(model, dtype=dtype, device="cpu")
    if comm.size == 1 and (base.tensor_parallel_size, base.tp_reduction, base.reduction_groups,
                           base.device) == (1, reduction, reduction_groups, str(device)):
        return base  # the shard asked for already
    if base.tensor_parallel_size is not None:
        # its row-parallel layers are no nn.Linear: cut again they would keep their old sum (or fail)
        raise ConfigError(f"model {base.name!r} is already a tensor-parallel shard (tensor_parallel_size="
                          f"{base.tensor_parallel_size}, tp_reduction={base.tp_reduction!r}, "
                          f"reduction_groups={base.reduction_groups}); pass its checkpoint path or the "
                          "unsharded model instead")
    if base.lora is not None:  # the row-parallel and vocabulary layers would drop its deltas
        check_without_tensor_parallel(comm.size, f"the adapter of {base.name!r} (shard the model without it)")
    check_shardable(base, comm.size)
    # only the checkpoint's own weights are cached by path: a private copy (a policy being trained)
    # holds other weights under the same path
    cached = comm.size == 1 and is_shared(base)
    key = (str(base.path.resolve()), dtype, str(device), reduction, reduction_groups, comm.size)
    if cached and key in _single and _single[key][0] is base.model:  # not of a checkpoint since rewritten
        return _single[key][1]
    hf = copy.deepcopy(base.model)
    for name, module in list(hf.named_modules()):
        if hasattr(module, "q_proj") and hasattr(module, "o_proj"):
            _shard_attention(module, base.config, comm, name, reduction, reduction_groups)
        elif _is_mlp(module):
            _shard_mlp(module, comm, name, reduction, reduction_groups)
        elif hasattr(module, "experts") and hasattr(module.experts, "gate_up_proj"):
            module.experts = _shard_experts(module.experts, comm, name)
    inner = hf.model
    weight, start = _vocab_rows(inner.embed_tokens.weight, comm)
    inner.embed_tokens = VocabParallelEmbedding(weight, start, comm)
    head, _ = _vocab_rows(hf.lm_head.weight, comm)
    hf.lm_head = VocabParallelHead(head, None if hf.lm_head.bias is None else _vocab_rows(
        hf.lm_head.bias.unsqueeze(1), comm)[0].squeeze(1), base.vocab_size, comm)
    hf.to(device)
    config = copy.deepcopy(base.config)
    config.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    config.num_attention_heads //= comm.size
    config.num_key_value_heads = max(config.num_key_value_heads // comm.size, 1)
    sharded = dataclasses.replace(base, model=hf, config=config, device=str(device),
                                  tensor_parallel_size=comm.size, tensor_parallel_rank=comm.rank,
                                  tp_reduction=reduction, reduction_groups=reduction_groups)
    if cached:
        _single[key] = (base.model, sharded)
    return sharded
