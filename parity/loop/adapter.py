"""Adapter-only updates (`lora_rank`): the loop trains a LoRA adapter and pushes only the adapter,
as verl with vLLM's runtime LoRA.

Rank R on every projection (MoE: attention only), lora_alpha = R; initialised as peft does (A
Kaiming-uniform from PCG64, B zero: step 0 is the base model). The training forward applies it
as the engine does, so rollouts stay bitwise with `grad=True`. Each step the adapter is written
as a peft directory and loaded (`Backend.load_adapter`), verified by the base weights' digests
(unchanged) and the content hash of the adapter the backend reports (`meta["lora"]`); logprobs
could not tell, since a step's adapter is within rounding noise of the last.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from parity.backends import Backend
from parity.core.errors import AdapterError, DivergedError
from parity.core.schema import LORA_MOE_TARGETS, LORA_TARGETS
from parity.core.types import Rollout
from parity.models.loading import LoadedModel
from parity.models.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    check_adapter,
    checkpoint_linear_shapes,
    is_moe_checkpoint,
)
from parity.models.lora_builtins import adapter_config, write_adapter

_PREFIX = "base_model.model."


def adapter_targets(model_path: Path) -> tuple[str, ...]:
    """The projections the loop adapts: attention and MLP on a dense model, attention on a MoE one."""
    return LORA_MOE_TARGETS if is_moe_checkpoint(model_path) else LORA_TARGETS


def initial_adapter(model_path: Path, base_model: str, rank: int, seed: int, path: Path) -> Path:
    """Write the step-0 adapter of rank `rank` for the checkpoint at `model_path` to `path` (peft's
    initialisation, see the module docstring); returns `path`."""
    targets = adapter_targets(model_path)
    rng = np.random.Generator(np.random.PCG64(seed))
    weights = {}
    for module, (n_out, n_in) in sorted(checkpoint_linear_shapes(model_path).items()):
        if module.rsplit(".", 1)[-1] not in targets or ".experts." in module:
            continue
        bound = 1.0 / math.sqrt(n_in)
        weights[f"{_PREFIX}{module}.lora_A.weight"] = \
            ((rng.random(size=(rank, n_in), dtype=np.float64) * 2.0 - 1.0) * bound).astype(np.float32)
        weights[f"{_PREFIX}{module}.lora_B.weight"] = np.zeros((n_out, rank), dtype=np.float32)
    return write_adapter(path, adapter_config(base_model, rank, rank, False, targets), weights)


def adapter_bytes(path: Path) -> int:
    """Bytes of an adapter directory's two files: what one push moves."""
    return sum((path / name).stat().st_size for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS))


def unpinned(rollouts: Sequence[Rollout]) -> list[Rollout]:
    """`rollouts` without their recorded adapter, so the trainer may score them at its current one
    (the training forward would refuse another adapter; staleness is the sync check's to report).
    """
    return [dataclasses.replace(r, meta={k: v for k, v in r.meta.items() if k != "lora"})
            if "lora" in r.meta else r for r in rollouts]


def _base_layer_name(name: str, shown: dict[str, str | None]) -> str:
    """`name`, or the `.base_layer.` name an adapter-serving engine shows for it (see below)."""
    module, _, leaf = name.rpartition(".")
    wrapped = f"{module}.base_layer.{leaf}"
    return wrapped if name not in shown and wrapped in shown else name


class AdapterWeights:
    """The LoRA adapter of the training model, trained and pushed (one `step-<k>` directory under
    `directory` at a time); the base frozen. `lm` is replaced whenever the adapter is written.
    """

    def __init__(self, lm: LoadedModel, directory: Path) -> None:
        self.lm, self.directory = lm, directory
        self._base = [(name, p) for name, p in lm.model.named_parameters()]
        for _, p in self._base:
            p.requires_grad_(False)
        self._lora = [lm.model.get_submodule(name).parity_lora for name in lm.lora.modules]
        self._names = lm.lora.modules
        for weights in self._lora:
            weights.a.requires_grad_(True)
            weights.b.requires_grad_(True)
        self._config = json.loads((lm.lora.path / ADAPTER_CONFIG).read_text())  # every step's, unchanged
        self._expected: dict[int, dict[str, str]] = {}
        self._written = 0

    def parameters(self) -> list[torch.Tensor]:
        """The adapter's A and B tensors (float32), module by module."""
        return [t for weights in self._lora for t in (weights.a, weights.b)]

    def gradients_to_masters(self) -> None:
        """Nothing to do: the adapter is float32 whatever the model's dtype (no master copies)."""

    def masters_to_model(self) -> None:
        """After the optimizer step: write the adapter as a new peft directory (the previous one is
        removed) and make it the training model's recorded adapter."""
        previous = self.lm.lora.path
        self._written += 1
        tensors = {}
        for name, weights in zip(self._names, self._lora):
            tensors[f"{_PREFIX}{name}.lora_A.weight"] = weights.a.detach().cpu().numpy().copy()
            tensors[f"{_PREFIX}{name}.lora_B.weight"] = weights.b.detach().cpu().numpy().copy()
        path = write_adapter(self.directory / f"step-{self._written}", self._config, tensors)
        try:
            spec = check_adapter(path, self.lm.path)
        except AdapterError as exc:  # the loop wrote it from trained values: only the values can be wrong
            raise DivergedError(f"the optimizer step left an adapter that cannot be applied ({exc})") from exc
        self.lm = dataclasses.replace(self.lm, lora=spec)
        if previous.parent == self.directory:
            shutil.rmtree(previous, ignore_errors=True)

    def zero_grad(self) -> None:
        for t in self.parameters():
            t.grad = None

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The base weights (frozen): what every backend must keep holding."""
        return [(name, p.detach()) for name, p in self._base]

    def push(self, backend: Backend) -> None:
        """Send the current adapter to `backend` (`Backend.load_adapter`); the base is not sent."""
        backend.load_adapter(self.lm.lora.path)

    def expected_checksums(self, backend: Backend) -> dict[str, str]:
        """The base weights' checksums in `backend`'s layout, once per backend; a name it does not show is
        looked up as `<module>.base_layer.<leaf>` (vLLM's LoRA layers wrap the base).
        """
        key = id(backend)
        if key not in self._expected:
            expected = backend.expected_checksums(self.named_tensors())
            shown = backend.weight_checksums()
            self._expected[key] = {_base_layer_name(name, shown): digest for name, digest in expected.items()}
        return self._expected[key]

    def stale_adapter(self, backend: Backend) -> str | None:
        """None when `backend` reports applying the current adapter, else what it applies instead."""
        applied = (backend.meta.get("lora") or {}).get("hash")
        want = self.lm.lora.hash
        return None if applied == want else f"adapter (applies {applied}, pushed {want})"

    def describe(self) -> dict[str, Any]:
        """What the last write holds, for the record: the adapter's hash and bytes."""
        return {"adapter_hash": self.lm.lora.hash, "adapter_bytes": adapter_bytes(self.lm.lora.path)}
