"""MoE route arrays: validation, dtype normalization and router agreement (NumPy only).

A route array holds the experts one forward chose, int32 `[positions, moe_layers, top_k]`
(the layout of vLLM, SGLang and verl's R3). A rollout's array covers the positions whose output
was computed, `len(prompt) + len(response) - 1`: the last sampled token is never fed back.
The order of the k ids within a row is not meaningful; agreement compares top-k *sets*.
Backends hand routes over in their own dtypes (vLLM: uint8/uint16, SGLang: base64 int32,
decoded in `parity.backends.sglang`); `as_routes` normalizes any of them to int32. The report's
router section, which scores rollouts with the training forward, is `parity.compare.router_report`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from parity.core.errors import InputError


def as_routes(routes: Any, where: str = "routes") -> np.ndarray:
    """Any integer array-like (NumPy, torch, nested lists; any int width) -> int32 `[positions, layers, k]`.

    Raises InputError for a non-integer dtype, a rank other than 3, or ids outside int32.
    """
    if hasattr(routes, "detach"):  # a torch tensor on any device, taken to host without importing torch
        routes = routes.detach().cpu().numpy()
    array = np.asarray(routes)
    if array.size == 0 and array.dtype == np.float64:  # an empty list has no integer dtype to keep
        array = array.astype(np.int32)
    if not np.issubdtype(array.dtype, np.integer):
        raise InputError(f"{where} must hold integer expert ids, got dtype {array.dtype}")
    if array.ndim != 3:
        raise InputError(f"{where} must be [positions, moe_layers, top_k] (3 dimensions), "
                         f"got shape {array.shape}")
    if array.size and (array.min() < 0 or array.max() > np.iinfo(np.int32).max):
        raise InputError(f"{where} holds expert ids outside [0, 2**31): min {array.min()}, max {array.max()}")
    return array.astype(np.int32, copy=False)


def check_routes(routes: Any, *, positions: int, moe_layers: int, top_k: int, num_experts: int,
                 where: str = "routes") -> np.ndarray:
    """`routes` as int32 `[positions, moe_layers, top_k]` for one sequence of a model, or InputError.

    The error names the dimension that does not fit: the sequence length (positions =
    len(prompt) + len(response) - 1), the model's MoE layer count, its top_k, or an expert id
    outside [0, num_experts). A model without MoE layers (moe_layers == 0) has no routes.
    """
    if moe_layers == 0:
        raise InputError(f"{where}: the model is dense (no MoE layers), so it has no routes to check "
                         f"or replay; routes belong to an MoE model")
    array = as_routes(routes, where)
    for axis, (name, want, meaning) in enumerate((
            ("positions", positions, "len(prompt) + len(response) - 1"),
            ("moe_layers", moe_layers, "the model's MoE layer count"),
            ("top_k", top_k, "the model's experts per token"))):
        if array.shape[axis] != want:
            raise InputError(f"{where}: dimension {axis} ({name}) is {array.shape[axis]}, expected {want} "
                             f"({meaning}); shape {array.shape}")
    if array.size and array.max() >= num_experts:
        raise InputError(f"{where}: expert id {int(array.max())} is out of range; the model has "
                         f"{num_experts} experts")
    return array


def same_choice(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """bool `[positions, moe_layers]`: whether a, b `[positions, moe_layers, top_k]` agree as sets."""
    if a.shape != b.shape:
        raise InputError(f"route arrays of shapes {a.shape} and {b.shape} cannot be compared; "
                         "both must be [positions, moe_layers, top_k] of the same sequence and model")
    return (np.sort(a, axis=-1) == np.sort(b, axis=-1)).all(axis=-1)


def router_agreement(reference: Sequence[Any], other: Sequence[Any]) -> dict[str, Any]:
    """Router agreement between two sides' routes of the same sequences.

    reference, other: one `[positions, moe_layers, top_k]` array per sequence (same shapes pairwise).
    Returns the `parity.core.schema.ROUTER_SUMMARY_KEYS`:
        router_agreement: fraction of (position, layer) pairs whose top-k sets are identical.
        router_token_any_diff: fraction of positions where at least one layer's set differs.
        router_agreement_per_layer: `router_agreement` of each MoE layer, a list.
        num_router_positions: positions compared.
    """
    if len(reference) != len(other):
        raise InputError(f"{len(reference)} reference route arrays but {len(other)} to compare; "
                         "give one per sequence on both sides")
    if not reference:
        raise InputError("router_agreement needs at least one sequence of routes")
    same = np.concatenate([same_choice(as_routes(a, f"reference[{i}]"), as_routes(b, f"other[{i}]"))
                           for i, (a, b) in enumerate(zip(reference, other))])
    if same.shape[0] == 0:
        raise InputError("router_agreement got route arrays with no positions")
    return {
        "router_agreement": float(same.mean()),
        "router_token_any_diff": float((~same).any(axis=1).mean()),
        "router_agreement_per_layer": [float(x) for x in same.mean(axis=0)],
        "num_router_positions": int(same.shape[0]),
    }
