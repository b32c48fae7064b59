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
    """The ids [0, vocab_size) and positions (max_positions) a checkpoint takes; None when unknown."""

    model: str
    vocab_size: int | None
    max_positions: int | None

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
                    f"positions; the model allows {self.max_positions}: shorten the prompt or lower "
                    "max_tokens")

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
    return ModelLimits(model=os.fspath(model), vocab_size=_positive_int(config, "vocab_size", path),
                       max_positions=_positive_int(config, "max_position_embeddings", path))


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
