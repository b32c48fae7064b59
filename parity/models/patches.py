"""The forwards parity puts into HF's modules so every op runs through `parity.kernels.ops`.
Each replacement computes what the module's own forward does (tests hold each to HF's source); the
stock branch of every op is the module's own, so with every kernel family off the bits are HF's.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from parity.core.errors import ConfigError
from parity.kernels import ops
from parity.kernels.moe import experts_forward
from parity.models.routing import ROUTERS, patch_router

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


def patch_ops(model: nn.Module, max_positions: int) -> int:
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
