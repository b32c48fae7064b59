"""What a checkpoint accepts: its vocabulary size and context length, read from config.json alone.
Out-of-range ids or lengths kill vLLM's engine core or fail deep in torch, so `ModelLimits.check`
refuses them first; no torch needed.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parity.core.errors import ConfigError, InputError
from parity.core.types import Request
from parity.models.checkpoints import resolve_model


def checkpoint_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed config.json of checkpoint directory `path`; ConfigError when it is unreadable."""
    config_path = Path(path) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except OSError as exc:
        raise ConfigError(f"{config_path}: cannot read the checkpoint's config ({exc.strerror})") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{config_path}: not valid JSON ({exc}); fix or regenerate the checkpoint") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"{config_path}: must hold a JSON object, got {type(config).__name__}")
    return config


@dataclass(frozen=True)
class ModelLimits:
    """The ids [0, vocab_size) and positions (max_positions) a checkpoint takes; None when unknown.
    sliding_window: the attention window that bounds max_positions (parity's reference attends to
    every position, which equals windowed attention only up to the window)."""

    model: str
    vocab_size: int | None
    max_positions: int | None
    sliding_window: int | None = None

    def check(self, requests: Sequence[Request], *, names: Sequence[str] | None = None,
              prefix: str = "") -> None:
        """InputError naming the request (`names`, after `prefix`) and the fix when a prompt or stop id is
        outside the vocabulary or prompt plus `max_tokens` overflows the context.
        """
        for i, r in enumerate(requests):
            name = prefix + (names[i] if names is not None else f"request {r.request_id!r}")
            stops = r.sampling.stop_token_ids
            for field, ids in (("prompt_ids", r.prompt_ids), ("sampling.stop_token_ids", stops)):
                problem = self.vocabulary_problem(ids)
                if problem:
                    raise InputError(f"{name}: {field} {problem}")
            need = len(r.prompt_ids) + r.sampling.max_tokens
            if self.max_positions is not None and need > self.max_positions:
                raise InputError(
                    f"{name} needs {len(r.prompt_ids)} prompt + {r.sampling.max_tokens} generated = {need} "
                    f"positions; the model allows {self.max_positions}{self._window_note()}: shorten the "
                    "prompt or lower max_tokens")

    def _window_note(self) -> str:
        if self.sliding_window is None or self.sliding_window != self.max_positions:
            return ""
        return (" (its sliding window: parity's reference attention is full, equal to windowed attention "
                "only within the window)")

    def vocabulary_problem(self, ids: Sequence[int]) -> str | None:
        """What is wrong with `ids` for this vocabulary ("has token id 600, outside ..."), or None."""
        bad = next((t for t in ids if self.vocab_size is not None and t >= self.vocab_size), None)
        if bad is None:
            return None
        return (f"has token id {bad}, outside the vocabulary of {self.vocab_size} tokens of model "
                f"{self.model!r}; ids must be in [0, {self.vocab_size})")


def _positive_int(config: dict[str, Any], key: str, path: Path) -> int | None:
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{path / 'config.json'}: {key} must be a positive integer, got {value!r}")
    return value


def model_limits(model: str | os.PathLike[str]) -> ModelLimits:
    """The vocabulary size and context length of `model` (a multimodal config's `text_config`)."""
    path = resolve_model(model)
    config = checkpoint_config(path)
    text = config.get("text_config")
    if isinstance(text, dict):
        config = {**config, **text}
    check_moe(config, f"model {os.fspath(model)!r}")
    positions, window = _positive_int(config, "max_position_embeddings", path), sliding_window(config)
    if window is not None and (positions is None or window < positions):
        positions = window
    return ModelLimits(model=os.fspath(model), vocab_size=_positive_int(config, "vocab_size", path),
                       max_positions=positions, sliding_window=window)


#: model_type -> (the field that switches its window on, or None: always on; whether layers before
#: `max_window_layers` attend fully), as transformers' configs of the architectures parity runs decide.
_WINDOWED: dict[str, tuple[str | None, bool]] = {
    "mixtral": (None, False), "qwen2": ("use_sliding_window", True), "qwen3": ("use_sliding_window", True),
    "qwen3_moe": ("use_sliding_window", False)}


def sliding_window(config: dict[str, Any]) -> int | None:
    """The attention window some layer of a checkpoint with this config.json (or a transformers
    config's `to_dict()`) applies, or None when every layer attends to all positions."""
    rule, window = _WINDOWED.get(config.get("model_type")), config.get("sliding_window")
    if rule is None or isinstance(window, bool) or not isinstance(window, int) or window < 1:
        return None
    switch, spares_first = rule
    if switch is not None and not config.get(switch, False):
        return None
    types = config.get("layer_types")
    if isinstance(types, list):
        return window if "sliding_attention" in types else None
    if spares_first and config.get("max_window_layers", 28) >= config.get("num_hidden_layers", 0):
        return None
    return window


def check_moe(config: dict[str, Any], where: str) -> None:
    """ConfigError when a MoE config's `num_experts_per_tok` is not in [1, experts]: 0 silently drops
    every MoE layer's output, more than the experts fails deep inside torch."""
    experts = config.get("num_experts") or config.get("num_local_experts")
    top_k = config.get("num_experts_per_tok")
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1 or top_k is None:
        return
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ConfigError(f"{where}: num_experts_per_tok={top_k!r} with {experts} experts; each token must "
                          f"be routed to 1..{experts} experts: fix config.json")


def parameter_count(path: str | os.PathLike[str]) -> int:
    """The number of weights in a checkpoint directory's safetensors files, read from their headers
    alone (no tensor is loaded, no torch): what the gold forward's cost estimate multiplies."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path}: no *.safetensors files; parity reads checkpoints in safetensors format")
    total = 0
    for file in files:
        try:
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{file}: not a readable safetensors file ({exc})") from exc
        total += sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")
    return total
