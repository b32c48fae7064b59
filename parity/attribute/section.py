"""The attribution section of a report (`extras["attribution"]`): op ablation and layer probe along
the chosen axes, as JSON; `parity.render.attribution` draws it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from parity.attribute.ablation import attribute_ops
from parity.attribute.layers import layer_diff
from parity.attribute.settings import AXES, axis_settings
from parity.backends.borrowed import resolve_device
from parity.core.errors import ConfigError
from parity.core.schema import REFERENCE
from parity.core.types import Sequences, as_pairs
from parity.models.loading import LoadedModel

#: axes whose two sides are one and the same forward when there is a single sequence (a batch of one
#: right-padded without padding is that sequence packed into one row).
ONE_SEQUENCE_SAME: tuple[str, ...] = ("batch", "layout")


def attribution_section(model: str | LoadedModel, sequences: Sequences, *, axes: Iterable[str] = ("batch",),
                        dtype: str = "float32", device: str = "auto", families: Iterable[str] | None = None,
                        probe_kernels: Iterable[str] | str = "native", ops: bool = True,
                        layers: bool = True) -> dict[str, Any]:
    """Attribute drift along each axis of `axes` (`AXES`) on `sequences`: {"axes": [{"axis",
    "description", "ops"?, "layers"?}]}. probe_kernels defaults to "native": with invariant kernels
    every axis but dtype is bitwise equal by construction, leaving no drift to locate.
    """
    chosen = list(axes)
    unknown = [axis for axis in chosen if axis not in AXES]
    if not chosen or unknown:
        raise ConfigError(f"axes must name at least one of {list(AXES)}, got {chosen!r}")
    if not (ops or layers):
        raise ConfigError("nothing to do: ops and layers are both off")
    count = len(as_pairs(sequences))
    alone = [axis for axis in chosen if axis in ONE_SEQUENCE_SAME]
    if count == 1 and alone:
        raise ConfigError(f"axes {alone}: with 1 sequence both sides of {' and '.join(alone)} run the same "
                          "[1, len] forward, so it would show no drift by construction; give at least 2 "
                          "sequences (--max-sequences) or drop the axis")
    device = resolve_device(device, [REFERENCE])
    entries = []
    for axis in chosen:
        entry: dict[str, Any] = {"axis": axis, "description": AXES[axis]}
        if ops:
            a, b = axis_settings(axis, dtype=dtype, device=device)
            entry["ops"] = attribute_ops(model, sequences, a, b, families=families).to_dict()
        if layers:
            a, b = axis_settings(axis, dtype=dtype, device=device, kernels=probe_kernels)
            entry["layers"] = layer_diff(model, sequences, a, b).to_dict()
        entries.append(entry)
    return {"axes": entries}
