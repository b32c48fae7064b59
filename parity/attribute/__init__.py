"""Drift attribution: which kernel family and which layer make two settings' logprobs differ.

    from parity.attribute import Setting, attribute_ops, axis_settings, layer_diff
    a, b = axis_settings("batch", dtype="float32")       # batch size 1 vs one padded batch
    ops = attribute_ops("tiny-llama", sequences, a, b)   # ops.ranking: families, worst first
    probe = layer_diff("tiny-llama", sequences, a.with_kernels("native"), b.with_kernels("native"))
    probe.first_differing                                # e.g. "layer.0"
    diff = engine_diff("tiny-llama", requests)           # inside vLLM, against the training forward
    diff.phase("decode").first_differing                 # e.g. "layer.0.attn"

`parity attribute --model M --case C` runs both from the command line (`main`); the section is drawn by
`parity.render.attribution`. The names load their module on first use: most of them need torch, and
`parity attribute --help` imports this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from parity.attribute.ablation import Drift, FamilyAttribution, OpAttribution, attribute_ops
    from parity.attribute.axes import AXES
    from parity.attribute.command import main
    from parity.attribute.layers import LayerDiff, StageDiff, layer_diff
    from parity.attribute.probe import EngineDiff, EngineProbe, EngineSide, engine_diff, probe_engine
    from parity.attribute.section import attribution_section
    from parity.attribute.settings import MODES, Setting, axis_settings
    from parity.attribute.stages import STAGE_KINDS

#: exported name -> the module of this package that defines it.
_HOMES = {
    "AXES": "axes", "MODES": "settings", "Setting": "settings", "axis_settings": "settings",
    "Drift": "ablation", "FamilyAttribution": "ablation", "OpAttribution": "ablation",
    "attribute_ops": "ablation",
    "LayerDiff": "layers", "StageDiff": "layers", "layer_diff": "layers",
    "attribution_section": "section", "main": "command",
    "EngineDiff": "probe", "EngineProbe": "probe", "EngineSide": "probe", "engine_diff": "probe",
    "probe_engine": "probe", "STAGE_KINDS": "stages",
}

__all__ = [
    "AXES", "MODES", "STAGE_KINDS", "Drift", "EngineDiff", "EngineProbe", "EngineSide", "FamilyAttribution",
    "LayerDiff", "OpAttribution", "Setting", "StageDiff", "attribute_ops", "attribution_section",
    "axis_settings", "engine_diff", "layer_diff", "main", "probe_engine",
]


def __getattr__(name: str) -> Any:
    """`parity.attribute.NAME`: imported from its module when first asked for (PEP 562)."""
    if name not in _HOMES:
        raise AttributeError(f"module 'parity.attribute' has no attribute {name!r}")
    return getattr(importlib.import_module(f"parity.attribute.{_HOMES[name]}"), name)
