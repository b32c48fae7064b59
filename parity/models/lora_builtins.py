"""Built-in LoRA adapters for the built-in checkpoints: generated deterministically, cached on disk.

`<model>-lora-r8` and `<model>-lora-r64` (rsLoRA) per tiny checkpoint, standard peft directories;
dense models on every projection, MoE on attention only. Weights are PCG64 doubles rounded once
to float32; unlike peft's B = 0, both A and B are non-zero, scaled so the update is about
`DELTA_SCALE` times the input's std: logprobs move clearly while staying peaked.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from parity.core.schema import LORA_MOE_TARGETS, LORA_TARGETS
from parity.models.checkpoints import BUILTIN_MODELS, builtin_path, cache_dir, safetensors_shapes

#: bump when the generator changes, so stale caches are never reused.
ADAPTER_VERSION = 1
#: the adapter's output standard deviation relative to its input's (per layer).
DELTA_SCALE = 0.15


@dataclass(frozen=True)
class TinyAdapter:
    """A built-in adapter: its base checkpoint, rank, alpha, scaling rule, targets and seed."""

    name: str
    model: str
    rank: int
    alpha: int
    use_rslora: bool
    targets: tuple[str, ...]
    seed: int

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def _specs() -> dict[str, TinyAdapter]:
    out = {}
    for i, (model, spec) in enumerate(sorted(BUILTIN_MODELS.items())):
        targets = LORA_MOE_TARGETS if spec.is_moe else LORA_TARGETS
        for rank, alpha, rslora in ((8, 16, False), (64, 16, True)):
            name = f"{model}-lora-r{rank}"
            out[name] = TinyAdapter(name, model, rank, alpha, rslora, targets, seed=1000 + 10 * i + rank)
    return out


BUILTIN_ADAPTERS: dict[str, TinyAdapter] = _specs()


def builtin_adapter_names() -> list[str]:
    return sorted(BUILTIN_ADAPTERS)


def is_builtin_adapter(name: str) -> bool:
    return name in BUILTIN_ADAPTERS


def _draw(rng: np.random.Generator, shape: tuple[int, ...], bound: float) -> np.ndarray:
    """Uniform in [-bound, bound): PCG64 doubles -> float64 -> one rounding to float32."""
    return ((rng.random(size=shape, dtype=np.float64) * 2.0 - 1.0) * bound).astype(np.float32)


def adapter_weights(model_path: Path, rank: int, scaling: float, targets: tuple[str, ...],
                    seed: int) -> dict[str, np.ndarray]:
    """A [r, in] and B [out, r] float32 per targeted non-expert projection, in sorted order under peft's
    names; A Kaiming-uniform, B's bound from var = scaling^2 * r * bound^2 / 3.
    """
    rng = np.random.Generator(np.random.PCG64(seed))
    b_bound = DELTA_SCALE * math.sqrt(3.0 / rank) / scaling
    out = {}
    shapes = {name: shape for f in sorted(model_path.glob("*.safetensors"))
              for name, (_, shape) in safetensors_shapes(f).items()}
    for key, shape in sorted(shapes.items()):
        module = key.removesuffix(".weight")
        if not key.endswith(".weight") or module.rsplit(".", 1)[-1] not in targets or ".experts." in key:
            continue
        n_out, n_in = shape
        prefix = f"base_model.model.{module}"
        out[f"{prefix}.lora_A.weight"] = _draw(rng, (rank, n_in), math.sqrt(3.0 / n_in))
        out[f"{prefix}.lora_B.weight"] = _draw(rng, (n_out, rank), b_bound)
    return out


def adapter_config(base_model: str, rank: int, alpha: int | float, use_rslora: bool,
                   targets: tuple[str, ...]) -> dict[str, object]:
    """peft's LoraConfig fields of a plain LoRA adapter (what `LoraConfig.save_pretrained` writes)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": alpha, "use_rslora": use_rslora,
        "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "use_dora": False, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
        "init_lora_weights": True, "inference_mode": True,
    }


def write_adapter(path: str | os.PathLike[str], config: dict[str, object],
                  weights: dict[str, np.ndarray], *, replace: bool = True) -> Path:
    """A peft adapter directory at `path` (adapter_config.json, adapter_model.safetensors), written
    whole before it takes the name. replace: an adapter already there is replaced (an RL step's new
    adapter in the same directory), else kept (two processes generating one built-in adapter)."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(weights, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    if replace and path.exists():
        shutil.rmtree(path)
    try:
        os.replace(tmp, path)
    except OSError:
        if not (path / "adapter_model.safetensors").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    return path


def builtin_adapter_dir(name: str) -> Path:
    """Where built-in adapter `name` lives (generated there on first use; nothing is made here)."""
    return cache_dir() / f"{name}-v{ADAPTER_VERSION}"


def builtin_adapter_path(name: str, *, regenerate: bool = False) -> Path:
    """Directory of built-in adapter `name`, generated on first use (its base checkpoint too)."""
    spec = BUILTIN_ADAPTERS[name]
    path = builtin_adapter_dir(name)
    if regenerate or not (path / "adapter_model.safetensors").exists():
        weights = adapter_weights(builtin_path(spec.model), spec.rank, spec.scaling, spec.targets, spec.seed)
        write_adapter(path, adapter_config(spec.model, spec.rank, spec.alpha, spec.use_rslora, spec.targets),
                      weights, replace=regenerate)
    return path
