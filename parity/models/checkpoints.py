"""Built-in tiny checkpoints: generated deterministically from a name and a seed, cached on disk.

Standard HF directories that transformers and vLLM load. Weights are PCG64 uniform doubles scaled
in float64 and rounded once to float32: the same bytes on every machine. Random models give
near-uniform distributions that hide drift, so layers are Kaiming-scaled and the head gives
logits of std ~`LOGIT_SCALE` nats with a Zipf-like gain (entropy 1-4 nats, tests/test_models.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from parity.core.errors import ConfigError, ModelNotFoundError
from parity.models.trained import TRAINED_MODELS, make_cache_dir, trained_dir, trained_names, trained_path

#: bump when the generator changes, so stale caches are never reused.
GENERATOR_VERSION = 2
#: target standard deviation of the logits, in nats, before the Zipf gain.
LOGIT_SCALE = 4.0
VOCAB_SIZE = 512
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
#: first id of the 256 byte tokens of the byte-level tokenizer.
BYTE_OFFSET = 3
#: a local checkpoint directory holds weights in one of these (sharded ones through an index).
WEIGHT_FILES: tuple[str, ...] = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json")

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
    "torch_dtype": "float32",
}


@dataclass(frozen=True)
class TinySpec:
    """A built-in checkpoint: its HF architecture, config overrides and seed."""

    name: str
    architecture: str
    model_type: str
    config: dict[str, Any]
    seed: int
    description: str

    @property
    def is_moe(self) -> bool:
        return "num_local_experts" in self.config or "num_experts" in self.config


BUILTIN_MODELS: dict[str, TinySpec] = {
    spec.name: spec
    for spec in (
        TinySpec("tiny-llama", "LlamaForCausalLM", "llama",
                 {"intermediate_size": 256, "attention_bias": False, "mlp_bias": False}, 1,
                 "dense Llama, 2 layers, GQA 4/2 heads"),
        TinySpec("tiny-qwen2", "Qwen2ForCausalLM", "qwen2",
                 {"intermediate_size": 256, "use_sliding_window": False}, 2,
                 "dense Qwen2 with q/k/v bias"),
        TinySpec("tiny-qwen3", "Qwen3ForCausalLM", "qwen3",
                 {"intermediate_size": 256, "attention_bias": False, "use_sliding_window": False}, 3,
                 "dense Qwen3 with q/k RMSNorm"),
        TinySpec("tiny-qwen3-moe", "Qwen3MoeForCausalLM", "qwen3_moe",
                 {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                  "intermediate_size": 256, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "norm_topk_prob": True, "attention_bias": False, "use_sliding_window": False,
                  "output_router_logits": False}, 4,
                 "Qwen3-MoE, 8 experts, top-2, every layer MoE"),
        TinySpec("tiny-mixtral", "MixtralForCausalLM", "mixtral",
                 {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64,
                  "sliding_window": None, "output_router_logits": False}, 5,
                 "Mixtral, 8 experts, top-2, every layer MoE"),
    )
}


def cache_dir() -> Path:
    """Where built-in checkpoints live: `$PARITY_CACHE`, else `~/.cache/parity`."""
    root = os.environ.get("PARITY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "parity")
    return Path(root) / "models"


def builtin_names() -> list[str]:
    return sorted(BUILTIN_MODELS)


def _config_dict(spec: TinySpec) -> dict[str, Any]:
    cfg = {**_COMMON, **spec.config, "architectures": [spec.architecture], "model_type": spec.model_type}
    cfg["parity_builtin"] = {"name": spec.name, "seed": spec.seed, "generator_version": GENERATOR_VERSION}
    return cfg


def _param_shapes(model_type: str, cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of every parameter, read off the HF class on the meta device."""
    # torch only to generate a checkpoint: resolving a cached one (parsing a case) stays light
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(p.shape) for name, p in model.state_dict().items()}


def _draw(rng: np.random.Generator, shape: tuple[int, ...], bound: float) -> np.ndarray:
    """Uniform in [-bound, bound): integers from PCG64 -> float64 -> one rounding to float32."""
    u = rng.random(size=shape, dtype=np.float64)
    return ((u * 2.0 - 1.0) * bound).astype(np.float32)


def _generate_weights(spec: TinySpec, cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    shapes = _param_shapes(spec.model_type, cfg)
    rng = np.random.Generator(np.random.PCG64(spec.seed))
    hidden = cfg["hidden_size"]
    out: dict[str, np.ndarray] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            # Norm gains near 1 with a little spread, so norms are not the identity.
            out[name] = (1.0 + _draw(rng, shape, 0.1).astype(np.float64)).astype(np.float32)
        elif name == "model.embed_tokens.weight":
            out[name] = _draw(rng, shape, np.sqrt(3.0))  # unit variance rows
        elif name == "lm_head.weight":
            # logit std = row std * sqrt(hidden) after the final RMSNorm; Zipf-like row gains.
            base = LOGIT_SCALE * np.sqrt(3.0) / np.sqrt(hidden)
            w = _draw(rng, shape, base).astype(np.float64)
            rank = rng.permutation(shape[0]).astype(np.float64) + 1.0
            gain = 0.6 + 0.8 / np.sqrt(rank / 8.0 + 1.0)
            out[name] = (w * gain[:, None]).astype(np.float32)
        elif name.endswith("bias"):
            out[name] = _draw(rng, shape, 0.1)
        elif "gate.weight" in name and len(shape) == 2 and shape[0] < shape[1]:
            # MoE router: larger scale so routing is decisive but not degenerate.
            out[name] = _draw(rng, shape, 2.0 * np.sqrt(3.0 / shape[-1]))
        else:
            # Kaiming-uniform on the input (last) dimension: keeps every layer's output O(1).
            out[name] = _draw(rng, shape, np.sqrt(3.0 / shape[-1]))
    return out


def _to_hub_layout(model_type: str, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """transformers' fused expert tensors split into the hub's per-expert names, which vLLM reads (Qwen3-MoE
    `experts.{e}.gate_proj/...`, Mixtral `block_sparse_moe.experts.{e}.w1/...`).
    """
    if model_type not in ("qwen3_moe", "mixtral"):
        return weights
    names = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}[model_type]
    out: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        prefix, _, leaf = name.rpartition(".experts.")
        if model_type == "mixtral":
            name = name.replace(".mlp.", ".block_sparse_moe.")
            prefix = prefix.replace(".mlp", ".block_sparse_moe")
        if leaf == "gate_up_proj":
            half = w.shape[1] // 2
            for e in range(w.shape[0]):
                out[f"{prefix}.experts.{e}.{names[0]}.weight"] = np.ascontiguousarray(w[e, :half])
                out[f"{prefix}.experts.{e}.{names[1]}.weight"] = np.ascontiguousarray(w[e, half:])
        elif leaf == "down_proj":
            for e in range(w.shape[0]):
                out[f"{prefix}.experts.{e}.{names[2]}.weight"] = np.ascontiguousarray(w[e])
        else:
            out[name] = w
    return out


def _write_tokenizer(path: Path) -> None:
    """A byte-level tokenizer: one token per UTF-8 byte (ids 3..258) plus <pad>, <s>, </s>."""
    # transformers only to generate a checkpoint: resolving a cached one stays light
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda ch: _byte_of_char(ch))
    vocab = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID}
    vocab.update({ch: BYTE_OFFSET + i for i, ch in enumerate(byte_chars)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.save_pretrained(str(path))


def _byte_of_char(ch: str) -> int:
    """The byte that GPT-2's byte-level alphabet maps to `ch` (inverse of bytes_to_unicode)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    code = ord(ch)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def _write_checkpoint(spec: TinySpec, path: Path) -> None:
    cfg = _config_dict(spec)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}, indent=2) + "\n")
    weights = _to_hub_layout(spec.model_type, _generate_weights(spec, cfg))
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer(tmp)
    try:
        os.replace(tmp, path)  # atomic: readers see a whole checkpoint or none
    except OSError:
        if not (path / "model.safetensors").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race


def builtin_dir(name: str) -> Path:
    """Where built-in checkpoint `name` lives (generated there on first use; nothing is made here)."""
    return cache_dir() / f"{name}-v{GENERATOR_VERSION}"


def builtin_path(name: str, *, regenerate: bool = False) -> Path:
    """Path of built-in checkpoint `name`, generating it on first use."""
    spec = BUILTIN_MODELS[name]
    path = builtin_dir(name)
    if regenerate and path.exists():
        shutil.rmtree(path)
    if not (path / "model.safetensors").exists():
        make_cache_dir(path.parent)
        _write_checkpoint(spec, path)
    return path


def model_names() -> list[str]:
    """Every model name `resolve_model` accepts: the built-in tiny checkpoints, then the trained
    models converted from installed packages (`parity.models.trained`)."""
    return builtin_names() + trained_names()


def is_model_name(model: str | os.PathLike[str]) -> bool:
    """Whether `model` is a name (built-in or trained) rather than a checkpoint path: only a `str`
    is ever a name, an os.PathLike is always a path."""
    return isinstance(model, str) and (model in BUILTIN_MODELS or model in TRAINED_MODELS)


def model_text(model: str | os.PathLike[str]) -> str:
    """`model` as a string that `resolve_model` reads as the same checkpoint: a path (an os.PathLike)
    spelled like a model name gets a "./" prefix, so it stays a path once it is a string."""
    text = os.fspath(model)
    if not isinstance(model, str) and (text in BUILTIN_MODELS or text in TRAINED_MODELS):
        return os.path.join(os.curdir, text)
    return text


def _named_dir(name: str) -> Path:
    return builtin_dir(name) if name in BUILTIN_MODELS else trained_dir(name, cache_dir())


def _named_path(name: str) -> Path:
    """The checkpoint of model name `name`, made on first use."""
    return builtin_path(name) if name in BUILTIN_MODELS else trained_path(name, cache_dir())


def _refuse_shadowed(name: str) -> None:
    """ModelNotFoundError when model name `name` is also a checkpoint directory in the working directory
    (another checkpoint than the name's): either reading would silently score other weights."""
    folder = Path(name)
    if not (folder / "config.json").is_file() or folder.resolve() == _named_dir(name).resolve():
        return
    raise ModelNotFoundError(
        f"model {name!r} is both a model name and the checkpoint directory {str(folder.resolve())!r}; "
        f"give {os.path.join(os.curdir, name)!r} (or a pathlib.Path) for the directory, or for the named "
        f"model its checkpoint directory {str(_named_dir(name))!r} (made on first use; `parity models`) "
        "or run from another directory")


def resolve_model(model: str | os.PathLike[str]) -> Path:
    """A model argument -> checkpoint directory: a built-in name (generated on first use), a trained
    model's name (converted from its installed package on first use), or a local HF checkpoint
    directory. Only a `str` is a name (an os.PathLike is always a path); a name that is also a
    checkpoint directory here is refused (`./name` says the directory)."""
    if not isinstance(model, (str, os.PathLike)):
        raise ModelNotFoundError(f"model must be a model name or a checkpoint path, got {model!r}")
    text = os.fspath(model)
    if not text:  # Path("") is the working directory: an unset variable would pick whatever is there
        raise ModelNotFoundError(f"model is empty; use one of {', '.join(model_names())} or the path of a "
                                 "local HF checkpoint directory ('.' for the working directory)")
    if is_model_name(model):
        _refuse_shadowed(text)
        return _named_path(text)
    path = Path(text).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        if not any(any(path.glob(pattern)) for pattern in WEIGHT_FILES):
            raise ModelNotFoundError(
                f"model {text!r} has a config.json but no weights (none of {', '.join(WEIGHT_FILES)}); "
                "point at a complete HF checkpoint directory")
        return path
    why = "is not a directory" if not path.exists() else "has no config.json"
    if text in BUILTIN_MODELS or text in TRAINED_MODELS:  # a path spelled like a name
        raise ModelNotFoundError(f"model {text!r} is a path (a {type(model).__name__}, never a model name) "
                                 f"and {why}; give the string {text!r} for the named model")
    raise ModelNotFoundError(
        f"model {text!r} is not a model name and {why}; use one of "
        f"{', '.join(model_names())} or the path of a local HF checkpoint directory"
    )


def safetensors_shapes(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """tensor name -> (dtype, shape) of a safetensors file, read from its header (no tensor data, no
    torch: bf16 files too); SafetensorError or OSError when it is not one."""
    with safe_open(str(path), framework="numpy") as f:
        return {name: (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape()))
                for name in f.keys()}  # noqa: SIM118  (a safe_open handle is not a dict)


def _hashed(f: Path) -> bool:
    """Whether `f` is config.json or a weight file transformers loads (safetensors, or pytorch_model*.bin
    when a checkpoint has no safetensors)."""
    return f.name == "config.json" or f.suffix == ".safetensors" \
        or (f.suffix == ".bin" and f.name.startswith("pytorch_model"))


def model_hash(path: str | os.PathLike[str]) -> str:
    """sha256 over config.json and the weight files of a checkpoint directory (provenance)."""
    h = hashlib.sha256()
    for f in sorted(Path(path).iterdir()):
        if _hashed(f):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


#: files besides config.json and the weights that decide a loaded model's numbers: where it stops
#: (`eos_token_ids` reads them; a slow tokenizer names its eos id through the last three).
STOP_FILES = frozenset({"generation_config.json", "tokenizer.json", "tokenizer_config.json",
                        "special_tokens_map.json", "tokenizer.model", "added_tokens.json", "vocab.json"})


def files_stamp(path: str | os.PathLike[str], keep: Callable[[Path], bool]
                ) -> tuple[tuple[str, int, int], ...]:
    """(name, size, mtime_ns) of the files of directory `path` that `keep` names, by name: cheap (no
    file is read), and changed by rewriting, adding or removing one (a cache's check of its source)."""
    return tuple((f.name, st.st_size, st.st_mtime_ns) for f in sorted(Path(path).iterdir())
                 if keep(f) and (st := f.stat()))


def checkpoint_stamp(path: str | os.PathLike[str]) -> tuple[tuple[str, int, int], ...]:
    """`files_stamp` of the files `model_hash` reads and the `STOP_FILES`."""
    return files_stamp(path, lambda f: _hashed(f) or f.name in STOP_FILES)


def _json_file(f: Path) -> Any:
    """The parsed JSON of checkpoint file `f`, None when absent; ConfigError when it is not JSON."""
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{f}: not a valid JSON object ({exc}); fix or regenerate the checkpoint") from exc


def eos_token_ids(model_path: str | os.PathLike[str]) -> tuple[int, ...]:
    """EOS ids a sample of the checkpoint stops on, as vLLM stops: generation_config.json's eos_token_id
    (config.json's only where there is no generation_config.json: vLLM's `try_get_generation_config`),
    then the tokenizer's eos token (`tokenizer_eos_id`) when they lack it (vLLM stops on
    `tokenizer.eos_token_id` too wherever it loads the tokenizer, its server always)."""
    root = Path(model_path)
    ids: tuple[int, ...] = ()
    for name in ("generation_config.json", "config.json"):
        data = _json_file(root / name)
        if data is None:
            continue
        if not isinstance(data, dict):
            raise ConfigError(f"{root / name}: not a valid JSON object; fix or regenerate the checkpoint")
        eos = data.get("eos_token_id")
        if eos is not None:
            ids = tuple(eos if isinstance(eos, list) else [eos])
            if not all(type(e) is int for e in ids):  # true would stop on id 1, 2.5 or "2" on id 2
                raise ConfigError(f"{root / name}: eos_token_id must be a token id or a list of token ids "
                                  f"(integers), got {eos!r}; fix the file")
        break  # a generation_config.json without eos_token_id: vLLM reads none from config.json
    tokenizer_eos = tokenizer_eos_id(root)
    return ids if tokenizer_eos is None or tokenizer_eos in ids else (*ids, tokenizer_eos)


def tokenizer_eos_id(model_path: str | os.PathLike[str]) -> int | None:
    """The id of the checkpoint tokenizer's eos token, looked up in tokenizer.json; None without one. The
    token is tokenizer_config.json's `eos_token`, else special_tokens_map.json's, which also wins where
    tokenizer_config.json has no `added_tokens_decoder` (saved before transformers 4.34: transformers
    then merges special_tokens_map.json over it, and vLLM stops on that eos)."""
    root = Path(model_path)
    config, special = _json_file(root / "tokenizer_config.json"), _json_file(root / "special_tokens_map.json")
    config = config if isinstance(config, dict) else {}
    token = config.get("eos_token")
    if isinstance(special, dict) and special.get("eos_token") is not None \
            and (token is None or "added_tokens_decoder" not in config):
        token = special["eos_token"]
    token = token.get("content") if isinstance(token, dict) else token
    if not isinstance(token, str) or not token:
        return None
    return _token_id(root, token)


def _token_id(root: Path, token: str) -> int | None:
    """The id of `token` in the checkpoint's tokenizer.json (added tokens, then the vocabulary), else
    through transformers (a slow tokenizer names its ids only there); None when no tokenizer loads."""
    data = _json_file(root / "tokenizer.json")
    if isinstance(data, dict):
        for added in data.get("added_tokens") or ():
            if isinstance(added, dict) and added.get("content") == token and isinstance(added.get("id"), int):
                return int(added["id"])
        vocab = (data.get("model") or {}).get("vocab")
        if isinstance(vocab, dict) and isinstance(vocab.get(token), int):
            return int(vocab[token])
        if isinstance(vocab, list):  # a Unigram vocabulary: [piece, score] pairs, the id their index
            found = next((i for i, entry in enumerate(vocab) if entry and entry[0] == token), None)
            if found is not None:
                return found
    try:  # transformers only for a checkpoint whose tokenizer.json does not name the token
        from transformers import AutoTokenizer

        eos = AutoTokenizer.from_pretrained(str(root), local_files_only=True).eos_token_id
    except Exception:  # no loadable tokenizer: no engine reads an eos token from it
        return None
    return None if eos is None else int(eos)


def check_loaded(model: str | os.PathLike[str], hf: Any, info: dict[str, Any]) -> None:
    """ConfigError when the weights of `hf` (a transformers model, loaded with `output_loading_info`
    giving `info`) contradict its config: a tensor the model needs is missing (it would run randomly
    initialized), one the files hold is not used, or one has another shape; or config.json ties the
    LM head to the embedding but the files hold a different lm_head.weight (transformers then uses
    it, vLLM the embedding)."""
    for key, what in (("missing_keys", "lacks tensor"), ("unexpected_keys", "holds tensor"),
                      ("mismatched_keys", "has another shape for tensor")):
        names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(key) or ())
        if names:
            more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
            raise ConfigError(f"model {os.fspath(model)!r} {what} {names[0]!r}{more}, which its config.json "
                              "does not fit: the weights belong to another configuration; fix config.json "
                              "(architecture, vocab_size, head counts, biases, tie_word_embeddings) or the "
                              "weight files")
    head, embedding = hf.get_output_embeddings(), hf.get_input_embeddings()
    if getattr(hf.config, "tie_word_embeddings", False) and head is not None and embedding is not None \
            and head.weight is not embedding.weight:
        raise ConfigError(f"model {os.fspath(model)!r}: config.json sets tie_word_embeddings=true but the "
                          "weights hold an lm_head.weight unlike model.embed_tokens.weight; engines differ "
                          "on which they use: set tie_word_embeddings to false, or drop lm_head.weight")


def check_sampled_with(model: str | os.PathLike[str], *, hashes: Iterable[str | None] = (),
                       name: str | None = None, where: str = "the rollouts") -> None:
    """ConfigError when `model` is not the checkpoint the rollouts were sampled with (by recorded
    `hashes`, else by the header's `name` when it resolves here): another model's difference would
    be blamed on the backend. A `name` spelled like a model name is that model (records write a
    directory so spelled as "./name"), whatever directory of that name is here.
    """
    wanted = {h for h in hashes if h}
    if not wanted and name is not None and model_text(name) != model_text(model):
        try:
            wanted = {model_hash(_named_path(name) if is_model_name(name) else resolve_model(name))}
        except ModelNotFoundError:
            return
    if not wanted:
        return
    mine = model_hash(resolve_model(model))
    if mine not in wanted:
        sampled = f"{name!r} " if name is not None else ""
        raise ConfigError(f"model {model_text(model)!r} (hash {mine}) is not the model {where} were sampled "
                          f"with: {sampled}(hash {', '.join(sorted(wanted))}); score them with that model "
                          "(model=, --model), or sample them again with this one")
