"""Random-weight models with the shapes of real ones (vocabulary, head size, experts), for GPU tests
and benchmarks; transformers' seeded init built on the device, saved as a local checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from parity.core.errors import ConfigError

#: shape name -> (architecture, config fields). Sources: each model's published config.json.
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    # Qwen3-1.7B
    "qwen3-1.7b": ("Qwen3ForCausalLM", {
        "hidden_size": 2048, "intermediate_size": 6144, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
        "rope_theta": 1000000.0}),
    # a smaller Qwen3 (Qwen3-0.6B's head layout at hidden 1024) with a Llama-2-sized vocabulary
    "qwen3-1024": ("Qwen3ForCausalLM", {
        "hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 32000, "tie_word_embeddings": True,
        "rope_theta": 1000000.0}),
    # SmolLM2-135M (a Llama): the CPU benchmarks' model
    "smollm2-135m": ("LlamaForCausalLM", {
        "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True,
        "rope_theta": 100000.0}),
    # Llama-3.2-1B
    "llama-3.2-1b": ("LlamaForCausalLM", {
        "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "tie_word_embeddings": True,
        "rope_theta": 500000.0}),
    # a MoE with Qwen3-MoE's router: 64 experts, top-8, hidden 1024
    "moe-64x8": ("Qwen3MoeForCausalLM", {
        "hidden_size": 1024, "intermediate_size": 3072, "moe_intermediate_size": 512, "num_experts": 64,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 32000,
        "tie_word_embeddings": False, "rope_theta": 1000000.0}),
    # Qwen3-30B-A3B
    "qwen3-30b-a3b": ("Qwen3MoeForCausalLM", {
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
        "tie_word_embeddings": False, "rope_theta": 1000000.0}),
}


def shaped_config(shape: str, layers: int, *, vocab_size: int | None = None,
                  max_position_embeddings: int = 1024) -> Any:
    """A transformers config of `shape` (SHAPES) with `layers` layers; ids 0/1/2 are pad/BOS/EOS."""
    if shape not in SHAPES:
        raise ConfigError(f"unknown model shape {shape!r}; choose from {sorted(SHAPES)}")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ConfigError(f"layers must be an integer >= 1, got {layers!r}")
    import transformers  # after the checks: a bad shape is refused without loading torch

    architecture, fields = SHAPES[shape]
    config_class = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    return config_class(**{**fields, "vocab_size": vocab_size or fields["vocab_size"]},
                        num_hidden_layers=layers, max_position_embeddings=max_position_embeddings,
                        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                        architectures=[architecture])


def build_random_model(config: Any, *, device: str = "cuda", dtype: str = "bfloat16", seed: int = 0) -> Any:
    """`config` with transformers' random initialization under `seed`, built directly on `device`
    in `dtype` (stock SDPA attention; `parity.models.loading.adopt_model` patches it for parity)."""
    # torch and transformers only to build a model: the shape table stays light
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype),
                                                attn_implementation="sdpa")


def save_random_model(config: Any, path: str | Path, *, device: str = "cuda", dtype: str = "bfloat16",
                      seed: int = 0) -> Path:
    """`build_random_model` saved to `path` as a local HF checkpoint; returns the path."""
    import torch  # only to save a model: the shape table stays light

    model = build_random_model(config, device=device, dtype=dtype, seed=seed)
    model.save_pretrained(path)
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return Path(path)
