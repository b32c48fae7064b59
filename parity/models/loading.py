"""Load a HF causal LM once per (path, dtype, device) and patch it so the kernel switch governs it.

The model classes are transformers' own (the ones a trainer's forward uses); patching only
reroutes ops through `parity.kernels.ops`, whose stock branch is the module's own computation.
So with every kernel family off the patched model computes exactly what the unpatched one does
(attention goes through the "parity" attention function, which runs stock SDPA then).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from parity.errors import ConfigError
from parity.kernels import ops, prepare
from parity.kernels.attention import ATTENTION_NAME
from parity.kernels.moe import experts_forward
from parity.models.checkpoints import is_model_name, model_hash, resolve_model
from parity.models.routing import ROUTERS, patch_router
from parity.schema import DTYPES
from parity.strict import check_dtype

#: parity dtype name -> torch dtype.
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}
#: architectures whose every op parity patches (RMSNorm with HF's formula, SwiGLU, static RoPE).
SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                     "Qwen3MoeForCausalLM", "MixtralForCausalLM"})
#: RoPE variants whose cos/sin depend on the position only (a table of all positions is exact).
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A patched HF *ForCausalLM in eval mode and the facts the engine needs about it.

    name: built-in name or the checkpoint directory's name; dtype: "float32" | "bfloat16" |
    "float16"; max_len: max_position_embeddings; moe_top_k, num_experts: 0 for dense models;
    model_hash: `parity.models.model_hash` of the checkpoint (provenance).
    tensor_parallel_size: None for the whole model, k for rank `tensor_parallel_rank`'s shard of a
    k-way tensor-parallel group (`parity.parallel.shard_model`), whose config then holds this
    rank's head counts; tp_reduction: that shard's row-parallel sum ("canonical" or "all_reduce");
    reduction_groups: that sum's K groups (None for the whole model).
    """

    model: nn.Module
    config: object
    path: Path
    name: str
    dtype: str
    device: str
    is_moe: bool
    num_moe_layers: int
    moe_top_k: int
    num_experts: int
    vocab_size: int
    max_len: int
    model_hash: str
    eos_token_ids: tuple[int, ...]
    tensor_parallel_size: int | None = None
    tensor_parallel_rank: int = 0
    tp_reduction: str = "canonical"
    reduction_groups: int | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]


_loaded: dict[tuple[str, str, str], LoadedModel] = {}


class ParityLinear(nn.Linear):
    """nn.Linear whose product runs through `ops.linear` (family "matmul")."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class ParityActivation(nn.Module):
    """Wraps an elementwise activation module so it runs through `ops.activation` (family "pointwise")."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.activation(self.act, x)


def _native(module: nn.Module) -> Callable:
    """The module class's own forward, bound to `module` (the stock branch of a patched op)."""
    return type(module).forward.__get__(module)


def _rms_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return ops.rms_norm(x, self.weight, self.variance_epsilon, native=_native(self))


def _rotary_forward(self: nn.Module, x: torch.Tensor, position_ids: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    return ops.rotary(_native(self), x, position_ids, self.parity_max_positions, self.parity_tables)


def _patch_rotation(attention: nn.Module) -> None:
    """Route the `apply_rotary_pos_emb` the attention module's code calls through `ops.apply_rotary`.

    HF calls it as a global of the model's modeling module, so that global is wrapped (once per
    module). The wrapper runs the stock function whenever the "rotary" family is off, so HF models
    that parity did not patch keep their exact stock bits.
    """
    module = sys.modules.get(type(attention).__module__)
    native = getattr(module, "apply_rotary_pos_emb", None)
    if native is None or getattr(native, "parity_native", None) is not None:
        return

    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.apply_rotary(native, q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.parity_native = native
    module.apply_rotary_pos_emb = apply_rotary_pos_emb


def _experts_forward(self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    return experts_forward(self, hidden, top_k_index, top_k_weights, native=_native(self))


def _patch(model: nn.Module, max_positions: int) -> int:
    """Reroute every op family of `model` through `parity.kernels.ops`; returns the number of MoE layers."""
    moe_layers = 0
    for module in list(model.modules()):
        kind = type(module).__name__
        if isinstance(module, nn.Linear):
            module.__class__ = ParityLinear
        elif kind.endswith("RMSNorm"):
            module.forward = types.MethodType(_rms_norm_forward, module)
        elif kind.endswith("RotaryEmbedding"):
            if module.rope_type not in STATIC_ROPE_TYPES:
                raise ConfigError(f"rope_type {module.rope_type!r} is position-dependent at run time; parity "
                                  f"supports {sorted(STATIC_ROPE_TYPES)}")
            module.parity_max_positions = max_positions
            module.parity_tables = {}
            module.forward = types.MethodType(_rotary_forward, module)
        elif kind.endswith("Attention") and hasattr(module, "q_proj"):
            _patch_rotation(module)
        elif kind in ROUTERS:
            patch_router(module, moe_layers)
            moe_layers += 1
        elif kind.endswith("Experts") and hasattr(module, "gate_up_proj"):
            module.forward = types.MethodType(_experts_forward, module)
        act = getattr(module, "act_fn", None)
        if isinstance(act, nn.Module) and not isinstance(act, ParityActivation):
            module.act_fn = ParityActivation(act)
    return moe_layers


def check_device(device: str | torch.device) -> str:
    """`device` as a string if the training forward can run there on this machine ("cpu", or a
    CUDA device that exists here), else ConfigError naming the choices."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ConfigError(f"device {device!r} is not a torch device; use 'cpu', 'cuda' or 'cuda:N'") from exc
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (parsed.index or 0) >= count:
            raise ConfigError(f"device {device!r}: this machine has {count} usable CUDA device(s)")
    elif parsed.type != "cpu":
        raise ConfigError(f"device {device!r}: parity runs models on 'cpu' or 'cuda', not {parsed.type!r}")
    return str(device)


def adopt_model(hf: nn.Module, path: Path, dtype: str, device: str, name: str | None = None) -> LoadedModel:
    """An HF causal LM already built in this process (on `device`, in `dtype`) -> patched LoadedModel.

    For models built in memory rather than read from a checkpoint, e.g. a random-weight model too
    large for the machine's disk (`parity.models.shaped.build_random_model`). `path` is a directory
    holding the model's config.json (the provenance hash covers the files there). The model is
    patched in place and switched to parity's attention; it is not added to load_model's cache, so
    dropping the LoadedModel frees it.
    """
    hf.set_attn_implementation(ATTENTION_NAME)
    hf.eval()
    config = hf.config
    max_len = int(config.max_position_embeddings)
    num_moe_layers = _patch(hf, max_len)
    prepare(hf)  # on CUDA: the load-time matmul route probe (cached per machine)
    eos = config.eos_token_id
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    return LoadedModel(
        model=hf, config=config, path=path, name=name or path.name,
        dtype=dtype, device=str(device), is_moe=num_moe_layers > 0, num_moe_layers=num_moe_layers,
        moe_top_k=int(getattr(config, "num_experts_per_tok", 0) or 0) if num_moe_layers else 0,
        num_experts=int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0))
        if num_moe_layers else 0,
        vocab_size=int(config.vocab_size), max_len=max_len, model_hash=model_hash(path),
        eos_token_ids=eos_ids,
    )


def load_model(model: str | os.PathLike[str] | LoadedModel, dtype: str = "float32",
               device: str = "cpu") -> LoadedModel:
    """A built-in name, a local HF checkpoint path or a LoadedModel -> patched LoadedModel (cached)."""
    check_dtype(dtype)
    check_device(device)
    if isinstance(model, LoadedModel):
        if model.dtype == dtype and model.device == str(device):
            return model
        model = model.path
    path = resolve_model(model)
    key = (str(path.resolve()), dtype, str(device))
    if key in _loaded:
        return _loaded[key]

    config = AutoConfig.from_pretrained(path)
    architectures = set(getattr(config, "architectures", None) or ())
    if not architectures & SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"model {os.fspath(model)!r} has architectures {sorted(architectures)}; the "
                          f"reference engine supports {sorted(SUPPORTED_ARCHITECTURES)}")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=TORCH_DTYPES[dtype],
                                              attn_implementation=ATTENTION_NAME)
    hf.to(device)
    name = os.fspath(model)
    loaded = adopt_model(hf, path, dtype, device, name=name if is_model_name(name) else path.name)
    _loaded[key] = loaded
    return loaded


def copy_model(lm: LoadedModel) -> LoadedModel:
    """A private deep copy of `lm` (patched as `lm` is, on its device, in its dtype), outside
    load_model's cache: its weights can change without changing anyone else's. For a model whose
    weights move (the RL loop's trainer, an engine receiving weight pushes)."""
    return dataclasses.replace(lm, model=copy.deepcopy(lm.model))


def tensor_digest(tensor: torch.Tensor) -> str:
    """An order-sensitive checksum of a tensor's bytes, computed on its device: Fletcher's two sums
    over its 16-bit words w_i, "S1:S2" with S1 = sum w_i and S2 = sum w_i (i mod 65521 + 1).

    Exact integer sums (no overflow below 2^31 words), so two tensors of one dtype and shape have
    the same digest when they hold the same bits, and a changed, swapped or missing word changes
    it. Made on the device so a GPU model's weights are checked without copying them to the host.
    """
    words = tensor.detach().contiguous().view(-1).view(torch.int16).to(torch.int64) & 0xFFFF
    s1 = s2 = 0
    for start in range(0, words.numel(), _DIGEST_CHUNK):
        chunk = words[start:start + _DIGEST_CHUNK]
        index = torch.arange(start, start + chunk.numel(), device=chunk.device)
        s1 += int(chunk.sum())
        s2 += int((chunk * (index % 65521 + 1)).sum())
    return f"{s1}:{s2}"


#: words per step of `tensor_digest` (bounds its int64 temporaries to 128 MiB each).
_DIGEST_CHUNK = 1 << 24
