"""Layer probe: where in the model two settings' numbers first part.

Both settings run the same tokens with every stage captured; the first stage where any element
differs is where the drift enters (everything after inherits it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from parity.attribute.runner import run
from parity.attribute.settings import Setting
from parity.core.errors import ConfigError, InputError
from parity.core.types import Sequences
from parity.models.loading import LoadedModel


@dataclass(frozen=True)
class StageDiff:
    """How one stage's outputs differ, over every element: max |b - a| (model units), rel_error
    ||b - a||_2 / ||a||_2 (inf when a is 0 and b is not), differing of elements (+0 == -0, NaN differs).
    An element equal on both sides (an infinity included) adds nothing to |b - a|, and ||a||_2 is over
    a's finite elements, so an overflow both sides share does not turn the stage's numbers into NaN."""

    stage: str
    max_abs: float
    rel_error: float
    differing: int
    elements: int

    @classmethod
    def between(cls, stage: str, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> StageDiff:
        """Compare per-sequence outputs `a`, `b` after an exact upcast to float64 (dtypes may differ);
        InputError unless they hold as many tensors of equal shapes (else elements would pair up wrong)."""
        shapes = [tuple(t.shape) for t in a], [tuple(t.shape) for t in b]
        if shapes[0] != shapes[1]:
            raise InputError(f"stage {stage!r}: side A's per-sequence shapes {shapes[0]} differ from side "
                             f"B's {shapes[1]}; compare outputs of the same sequences, row by row")
        xa = torch.cat([t.reshape(-1) for t in a]).to(torch.float64)
        xb = torch.cat([t.reshape(-1) for t in b]).to(torch.float64)
        equal = xa == xb
        delta = torch.where(equal, torch.zeros_like(xa), xb - xa)  # inf - inf is NaN, not 0
        error = float(torch.linalg.vector_norm(delta))
        norm = float(torch.linalg.vector_norm(torch.where(torch.isfinite(xa), xa, torch.zeros_like(xa))))
        differing = int((~equal).sum())
        if differing == 0:
            rel = 0.0
        else:
            rel = error / norm if norm > 0 else math.inf
        return cls(stage=stage, max_abs=float(delta.abs().max()) if delta.numel() else 0.0, rel_error=rel,
                   differing=differing, elements=xa.numel())

    def to_dict(self) -> dict[str, object]:
        return {"stage": self.stage, "max_abs": self.max_abs, "rel_error": self.rel_error,
                "differing": self.differing, "elements": self.elements}


@dataclass(frozen=True)
class LayerDiff:
    """The result of `layer_diff`: one `StageDiff` per stage in forward order."""

    setting_a: Setting
    setting_b: Setting
    stages: tuple[StageDiff, ...]

    @property
    def first_differing(self) -> str | None:
        return next((s.stage for s in self.stages if s.differing), None)

    def to_dict(self) -> dict[str, object]:
        """JSON form (what reports store and `parity.render.attribution` draws from)."""
        return {"setting_a": self.setting_a.to_dict(), "setting_b": self.setting_b.to_dict(),
                "stages": [s.to_dict() for s in self.stages], "first_differing": self.first_differing}


def layer_diff(model: str | LoadedModel, tokens: Sequences, setting_a: Setting,
               setting_b: Setting) -> LayerDiff:
    """Per-stage differences of `setting_b` from `setting_a` on the same tokens ("embed", "layer.<i>",
    "norm", "logits" of the response tokens)."""
    if not isinstance(setting_a, Setting) or not isinstance(setting_b, Setting):
        raise ConfigError("setting_a and setting_b must be parity.attribute.Setting instances")
    a = run(model, tokens, setting_a, capture=True).states
    b = run(model, tokens, setting_b, capture=True).states
    return LayerDiff(setting_a=setting_a, setting_b=setting_b,
                     stages=tuple(StageDiff.between(name, a[name], b[name]) for name in a))
