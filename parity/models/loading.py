"""Load a HF causal LM once per (path, dtype, device) and patch it so the kernel switch governs it.
Patching (`patches.py`) only reroutes ops through `parity.kernels.ops`, whose stock branch is the
module's own, so with every family off the patched model computes exactly what the unpatched one
does with parity's attention function (which HF's own sdpa does not match to the bit).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from parity.core.errors import AdapterError, ConfigError
from parity.core.schema import DTYPES
from parity.core.strict import check_dtype
from parity.kernels import prepare
from parity.kernels.attention import ATTENTION_NAME
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
from parity.models.patches import LoraWeights, ParityLinear, patch_ops

#: parity dtype name -> torch dtype.
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}
#: architectures whose every op parity patches (RMSNorm with HF's formula, SwiGLU, static RoPE).
SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                     "Qwen3MoeForCausalLM", "MixtralForCausalLM"})
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
    num_moe_layers = patch_ops(hf, max_len)
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
