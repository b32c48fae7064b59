"""The loop's settings, checked on construction before any model loads (no torch here)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from parity.core.errors import ConfigError
from parity.core.schema import BACKEND_NAMES, DTYPES
from parity.core.types import check_int, check_real
from parity.correction.config import CorrectionConfig, correction_from_name


def _positive_real(value: Any, name: str) -> float:
    value = check_real(value, name, "> 0")
    if value <= 0:
        raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class LoopConfig:
    """One loop run.

    backends: sampled every step on the same prompts and weights; train_on: whose rollouts the
    update uses. lr (0: a control), weight_decay: AdamW's; grad_clip: None is off. correction: a
    `correction_from_name` name ("token_tis", "icepop:0.5_2", ...). seed: every step's sampling seeds
    derive from it. n, max_tokens, temperature: per prompt (top-p and top-k off, so logprobs are
    finite). prompts: the built-in task's count. dtype, device: trainer's and reference engine's.
    micro_batch_size: per differentiable forward. backend_dtypes, backend_options: per backend.
    lora_rank: None trains and pushes every weight; R only a LoRA adapter.
    """

    model: str
    backends: tuple[str, ...] = ("reference",)
    train_on: str = "reference"
    steps: int = 20
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0
    correction: str = "none"
    seed: int = 0
    n: int = 4
    max_tokens: int = 16
    temperature: float = 1.0
    prompts: int = 8
    dtype: str = "float32"
    device: str = "cpu"
    micro_batch_size: int | None = None
    backend_dtypes: Mapping[str, str] = field(default_factory=dict)
    backend_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    lora_rank: int | None = None
    #: the parsed `correction`.
    correction_config: CorrectionConfig = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"model must be a built-in name or a checkpoint path, got {self.model!r}")
        if not isinstance(self.backends, (list, tuple)) or not self.backends:
            raise ConfigError(f"backends must be a non-empty list of backend names, got {self.backends!r}")
        object.__setattr__(self, "backends", tuple(self.backends))
        for name in self.backends:
            if name not in BACKEND_NAMES:
                raise ConfigError(f"unknown backend {name!r}; choose from {', '.join(BACKEND_NAMES)}")
        if len(set(self.backends)) != len(self.backends):
            raise ConfigError(f"backends lists a backend twice: {list(self.backends)}")
        if self.train_on not in self.backends:
            raise ConfigError(f"train_on={self.train_on!r} is not one of the backends {list(self.backends)}; "
                              "the update uses one of the sampled backends' rollouts")
        # NumPy numbers as Python ones: the record's JSON would write them as strings ("3")
        object.__setattr__(self, "steps", check_int(self.steps, "steps", low=1))
        lr = check_real(self.lr, "lr", ">= 0")
        if lr < 0:
            raise ConfigError(f"lr must be >= 0 (0: a control run whose weights never move), got {lr!r}")
        object.__setattr__(self, "lr", float(lr))
        wd = check_real(self.weight_decay, "weight_decay", ">= 0")
        if wd < 0:
            raise ConfigError(f"weight_decay must be >= 0, got {wd!r}")
        object.__setattr__(self, "weight_decay", float(wd))
        if self.grad_clip is not None:
            object.__setattr__(self, "grad_clip", _positive_real(self.grad_clip, "grad_clip"))
        object.__setattr__(self, "correction_config", correction_from_name(self.correction))
        for name in ("seed", "n", "max_tokens", "prompts"):
            low = 0 if name == "seed" else 1
            object.__setattr__(self, name, check_int(getattr(self, name), name, low=low))
        temperature = _positive_real(self.temperature, "temperature")
        if not math.isfinite(temperature):
            raise ConfigError(f"temperature must be finite, got {temperature!r}")
        object.__setattr__(self, "temperature", temperature)
        if self.micro_batch_size is not None:
            object.__setattr__(self, "micro_batch_size",
                               check_int(self.micro_batch_size, "micro_batch_size", low=1))
        for what, table, values in (("backend_dtypes", self.backend_dtypes, "dtypes"),
                                    ("backend_options", self.backend_options, "tables of options")):
            if not isinstance(table, Mapping) or (what == "backend_options" and not all(
                    isinstance(v, Mapping) for v in table.values())):
                raise ConfigError(f"{what} must map backend names to {values}, got {table!r}")
            extra = sorted(set(dict(table)) - set(self.backends))
            if extra:
                raise ConfigError(f"{what} names {extra}, which are not among the backends "
                                  f"{list(self.backends)}")
        for name, dtype in (("dtype", self.dtype), *((f"backend_dtypes[{k!r}]", v)
                                                      for k, v in self.backend_dtypes.items())):
            if not isinstance(dtype, str) or dtype not in DTYPES:
                raise ConfigError(f"{name} must be one of {list(DTYPES)}, got {dtype!r}")
        if self.lora_rank is not None:
            object.__setattr__(self, "lora_rank", check_int(
                self.lora_rank, "lora_rank", low=1,
                hint="(the adapter's rank, e.g. 8; leave it unset to train every weight)"))
            for name, options in self.backend_options.items():
                if "lora" in options:
                    raise ConfigError(f"backend_options[{name!r}] sets lora, but with lora_rank the loop "
                                      "trains its own adapter and starts every backend with it; drop the "
                                      "lora option")
        if not isinstance(self.device, str):
            raise ConfigError(f"device must be a string such as 'cpu' or 'cuda', got {self.device!r}")

    def dtype_of(self, backend: str) -> str:
        """The dtype `backend` runs in."""
        return dict(self.backend_dtypes).get(backend, self.dtype)

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON values (what the record stores)."""
        return {"model": self.model, "backends": list(self.backends), "train_on": self.train_on,
                "steps": self.steps, "lr": self.lr, "weight_decay": self.weight_decay,
                "grad_clip": self.grad_clip,
                "correction": self.correction, "seed": self.seed, "n": self.n, "max_tokens": self.max_tokens,
                "temperature": self.temperature, "prompts": self.prompts, "dtype": self.dtype,
                "device": self.device, "micro_batch_size": self.micro_batch_size,
                "backend_dtypes": dict(self.backend_dtypes),
                "backend_options": {k: dict(v) for k, v in dict(self.backend_options).items()},
                "lora_rank": self.lora_rank}
