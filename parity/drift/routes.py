"""MoE route arrays: validation, dtype normalization and router agreement (NumPy only).

Routes are int32 `[positions, moe_layers, top_k]` (vLLM, SGLang, verl R3 layout) over
`len(prompt) + len(response) - 1` positions (the last token is never fed back); agreement
compares top-k sets. `as_routes` normalizes backends' dtypes (vLLM uint8/16, SGLang int32).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from parity.core.errors import InputError


def as_routes(routes: Any, where: str = "routes") -> np.ndarray:
    """Any integer array-like -> int32 `[positions, layers, k]`; InputError otherwise."""
    if hasattr(routes, "detach"):  # a torch tensor on any device, taken to host without importing torch
        routes = routes.detach().cpu().numpy()
    try:
        array = np.asarray(routes)
    except ValueError as exc:  # NumPy's "inhomogeneous shape": rows of different top_k or layers
        raise InputError(f"{where} is not a rectangular [positions, moe_layers, top_k] array of expert "
                         f"ids: every position needs the same layers and top_k ({exc})") from exc
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
    """`routes` as int32 `[positions, moe_layers, top_k]` for one sequence, or InputError naming the
    dimension that does not fit (length, MoE layers, top_k, expert id) or the first position whose
    row repeats an expert.
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
    _check_distinct(np.sort(array, axis=-1), array, where)
    return array


def _check_distinct(ordered: np.ndarray, array: np.ndarray, where: str) -> None:
    """InputError naming the first (position, layer) of `array` whose row names an expert twice
    (`ordered`: `array` sorted along top_k). A router's top-k is k distinct experts (vLLM and SGLang
    record torch.topk's ids): replaying [e, e] would hand expert e the whole gate weight of the row,
    and comparing it would count a corrupt row as agreement."""
    repeated = (ordered[..., 1:] == ordered[..., :-1]).any(axis=-1)
    if repeated.any():
        position, layer = (int(i) for i in np.argwhere(repeated)[0])
        raise InputError(f"{where}: position {position}, MoE layer {layer} names expert(s) more than once "
                         f"({array[position, layer].tolist()}); a row of routes is the top_k distinct "
                         "experts the router chose (record the routes again, or pass the engine's own)")


def same_choice(a: np.ndarray, b: np.ndarray, names: tuple[str, str] | None = None) -> np.ndarray:
    """bool `[positions, moe_layers]`: whether a, b `[positions, moe_layers, top_k]` hold the same experts
    (sorted rows: as sets, for a router's rows of distinct experts). InputError for different shapes;
    with `names` (what each side is called), also for a row that names an expert twice, whose "set"
    is no router's choice (`router_agreement`); without, rows are only compared (an audit's runs)."""
    if a.shape != b.shape:
        raise InputError(f"route arrays of shapes {a.shape} and {b.shape} cannot be compared; "
                         "both must be [positions, moe_layers, top_k] of the same sequence and model")
    ordered = (np.sort(a, axis=-1), np.sort(b, axis=-1))
    for name, side, sorted_side in zip(names or (), (a, b), ordered):
        _check_distinct(sorted_side, side, name)
    return (ordered[0] == ordered[1]).all(axis=-1)


def router_agreement(reference: Sequence[Any], other: Sequence[Any]) -> dict[str, Any]:
    """`ROUTER_SUMMARY_KEYS` of two sides' routes (one `[positions, moe_layers, top_k]` per sequence):
    fraction of (position, layer) top-k sets identical, overall and per layer; fraction of positions
    with any layer different; positions compared.
    """
    if len(reference) != len(other):
        raise InputError(f"{len(reference)} reference route arrays but {len(other)} to compare; "
                         "give one per sequence on both sides")
    if not reference:
        raise InputError("router_agreement needs at least one sequence of routes")
    pairs = [(as_routes(a, f"reference[{i}]"), as_routes(b, f"other[{i}]"))
             for i, (a, b) in enumerate(zip(reference, other))]
    for i, (a, _) in enumerate(pairs):
        # no layer or an empty top-k set compares nothing: all() of nothing would read as agreement 1.0
        if a.shape[1] == 0 or a.shape[2] == 0:
            raise InputError(f"reference[{i}] has shape {a.shape}: routes need at least one MoE layer "
                             "(dimension 1) and one expert per token (top_k, dimension 2) to compare")
        if a.shape[1:] != pairs[0][0].shape[1:]:  # one model: every sequence has its layers and top_k
            raise InputError(f"reference[{i}] has shape {a.shape} but reference[0] {pairs[0][0].shape}: "
                             "every sequence's routes must share [moe_layers, top_k] (dimensions 1, 2)")
    same = np.concatenate([same_choice(a, b, (f"reference[{i}]", f"other[{i}]"))
                           for i, (a, b) in enumerate(pairs)])
    if same.shape[0] == 0:
        raise InputError("router_agreement got route arrays with no positions")
    return {
        "router_agreement": float(same.mean()),
        "router_token_any_diff": float((~same).any(axis=1).mean()),
        "router_agreement_per_layer": [float(x) for x in same.mean(axis=0)],
        "num_router_positions": int(same.shape[0]),
    }
