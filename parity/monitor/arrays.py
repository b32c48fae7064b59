"""Arrays from a trainer's batch as NumPy, whatever holds them (torch on any device, bfloat16
widened exactly to float32; NumPy; lists). Duck-typed: torch is never imported. NumPy only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from parity.core.errors import InputError


def host_array(value: Any, name: str) -> np.ndarray:
    """`value` as a NumPy array on the host (a view where the data already is one)."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        tensor = value.detach().cpu()
        if str(getattr(tensor, "dtype", "")) == "torch.bfloat16":  # NumPy has no bfloat16
            tensor = tensor.float()
        return tensor.numpy()
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise InputError(f"{name} must be a tensor or array, got {type(value).__name__}") from exc
    if array.dtype == object:
        raise InputError(f"{name} must be a rectangular array of numbers (right-padded), got ragged or "
                         f"non-numeric {type(value).__name__}")
    return array


def negative_id(ids: np.ndarray, valid: np.ndarray | None = None) -> tuple[int, ...] | None:
    """The index of the first negative id of integer `ids` where `valid` (same shape) is nonzero, or of
    the first anywhere without `valid`; None when there is none. A negative id (a wrapped int8/int16
    id, a -100 label) names no token, yet would be shown as one."""
    if ids.size == 0 or ids.dtype.kind != "i":
        return None
    bad = ids < 0
    if valid is not None:
        bad &= valid.astype(bool)
    if not bad.any():
        return None
    return tuple(int(i) for i in np.argwhere(bad)[0])
