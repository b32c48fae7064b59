"""Load a HF causal LM once per (path, dtype, device) and patch it so the kernel switch governs it.
Patching only reroutes ops through `parity.kernels.ops`, whose stock branch is the module's own,
so with every family off the patched model computes exactly what the unpatched one does with
parity's attention function (which HF's own sdpa does not match to the bit).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from parity.core.errors import AdapterError, ConfigError
from parity.core.schema import DTYPES
from parity.core.strict import check_dtype
from parity.kernels import ops, prepare
from parity.kernels.attention import ATTENTION_NAME
from parity.kernels.moe import experts_forward
from parity.models.checkpoints import (
    check_loaded,
    checkpoint_stamp,
    eos_token_ids,
    is_model_name,
    model_hash,
    resolve_model,
)
from parity.models.limits import check_moe, sliding_window
from parity.models.lora import ADAPTER_WEIGHTS, LoraSpec, check_adapter, check_without_tensor_parallel, fits
from parity.models.routing import ROUTERS, patch_router

#: parity dtype name -> torch dtype.
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}
#: architectures whose every op parity patches (RMSNorm with HF's formula, SwiGLU, static RoPE).
SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                     "Qwen3MoeForCausalLM", "MixtralForCausalLM"})
#: MLP classes whose forward is down_proj(act_fn(gate_proj(x)) * up_proj(x)) (a test reads their source).
GATED_MLPS = frozenset({"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "Qwen3MoeMLP"})
#: decoder layers whose forward is norm, attention, residual add, norm, MLP, residual add (a test reads
#: their source).
DECODER_LAYERS = frozenset({"LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
                            "Qwen3MoeDecoderLayer"})
#: attention classes whose forward norms q and k per head before the rotation (a test reads their source).
NORMED_ATTENTION = frozenset({"Qwen3Attention", "Qwen3MoeAttention"})
#: RoPE variants whose cos/sin depend on the position only (a table of all positions is exact).
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A patched HF *ForCausalLM in eval mode and the facts the engine needs about it.

    moe_top_k, num_experts: 0 for dense. model_hash: provenance. tensor_parallel_size: None, or k for
    rank `tensor_parallel_rank`'s shard (config holds its head counts), with its tp_reduction and
    reduction_groups. lora: the adapter its linears apply.
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
    lora: LoraSpec | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]


#: (checkpoint path, dtype, device, adapter hash or None) -> the loaded model; its files' stamps then.
_loaded: dict[tuple[str, str, str, str | None], LoadedModel] = {}
_stamps: dict[tuple[str, str, str, str | None], object] = {}


@dataclass(frozen=True, eq=False)
class LoraWeights:
    """One layer's LoRA adapter: a [r, in] and b [out, r], float32 on the layer's device, and the
    factor of their product (`LoraSpec.scaling`)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float


def lora_delta(x: torch.Tensor, lora: LoraWeights) -> torch.Tensor:
    """An adapter's contribution to a layer's output, float32 `[..., out]` for x `[..., in]`:
    (x A^T) B^T times the scaling, both products through the linear route (`ops.linear`, so as
    batch-invariant as the base product) on x upcast to float32 (exact), as peft computes it."""
    return ops.linear(ops.linear(x.to(torch.float32), lora.a), lora.b) * lora.scaling


class ParityLinear(nn.Linear):
    """nn.Linear whose product runs through `ops.linear` (family "matmul"), plus its LoRA adapter's
    contribution when one is attached (`parity_lora`), in the one order `parity.models.lora` documents."""

    parity_lora: LoraWeights | None = None
    #: on q_proj: (q_proj, k_proj, v_proj), whose products of one input may run as one launch
    parity_group: tuple[ParityLinear, ...] | None = None
    #: on k_proj and v_proj: (input, output) the group's first projection left for the same input
    parity_stash: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stash, self.parity_stash = self.parity_stash, None
        if stash is not None and stash[0] is x:
            return stash[1]
        if self.parity_group is not None and all(m.parity_lora is None and m.bias is None
                                                 for m in self.parity_group):
            outs = ops.linears(x, tuple(m.weight for m in self.parity_group))
            if outs is not None:
                for module, out in zip(self.parity_group[1:], outs[1:], strict=True):
                    module.parity_stash = (x, out)
                return outs[0]
        out = ops.linear(x, self.weight, self.bias)
        if self.parity_lora is None:
            return out
        # peft's order: the base output in the layer's dtype, the float32 contribution added to it
        # in float32, one rounding of the sum to the layer's dtype
        return (out.to(torch.float32) + lora_delta(x, self.parity_lora)).to(out.dtype)


class ParityActivation(nn.Module):
    """Wraps an elementwise activation module so it runs through `ops.activation` (family "pointwise")."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.activation(self.act, x)


def _gated_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF's gated MLP with act(gate) * up as one op (`ops.gated`: one pass on CUDA, the same bits)."""
    act = self.act_fn.act if isinstance(self.act_fn, ParityActivation) else self.act_fn
    return self.down_proj(ops.gated(act, self.gate_proj(x), self.up_proj(x)))


def _decoder_layer_forward(self: nn.Module, hidden_states: torch.Tensor,
                           attention_mask: torch.Tensor | None = None,
                           position_ids: torch.Tensor | None = None, past_key_values: object = None,
                           use_cache: bool | None = False,
                           position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                           **kwargs: object) -> torch.Tensor:
    """HF's decoder layer with each residual add and the norm that reads its sum as one op
    (`ops.add_rms_norm`: one pass on CUDA, the same bits). The norm after the MLP's add is the next
    layer's input norm (or the model's final one, `parity_next_norm`): its result waits in that
    norm's `parity_stash` for the call with this layer's output."""
    attended, _ = self.self_attn(
        hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
        position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache,
        position_embeddings=position_embeddings, **kwargs)
    if _hooked(self.post_attention_layernorm):  # a fused op would skip the module's hooks
        residual = hidden_states + attended
        normed = self.post_attention_layernorm(residual)
    else:
        normed, residual = _add_norm(hidden_states, attended, self.post_attention_layernorm)
    if self.parity_next_norm is None:
        return residual + self.mlp(normed)
    norm = self.parity_next_norm[0]
    norm.parity_stash = _add_norm(residual, self.mlp(normed), norm)
    return norm.parity_stash[1]


def _hooked(module: nn.Module) -> bool:
    """Whether calling `module` runs hooks (its own or global ones), which an op in its place would skip."""
    return bool(module._forward_hooks or module._forward_pre_hooks or nn.modules.module._global_forward_hooks
                or nn.modules.module._global_forward_pre_hooks)


def _add_norm(residual: torch.Tensor, delta: torch.Tensor,
              norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + delta), residual + delta) through `ops.add_rms_norm`."""
    return ops.add_rms_norm(residual, delta, norm.weight, norm.variance_epsilon, native=_native(norm))


def _chain_norms(model: nn.Module) -> None:
    """Give each rewritten decoder layer the RMSNorm that reads its output next (`parity_next_norm`, in
    a tuple so the module is not registered twice): the next layer's input norm, the last the final."""
    inner = getattr(model, "model", None)
    layers = list(getattr(inner, "layers", ()))
    norms = [later.input_layernorm for later in layers[1:]] + [getattr(inner, "norm", None)]
    for layer, norm in zip(layers, norms):
        if type(layer).__name__ in DECODER_LAYERS and type(norm).__name__.endswith("RMSNorm"):
            layer.parity_next_norm = (norm,)


def _normed_attention_forward(self: nn.Module, hidden_states: torch.Tensor,
                              position_embeddings: tuple[torch.Tensor, torch.Tensor],
                              attention_mask: torch.Tensor | None, past_key_values: object = None,
                              **kwargs: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    """HF's Qwen3 attention with q's and k's per-head norms and their rotation as one op
    (`ops.norm_rotary`: one launch on CUDA, the same bits)."""
    if _hooked(self.q_norm) or _hooked(self.k_norm):  # a fused op would skip the modules' hooks
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, past_key_values,
                                  **kwargs)
    module = sys.modules[type(self).__module__]
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    # q, k, v projected in HF's order: q_proj's grouped launch leaves k's and v's products for them
    query_states, key_states = ops.norm_rotary(
        self.q_proj(hidden_states).view(hidden_shape), self.k_proj(hidden_states).view(hidden_shape),
        self.q_norm, self.k_norm, *position_embeddings, rotate=module.apply_rotary_pos_emb)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    if past_key_values is not None:
        key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
    attention_interface = module.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                       module.eager_attention_forward)
    attn_output, attn_weights = attention_interface(
        self, query_states, key_states, value_states, attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
        sliding_window=self.sliding_window, **kwargs)
    return self.o_proj(attn_output.reshape(*input_shape, -1).contiguous()), attn_weights


def _native(module: nn.Module) -> Callable:
    """The module class's own forward, bound to `module` (the stock branch of a patched op)."""
    return type(module).forward.__get__(module)


def _rms_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    stash, self.parity_stash = self.parity_stash, None
    if stash is not None and stash[1] is x:  # the layer before computed it with its residual add
        return stash[0]
    return ops.rms_norm(x, self.weight, self.variance_epsilon, native=_native(self))


def _rotary_forward(self: nn.Module, x: torch.Tensor, position_ids: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    return ops.rotary(_native(self), x, position_ids, self.parity_max_positions, self.parity_tables)


def _patch_rotation(attention: nn.Module) -> None:
    """Wrap the module-global `apply_rotary_pos_emb` HF's attention calls with `ops.apply_rotary` (once
    per module; stock when "rotary" is off, so unpatched models keep their bits).
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


def _group_projections(attention: nn.Module) -> None:
    """Mark q/k/v as one group (`ParityLinear.parity_group`): HF's attention projects one input
    three times in a row, which a CUDA decode step can run as one launch (`ops.linears`)."""
    projections = tuple(getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj"))
    if all(isinstance(p, nn.Linear) for p in projections):
        projections[0].parity_group = projections


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
            module.parity_stash = None
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
            _group_projections(module)
            if kind in NORMED_ATTENTION:
                module.forward = types.MethodType(_normed_attention_forward, module)
        elif kind in ROUTERS:
            patch_router(module, moe_layers)
            moe_layers += 1
        elif kind.endswith("Experts") and hasattr(module, "gate_up_proj"):
            module.forward = types.MethodType(_experts_forward, module)
        elif kind in GATED_MLPS:
            module.forward = types.MethodType(_gated_mlp_forward, module)
        elif kind in DECODER_LAYERS:
            module.parity_next_norm = None
            module.forward = types.MethodType(_decoder_layer_forward, module)
        act = getattr(module, "act_fn", None)
        if isinstance(act, nn.Module) and not isinstance(act, ParityActivation):
            module.act_fn = ParityActivation(act)
    _chain_norms(model)
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
    """An HF causal LM built in this process -> patched LoadedModel, not cached (dropping it frees it);
    `path` holds its config.json.
    """
    hf.set_attn_implementation(ATTENTION_NAME)
    hf.eval()
    config = hf.config
    max_len = int(config.max_position_embeddings)
    num_moe_layers = _patch(hf, max_len)
    check_moe(config.to_dict(), str(path / "config.json"))  # a dense config passes
    prepare(hf)  # on CUDA: the load-time matmul route probe (cached per machine)
    # EOS as every backend reads it: generation_config.json first, the tokenizer's too (`eos_token_ids`)
    eos_ids = eos_token_ids(path)
    return LoadedModel(
        model=hf, config=config, path=path, name=name or path.name,
        dtype=dtype, device=str(device), is_moe=num_moe_layers > 0, num_moe_layers=num_moe_layers,
        moe_top_k=int(getattr(config, "num_experts_per_tok", 0) or 0) if num_moe_layers else 0,
        num_experts=int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0))
        if num_moe_layers else 0,
        vocab_size=int(config.vocab_size), max_len=min(max_len, sliding_window(config.to_dict()) or max_len),
        model_hash=model_hash(path), eos_token_ids=eos_ids,
    )


def load_model(model: str | os.PathLike[str] | LoadedModel, dtype: str = "float32",
               device: str = "cpu", lora: str | os.PathLike[str] | LoraSpec | None = None) -> LoadedModel:
    """A built-in name, checkpoint path or LoadedModel -> patched LoadedModel (cached); `lora` is
    checked against the checkpoint first; a LoadedModel keeps its adapter when lora is None.
    """
    check_dtype(dtype)
    check_device(device)
    if isinstance(model, LoadedModel):
        if lora is None:
            lora = model.lora
        same = _same_adapter(model.lora, lora, model.path)
        if model.dtype == dtype and model.device == str(device) and same:
            return model
        if lora is not None:
            check_without_tensor_parallel(model.tensor_parallel_size, "tensor_parallel_size")
        model = model.path
    path = resolve_model(model)
    spec = _adapter(lora, path)
    key = (str(path.resolve()), dtype, str(device), None if spec is None else spec.hash)
    stamp = checkpoint_stamp(path)  # before loading: files rewritten meanwhile are loaded again next time
    if key in _loaded and _stamps.get(key) == stamp:
        cached = _loaded[key]
        # the key is the adapter's content: the caller's own copy of it (its path) is the one it
        # recorded and may read again, while the first caller's directory may be gone
        if spec is not None and cached.lora is not None and cached.lora.path != spec.path:
            return dataclasses.replace(cached, lora=spec)
        return cached

    config = AutoConfig.from_pretrained(path)
    architectures = set(getattr(config, "architectures", None) or ())
    if not architectures & SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"model {os.fspath(model)!r} has architectures {sorted(architectures)}; the "
                          f"reference engine supports {sorted(SUPPORTED_ARCHITECTURES)}")
    hf, info = AutoModelForCausalLM.from_pretrained(  # info: checked below, so a mismatch is no crash
        path, dtype=TORCH_DTYPES[dtype], attn_implementation=ATTENTION_NAME, output_loading_info=True,
        ignore_mismatched_sizes=True)
    check_loaded(model, hf, info)
    hf.to(device)
    name = os.fspath(model)
    loaded = adopt_model(hf, path, dtype, device, name=name if is_model_name(name) else path.name)
    if spec is not None:
        loaded = dataclasses.replace(loaded, lora=spec)
        _attach(loaded.model, spec, device)
    _loaded[key], _stamps[key] = loaded, stamp
    return loaded


def is_shared(lm: LoadedModel) -> bool:
    """Whether `lm` is `load_model`'s cached model for its checkpoint, dtype, device and adapter (its
    weights are the checkpoint's), not a private copy whose weights may have moved (`copy_model`)."""
    return any(value.model is lm.model for value in _loaded.values())


def copy_model(lm: LoadedModel) -> LoadedModel:
    """A private deep copy of `lm` (patched as `lm` is, on its device, in its dtype), outside
    load_model's cache: its weights can change without changing anyone else's. For a model whose
    weights move (the RL loop's trainer, an engine receiving weight pushes)."""
    return dataclasses.replace(lm, model=copy.deepcopy(lm.model))


def tensor_digest(tensor: torch.Tensor) -> str:
    """An order-sensitive checksum of a tensor's bytes, on its device: Fletcher's "S1:S2" over its
    16-bit words and a third sum weighted by a hash of each word's place (exact integer sums), equal
    iff the bits are, barring collisions. Fletcher's weights are linear in the place and repeat every
    65,521 words, so +1 -1 -1 +1 on four neighbours, or a swap 65,521 words apart, kept both sums;
    the hashed weights see them.
    """
    words = tensor.detach().contiguous().view(-1).view(torch.int16).to(torch.int64) & 0xFFFF
    s1 = s2 = s3 = 0
    for start in range(0, words.numel(), _DIGEST_CHUNK):
        chunk = words[start:start + _DIGEST_CHUNK]
        index = torch.arange(start, start + chunk.numel(), device=chunk.device)
        s1 += int(chunk.sum())
        s2 += int((chunk * (index % 65521 + 1)).sum())
        # Knuth's multiplicative hash, 15 bits: each product < 2^31, a chunk's sum < 2^55 (no overflow)
        s3 += int((chunk * (((index * 2654435761) >> 16 & 0x7FFF) + 1)).sum())
    return f"{s1}:{s2}:{s3}"


#: words per step of `tensor_digest` (bounds its int64 temporaries to 128 MiB each).
_DIGEST_CHUNK = 1 << 24


def _adapter(lora: str | os.PathLike[str] | LoraSpec | None, path: Path) -> LoraSpec | None:
    """`lora` checked against checkpoint `path` (a LoraSpec checked against another checkpoint is
    checked again, `fits`), or None."""
    if lora is None:
        return None
    if isinstance(lora, LoraSpec):
        return fits(lora, path)
    return check_adapter(lora, path)


def _same_adapter(current: LoraSpec | None, wanted: str | os.PathLike[str] | LoraSpec | None,
                  path: Path) -> bool:
    spec = _adapter(wanted, path)
    return (current is None) == (spec is None) and (spec is None or current.hash == spec.hash)


def _attach(hf: nn.Module, spec: LoraSpec, device: str) -> None:
    """Give every module `spec` adapts its `LoraWeights` (float32, on `device`)."""
    tensors = load_file(str(spec.path / ADAPTER_WEIGHTS))
    for name in spec.modules:
        module = hf.get_submodule(name)
        if not isinstance(module, ParityLinear):
            raise AdapterError(f"adapter {str(spec.path)!r}: {name!r} is a {type(module).__name__}, not a "
                               "linear layer parity can adapt")
        prefix = f"base_model.model.{name}"
        with torch.inference_mode(False):  # usable by autograd code too, like the weights
            module.parity_lora = LoraWeights(
                a=tensors[f"{prefix}.lora_A.weight"].to(device=device, dtype=torch.float32),
                b=tensors[f"{prefix}.lora_B.weight"].to(device=device, dtype=torch.float32),
                scaling=spec.scaling)


def own_adapter(lm: LoadedModel) -> LoadedModel:
    """`lm` with a module tree of its own that shares every parameter and buffer with `lm`'s but
    holds its own copy of the adapter's tensors: a model whose adapter can be swapped
    (`swap_adapter`) without changing load_model's shared one, at the cost of the adapter alone."""
    shared = {id(t): t for t in itertools.chain(lm.model.parameters(), lm.model.buffers())}
    return dataclasses.replace(lm, model=copy.deepcopy(lm.model, memo=shared))


def swap_adapter(lm: LoadedModel, lora: str | os.PathLike[str] | LoraSpec) -> LoadedModel:
    """`lm` applying another adapter of the same rank and modules, written in place (captured graphs
    stay valid unless the scaling changed). `lm` must be the caller's own model; the returned one
    replaces it. AdapterError otherwise.
    """
    spec = _adapter(lora, lm.path)
    old = lm.lora
    if old is None or spec is None:
        raise AdapterError("swap_adapter: the model was loaded without a LoRA adapter; load it with lora= "
                           "to swap adapters at run time")
    if any(value is lm for value in _loaded.values()):
        raise AdapterError("swap_adapter: this model is load_model's shared one; swap on own_adapter(model)")
    if (spec.rank, spec.modules) != (old.rank, old.modules):
        raise AdapterError(f"swap_adapter: adapter {str(spec.path)!r} has rank {spec.rank} on "
                           f"{len(spec.modules)} modules; the running one has rank {old.rank} on "
                           f"{len(old.modules)}: a new rank or new modules need a new engine")
    tensors = load_file(str(spec.path / ADAPTER_WEIGHTS))
    with torch.no_grad():
        for name in spec.modules:
            module = lm.model.get_submodule(name)
            prefix = f"base_model.model.{name}"
            module.parity_lora.a.copy_(tensors[f"{prefix}.lora_A.weight"])
            module.parity_lora.b.copy_(tensors[f"{prefix}.lora_B.weight"])
            module.parity_lora = dataclasses.replace(module.parity_lora, scaling=spec.scaling)
    return dataclasses.replace(lm, lora=spec)
