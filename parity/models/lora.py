"""LoRA adapters in peft's format: where one lives, what it changes, and whether it fits a model.

A directory with `adapter_config.json` and `adapter_model.safetensors` (`lora_A` `[r, in]`,
`lora_B` `[out, r]` per module), or a built-in adapter's name. One computation order everywhere
(engine, training forward, peft's default `lora.Linear`):

    base = linear(x, W, b)                        [..., out] in the model's dtype
    h    = linear(float32(x), A)                  [..., r]   float32
    d    = linear(h, B)                           [..., out] float32
    y    = dtype(float32(base) + d * scaling)     scaling = lora_alpha / r  (use_rslora: / sqrt(r))

each `linear` through the kernel switch. A merged checkpoint is another model (last-bit
differences, docs/PERF.md). `check_adapter` validates from files alone, before any engine: modules
and shapes in the base, targets parity adapts (no MoE experts or routers), no option beyond plain
LoRA, finite tensors, updates below `MAX_UPDATE`, a matching base model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from parity.core.errors import AdapterError
from parity.core.schema import LORA_MOE_TARGETS, LORA_TARGETS
from parity.models.checkpoints import BUILTIN_MODELS, builtin_dir, resolve_model, safetensors_shapes
from parity.models.limits import checkpoint_config
from parity.models.lora_builtins import (
    builtin_adapter_dir,
    builtin_adapter_names,
    builtin_adapter_path,
    is_builtin_adapter,
)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: peft config keys parity reads or that do not change the forward (initialization, bookkeeping);
#: any other key with a value that is not off (None, False, "none", empty) is refused.
_KNOWN_KEYS = frozenset({
    "r", "lora_alpha", "target_modules", "use_rslora", "lora_dropout", "peft_type", "task_type",
    "base_model_name_or_path", "revision", "inference_mode", "init_lora_weights", "auto_mapping",
    "peft_version", "megatron_core", "qalora_group_size", "loftq_config", "corda_config", "eva_config",
    "lora_ga_config", "ensure_weight_tying",
})
#: `init_lora_weights` values that leave the base weights as they are (peft's other initializations,
#: PiSSA, OLoRA, CorDA, LoftQ and LoRA-GA, subtract their start from the base weights: such an adapter,
#: saved without `path_initial_model_for_weight_conversion`, belongs to that residual model).
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal", "mica")
_PREFIX = "base_model.model."
#: the largest |scaling * B A| entry an adapter may add to a weight: no trained model's weight is near
#: it, and fp16 overflows past 65504.
MAX_UPDATE = 1e4
_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B"}


@dataclass(frozen=True)
class LoraSpec:
    """A validated adapter: path, rank `r`, `lora_alpha`, use_rslora, the adapted module names (sorted),
    their last name parts, peft's `base_model_name_or_path`, a 16-hex-digit sha256 of its files, and
    the checkpoint directory (resolved) it was checked against (`fits` it).
    """

    path: Path
    rank: int
    alpha: float
    use_rslora: bool
    modules: tuple[str, ...]
    targets: tuple[str, ...]
    base_model: str | None
    hash: str
    checkpoint: Path | None = None

    @property
    def scaling(self) -> float:
        """The factor of the adapter's product: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def to_dict(self) -> dict[str, Any]:
        """What reports and rollouts record about the adapter."""
        return {"path": str(self.path), "hash": self.hash, "r": self.rank, "lora_alpha": self.alpha,
                "use_rslora": self.use_rslora, "scaling": self.scaling, "target_modules": list(self.targets),
                "modules": len(self.modules)}


def adapter_text(lora: str | os.PathLike[str]) -> str:
    """`lora` as a string that `resolve_adapter` reads as the same adapter: a path (an os.PathLike)
    spelled like a built-in adapter's name gets a "./" prefix, so it stays a path once it is a string."""
    text = os.fspath(lora)
    if not isinstance(lora, str) and is_builtin_adapter(text):
        return os.path.join(os.curdir, text)
    return text


def shadowing_adapter(name: str, folder: Path) -> Path | None:
    """`folder` (resolved) when it is an adapter directory other than built-in adapter `name`'s, else None:
    a reader who meant one of the two would silently get the other's weights."""
    if not (folder / ADAPTER_CONFIG).is_file() or folder.resolve() == builtin_adapter_dir(name).resolve():
        return None
    return folder.resolve()


def resolve_adapter(lora: str | os.PathLike[str]) -> Path:
    """A built-in adapter name (generated on first use) or an adapter directory -> its path;
    AdapterError naming the missing file otherwise. Only a `str` is a name (an os.PathLike is always a
    path); a name that is also an adapter directory here is refused (`./name` says the directory)."""
    if not isinstance(lora, (str, os.PathLike)):
        raise AdapterError(f"lora must be an adapter directory or a built-in adapter name, got {lora!r}")
    text = os.fspath(lora)
    if not text:  # Path("") is the working directory: an unset variable would pick whatever is there
        raise AdapterError("lora is empty; give a peft adapter directory ('.' for the working directory) or "
                           f"one of {', '.join(builtin_adapter_names())}")
    if isinstance(lora, str) and is_builtin_adapter(text):
        folder = shadowing_adapter(text, Path(text))
        if folder is not None:
            raise AdapterError(
                f"lora {text!r} is both a built-in adapter's name and the adapter directory {str(folder)!r}; "
                f"give {os.path.join(os.curdir, text)!r} (or a pathlib.Path) for the directory, or for the "
                f"built-in adapter its directory {str(builtin_adapter_dir(text))!r} (made on first use) or "
                "run from another directory")
        return builtin_adapter_path(text)
    path = Path(text).expanduser()
    if not path.is_dir():
        named = f" (a path, a {type(lora).__name__}: give the string {text!r} for the built-in adapter)" \
            if is_builtin_adapter(text) else " nor a built-in adapter"
        raise AdapterError(f"lora {text!r} is not a directory{named}; give a peft adapter "
                           f"directory ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS}) or one of "
                           f"{', '.join(builtin_adapter_names())}")
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (path / name).is_file():
            other = " (a .bin adapter: save it with safe_serialization=True)" \
                if name == ADAPTER_WEIGHTS and (path / "adapter_model.bin").is_file() else ""
            raise AdapterError(f"lora {text!r} has no {name}{other}; a peft adapter directory holds "
                               f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    # a relative path spelled like a name, absolute: str(spec.path) is read again (engines, the loop)
    return path.absolute() if is_builtin_adapter(str(path)) else path


def safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """`safetensors_shapes` of `path`, AdapterError when it is not a safetensors file."""
    try:
        return safetensors_shapes(path)
    except (OSError, ValueError, SafetensorError) as exc:
        raise AdapterError(f"{path}: not a readable safetensors file ({exc})") from exc


def checkpoint_linear_shapes(model_path: Path) -> dict[str, tuple[int, ...]]:
    """module name -> weight shape [out, in] of every 2-D weight of a checkpoint's safetensors files."""
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise AdapterError(f"model {str(model_path)!r} has no safetensors weights; parity checks an adapter "
                           "against a safetensors checkpoint")
    shapes = {}
    for f in files:
        for name, (_, shape) in safetensors_header(f).items():
            if name.endswith(".weight") and len(shape) == 2:
                shapes[name.removesuffix(".weight")] = shape
    return shapes


def _config(path: Path) -> dict[str, Any]:
    where = path / ADAPTER_CONFIG
    try:
        config = json.loads(where.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{where}: not a readable JSON file ({exc})") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{where}: must hold a JSON object, got {type(config).__name__}")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {config['peft_type']!r}; parity applies LoRA adapters only")
    for key, value in sorted(config.items()):
        if key not in _KNOWN_KEYS and value not in (None, False, "none", {}, [], ""):
            raise AdapterError(f"{where}: {key}={value!r} is not supported; parity applies plain LoRA "
                               "(x A^T B^T scaled, added to the base layer) and refuses options that change "
                               "it")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{where}: r must be an integer >= 1, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) \
            or alpha <= 0:
        raise AdapterError(f"{where}: lora_alpha must be a number > 0, got {alpha!r}")
    init = config.get("init_lora_weights", True)
    if not any(init is plain or (isinstance(init, str) and init == plain) for plain in _PLAIN_INITS):
        raise AdapterError(f"{where}: init_lora_weights={init!r}: that initialization subtracts the "
                           "adapter's start from the base weights, so the adapter applies to that residual "
                           "model, not to the base parity loads; save it again with peft's "
                           "save_pretrained(..., path_initial_model_for_weight_conversion=...) (a plain LoRA "
                           "adapter of rank 2r), or merge it into its residual model")
    if not isinstance(config.get("use_rslora", False), bool):
        raise AdapterError(f"{where}: use_rslora must be true or false, got {config['use_rslora']!r}")
    return config


def _targeted(config: dict[str, Any], modules: dict[str, tuple[int, ...]], where: Path) -> list[str]:
    """The base modules `target_modules` selects, as peft does: names (or "." suffixes), a regex the
    whole name matches, or "all-linear" (not embeddings or LM head).
    """
    targets = config.get("target_modules")
    if isinstance(targets, str):
        if targets == "all-linear":
            return [m for m in modules if not m.endswith(("embed_tokens", "lm_head"))]
        try:
            pattern = re.compile(targets)
        except re.error as exc:
            raise AdapterError(f"{where}: target_modules {targets!r} is not a valid regular expression "
                               f"({exc}); give a list of module names or a regular expression the whole "
                               "module name must match") from exc
        chosen = [m for m in modules if pattern.fullmatch(m)]
        if not chosen:
            # peft refuses it too: an adapter that adapts nothing runs as the bare model
            raise AdapterError(f"{where}: target_modules {targets!r} selects no module of the model (peft "
                               "refuses such an adapter); the regular expression must match whole module "
                               "names such as 'model.layers.0.self_attn.q_proj'")
        return chosen
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"{where}: target_modules must be a non-empty list of module names or a regular "
                           f"expression, got {targets!r}")
    chosen = []
    for target in targets:
        hits = [m for m in modules if m == target or m.endswith("." + target)]
        if not hits:
            raise AdapterError(f"{where}: target module {target!r} matches no linear layer of the model; the "
                               "adapter was made for another base model (the model's projections: "
                               f"{', '.join(sorted({m.rsplit('.', 1)[-1] for m in modules}))})")
        chosen.extend(hits)
    return sorted(set(chosen))


def _check_supported(module: str, is_moe: bool, where: Path) -> None:
    leaf = module.rsplit(".", 1)[-1]
    allowed = LORA_MOE_TARGETS if is_moe else LORA_TARGETS
    if ".experts." in module or leaf not in allowed:
        scope = "attention projections of a MoE model (expert and router weights are not adapted)" \
            if is_moe else "the attention and MLP projections"
        raise AdapterError(f"{where}: target module {module!r} is not supported: parity applies adapters to "
                           f"{scope}: {', '.join(allowed)}")


def is_moe_checkpoint(model_path: Path) -> bool:
    """Whether the checkpoint at `model_path` is a MoE model (its config.json names experts)."""
    config = checkpoint_config(model_path)
    return bool(config.get("num_experts") or config.get("num_local_experts"))


def check_adapter(lora: str | os.PathLike[str], model: str | os.PathLike[str]) -> LoraSpec:
    """The adapter `lora` (directory or built-in name) validated against `model` (name or
    checkpoint directory), from files alone; AdapterError naming the file, field or module and
    the fix otherwise (see the module docstring for what is checked)."""
    path = resolve_adapter(lora)
    model_path = resolve_model(model)
    config = _config(path)
    where = path / ADAPTER_CONFIG
    base = checkpoint_linear_shapes(model_path)
    is_moe = is_moe_checkpoint(model_path)
    targeted = _targeted(config, base, where)
    for module in targeted:
        _check_supported(module, is_moe, where)
    rank = config["r"]
    found: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, (dtype, shape) in safetensors_header(path / ADAPTER_WEIGHTS).items():
        suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
        if not name.startswith(_PREFIX) or suffix is None:
            raise AdapterError(f"{path / ADAPTER_WEIGHTS}: tensor {name!r} is not a LoRA A or B weight "
                               f"({_PREFIX}<module>.lora_A.weight / .lora_B.weight)")
        if dtype not in ("F32", "BF16", "F16"):
            raise AdapterError(f"{path / ADAPTER_WEIGHTS}: tensor {name!r} has dtype {dtype}; give F32, BF16 "
                               "or F16 weights")
        found.setdefault(name[len(_PREFIX):-len(suffix)], {})[_SUFFIXES[suffix]] = shape
    extra = sorted(set(found) - set(targeted))
    if extra:
        raise AdapterError(f"{path / ADAPTER_WEIGHTS}: weights for {extra[0]!r}, which target_modules does "
                           f"not select in model {os.fspath(model)!r}; the adapter was made for another base "
                           "model")
    for module in targeted:
        pair = found.get(module, {})
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{path / ADAPTER_WEIGHTS}: no lora_{'A' if 'A' not in pair else 'B'} weight "
                               f"for {module!r}, which target_modules selects; the file is incomplete")
        out, inp = base[module]
        if pair["A"] != (rank, inp) or pair["B"] != (out, rank):
            raise AdapterError(
                f"{path / ADAPTER_WEIGHTS}: {module!r} has lora_A {list(pair['A'])} and lora_B "
                f"{list(pair['B'])}; model {os.fspath(model)!r} needs [{rank}, {inp}] and [{out}, {rank}] "
                "(r from the config): the adapter was made for another base model")
    _check_values(path / ADAPTER_WEIGHTS, float(config["lora_alpha"]),
                  _scaling(config["lora_alpha"], rank, config.get("use_rslora", False)), where)
    _check_base_model(config.get("base_model_name_or_path"), model, where)
    digest = hashlib.sha256()
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        digest.update((path / name).read_bytes())
    base_model = config.get("base_model_name_or_path")
    return LoraSpec(path=path, rank=rank, alpha=float(config["lora_alpha"]),
                    use_rslora=bool(config.get("use_rslora", False)), modules=tuple(targeted),
                    targets=tuple(sorted({m.rsplit(".", 1)[-1] for m in targeted})),
                    base_model=base_model if isinstance(base_model, str) else None,
                    hash=digest.hexdigest()[:16], checkpoint=model_path.resolve())


def _scaling(alpha: float, rank: int, use_rslora: bool) -> float:
    return alpha / (math.sqrt(rank) if use_rslora else rank)


def _check_values(weights: Path, alpha: float, scaling: float, where: Path) -> None:
    """AdapterError naming a NaN/inf tensor, or `lora_alpha` when an update scaling * B A could exceed
    `MAX_UPDATE` (bounded first by scaling * r * max|B| * max|A|).
    """
    tensors = read_adapter_tensors(weights)
    for name, values in tensors.items():
        if not np.isfinite(values).all():
            raise AdapterError(f"{weights}: tensor {name!r} holds NaN or inf; the adapter is broken (a "
                               "diverged or corrupted training run): save it again from a healthy step")
    for name, a in tensors.items():
        if not name.endswith(".lora_A.weight"):
            continue
        b = tensors[name.removesuffix(".lora_A.weight") + ".lora_B.weight"]
        bound = scaling * a.shape[0] * float(np.abs(a).max(initial=0.0)) * float(np.abs(b).max(initial=0.0))
        if bound > MAX_UPDATE:
            largest = float(np.abs(scaling * (b.astype(np.float64) @ a.astype(np.float64))).max(initial=0.0))
            if not largest <= MAX_UPDATE:
                module = name[len(_PREFIX):].removesuffix(".lora_A.weight")
                raise AdapterError(f"{where}: lora_alpha={alpha:g} (scaling {scaling:g}) makes {module!r}'s "
                                   f"weight update reach {largest:.3g}, past {MAX_UPDATE:g}: the adapted "
                                   "layer overflows or is meaningless; check lora_alpha (peft's default is "
                                   "8, usually r or 2r)")


def read_adapter_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of an adapter's safetensors file as float32 (F32, F16 and BF16, the dtypes
    `check_adapter` allows; BF16 widened by its bits, no torch)."""
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        data = f.read()
    kinds = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, stop = info["data_offsets"]
        raw = np.frombuffer(data[start:stop], dtype=kinds[info["dtype"]]).reshape(info["shape"])
        out[name] = (raw.astype(np.uint32) << 16).view(np.float32) if info["dtype"] == "BF16" \
            else raw.astype(np.float32)
    return out


def _check_base_model(base_model: object, model: str | os.PathLike[str], where: Path) -> None:
    """AdapterError when `base_model_name_or_path` names another built-in model (shapes may match), by
    name or by its checkpoint directory (what peft records for a model loaded from its path)."""
    if isinstance(base_model, str) and base_model not in BUILTIN_MODELS:
        base_model = _builtin_at(base_model)
    if not isinstance(base_model, str) or base_model not in BUILTIN_MODELS:
        return
    if isinstance(model, str) and model in BUILTIN_MODELS:
        same = model == base_model
    else:
        same = Path(model).expanduser().resolve() == builtin_dir(base_model).resolve()
    if not same:
        raise AdapterError(f"{where}: base_model_name_or_path {base_model!r} names another built-in model "
                           f"than {os.fspath(model)!r}; apply the adapter to {base_model!r}, or correct "
                           "base_model_name_or_path if it was trained on this model")


def _builtin_at(path: str) -> str | None:
    """The built-in model whose checkpoint directory `path` is, else None."""
    try:
        where = Path(path).expanduser().resolve()
    except (OSError, RuntimeError, ValueError):
        return None
    return next((name for name in BUILTIN_MODELS if builtin_dir(name).resolve() == where), None)


def fits(spec: LoraSpec, model_path: Path) -> LoraSpec:
    """`spec` for the checkpoint at `model_path`: itself when it was checked against that checkpoint,
    else checked again against it (AdapterError when it does not fit, or when its files changed since).
    A LoraSpec checked against one model is no proof it fits another."""
    here = model_path.resolve()
    if spec.checkpoint == here:
        return spec
    again = check_adapter(spec.path, model_path)
    if (again.rank, again.modules, again.use_rslora) != (spec.rank, spec.modules, spec.use_rslora) \
            or not spec.hash.startswith(again.hash):
        raise AdapterError(f"adapter {str(spec.path)!r} changed since it was checked (hash {spec.hash}, now "
                           f"{again.hash}); check it again with check_adapter(path, model)")
    return dataclasses.replace(spec, checkpoint=here)


def rescaled(spec: LoraSpec, factor: float) -> LoraSpec:
    """`spec`'s weights at `factor` times its scaling (lora_alpha scaled), under its own hash: what
    an engine that mis-reads lora_alpha computes (a hypothesis of the adapter-sync check)."""
    return dataclasses.replace(spec, alpha=spec.alpha * factor, hash=f"{spec.hash}x{factor:g}")


def check_without_tensor_parallel(tensor_parallel_size: int | None, option: str) -> None:
    """AdapterError when a LoRA adapter meets tensor parallelism (`option` names the setting to drop):
    parity's tensor-parallel shards (`parity.parallel`) do not carry adapters."""
    if tensor_parallel_size is not None:
        raise AdapterError(f"a LoRA adapter runs without tensor parallelism in parity; drop {option}")


def merge_adapter(model: str | os.PathLike[str], lora: str | os.PathLike[str],
                  out: str | os.PathLike[str]) -> Path:
    """Write `out`, `model` with W + scaling * B A per adapted module (float64, rounded once), other
    files copied; equal to the adapter's forward up to rounding.
    """
    spec = check_adapter(lora, model)
    model_path = resolve_model(model)
    deltas = adapter_deltas(spec)
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    for f in sorted(model_path.iterdir()):
        if f.suffix != ".safetensors":
            if f.is_file():
                (target / f.name).write_bytes(f.read_bytes())
            continue
        try:
            weights = load_file(str(f))
        except (TypeError, ValueError) as exc:
            raise AdapterError(f"{f}: cannot merge into this checkpoint's dtype ({exc}); merge into a "
                               "float32 or float16 checkpoint") from exc
        for key, delta in deltas.items():
            if key in weights:
                w = weights[key]
                weights[key] = (w.astype(np.float64) + delta).astype(w.dtype)
        save_file(weights, str(target / f.name), metadata={"format": "pt"})
    return target


def adapter_deltas(spec: LoraSpec) -> dict[str, np.ndarray]:
    """Each adapted module's weight update, scaling * B @ A in float64 `[out, in]`, keyed by the base
    weight's name ("<module>.weight"): what merging the adapter adds (`merge_adapter`, the gold
    forward's adapted weights)."""
    adapter = read_adapter_tensors(spec.path / ADAPTER_WEIGHTS)  # BF16 too (exactly widened)
    deltas = {}
    for module in spec.modules:
        a = adapter[f"{_PREFIX}{module}.lora_A.weight"].astype(np.float64)
        b = adapter[f"{_PREFIX}{module}.lora_B.weight"].astype(np.float64)
        deltas[module + ".weight"] = spec.scaling * (b @ a)
    return deltas
