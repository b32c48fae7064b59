"""Drift attribution: which kernel family and which layer make two settings' logprobs differ.

    from parity.attribute import Setting, attribute_ops, axis_settings, layer_diff
    a, b = axis_settings("batch", dtype="float32")       # batch size 1 vs one padded batch
    ops = attribute_ops("tiny-llama", sequences, a, b)   # ops.ranking: families, worst first
    probe = layer_diff("tiny-llama", sequences, a.with_kernels("native"), b.with_kernels("native"))
    probe.first_differing                                # e.g. "layer.0"

`parity attribute --model M --case C` runs both from the command line (`main`); the section is drawn by
`parity.render.attribution`.
"""

from parity.attribute.ablation import Drift, FamilyAttribution, OpAttribution, attribute_ops
from parity.attribute.command import main
from parity.attribute.layers import LayerDiff, StageDiff, layer_diff
from parity.attribute.section import attribution_section
from parity.attribute.settings import AXES, MODES, Setting, axis_settings

__all__ = [
    "AXES", "MODES", "Drift", "FamilyAttribution", "LayerDiff", "OpAttribution", "Setting", "StageDiff",
    "attribute_ops", "attribution_section", "axis_settings", "layer_diff", "main",
]
