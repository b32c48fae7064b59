"""How two runs of the same samples differ: tokens, logprobs on the common prefix, MoE routes.

Logprobs are compared only where tokens agree (a diverged sample differs however small its
logprob differences); routes (top-k sets) over positions whose inputs agree, and hashed, so a
stored result names what routed differently. NumPy only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parity.audit.result import CheckResult
from parity.core.errors import BackendError
from parity.core.types import Rollout
from parity.drift.routes import same_choice


@dataclass(frozen=True)
class Pair:
    """One sample from two runs; `context` says what set the runs apart (e.g. {"batch_size": 8})."""

    a: Rollout
    b: Rollout
    context: dict[str, Any] = field(default_factory=dict)


def route_hash(routes: np.ndarray) -> str:
    """16 hex digits of sha256 over a route array's top-k sets (each row's ids sorted) as int32."""
    canonical = np.ascontiguousarray(np.sort(np.asarray(routes, dtype=np.int32), axis=-1))
    return hashlib.sha256(str(canonical.shape).encode() + canonical.tobytes()).hexdigest()[:16]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading tokens two responses share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


def _abs_diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| elementwise, 0 where the two are the same number (-inf and -inf, NaN and NaN), inf
    where one side only is NaN (a difference without a size: as NaN it summed the mean to NaN, which
    a check cannot hold, and Python's max dropped it from the peak)."""
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    with np.errstate(invalid="ignore"):
        return np.where(same, 0.0, np.where(np.isnan(a) | np.isnan(b), np.inf, np.abs(a - b)))


def _route_difference(pair: Pair, prefix: int) -> dict[str, Any] | None:
    """Where the two runs' routes first differ over positions whose inputs agree, or None."""
    ra, rb = pair.a.routed_experts, pair.b.routed_experts
    if ra is None and rb is None:
        return None
    if ra is None or rb is None:
        return {"route_hashes": [None if r is None else route_hash(r) for r in (ra, rb)],
                "route_position": None, "route_layer": None, "note": "routes returned by one run only"}
    rows = min(len(pair.a.prompt_ids) + prefix, ra.shape[0], rb.shape[0])
    same = same_choice(ra[:rows], rb[:rows])
    if same.all():
        return None
    position, layer = (int(i) for i in np.argwhere(~same)[0])
    return {"route_hashes": [route_hash(ra), route_hash(rb)], "route_position": position,
            "route_layer": layer}


def _first_difference(pair: Pair, prefix: int, diffs: np.ndarray,
                      routes: dict[str, Any] | None) -> dict[str, Any] | None:
    a, b = pair.a, pair.b
    head = {"request_id": a.request_id, "sample_index": a.sample_index}
    logprob_at = int(np.flatnonzero(diffs)[0]) if diffs.any() else None
    diverged = a.token_ids != b.token_ids
    if logprob_at is not None and (not diverged or logprob_at < prefix):
        position, what = logprob_at, "logprobs"
    elif diverged:
        position, what = prefix, "tokens"
    elif routes is not None:
        return {**head, "what": "routes", "position": None, **routes, "context": pair.context}
    else:
        return None
    detail = {**head, "what": what, "position": position}
    for side, ro in (("a", a), ("b", b)):
        inside = position < len(ro.token_ids)
        detail[f"{side}_token"] = ro.token_ids[position] if inside else None
        detail[f"{side}_logprob"] = ro.logprobs[position] if inside else None
    if routes is not None:
        detail.update(routes)
    detail["context"] = pair.context
    return detail


def compare_pairs(pairs: Sequence[Pair]) -> CheckResult:
    """A check's numbers from its pairs (in a stable order: the first difference is the first pair's)."""
    if not pairs:
        raise BackendError("a check compared no samples; the runs returned nothing to compare")
    if not any(p.a.token_ids or p.b.token_ids or p.a.routed_experts is not None
               or p.b.routed_experts is not None for p in pairs):
        # two empty runs agree vacuously: "identical" would read as a check passed on no evidence
        return CheckResult.skip(f"every sample ({len(pairs)}) has no response token in either run and no "
                                "routes: nothing was compared")
    requests: dict[str, bool] = {}
    first: dict[str, Any] | None = None
    total, count, peak = 0.0, 0, 0.0
    for pair in pairs:
        if pair.a.key != pair.b.key:
            raise BackendError(f"sample {pair.a.key} was paired with {pair.b.key}; runs must return the "
                               "samples they were asked for")
        prefix = common_prefix(pair.a.token_ids, pair.b.token_ids)
        diffs = _abs_diff(np.asarray(pair.a.logprobs[:prefix], np.float64),
                          np.asarray(pair.b.logprobs[:prefix], np.float64))
        routes = _route_difference(pair, prefix)
        differs = pair.a.token_ids != pair.b.token_ids or bool(diffs.any()) or routes is not None
        requests[pair.a.request_id] = requests.get(pair.a.request_id, False) or differs
        if diffs.size:
            total += float(diffs.sum())
            count += diffs.size
            peak = max(peak, float(diffs.max()))
        if differs and first is None:
            first = _first_difference(pair, prefix, diffs, routes)
    differing = sum(requests.values())
    return CheckResult(identical=differing == 0, requests=len(requests), differing_requests=differing,
                       first_difference=first, max_abs_logprob_diff=peak,
                       mean_abs_logprob_diff=total / count if count else 0.0)


def pair_runs(a: Sequence[Rollout], b: Sequence[Rollout], context: dict[str, Any] | None = None,
              keys: Sequence[tuple[str, int]] | None = None) -> list[Pair]:
    """Pairs of the samples `keys` (default: every sample of `a`, in its order) found in both runs."""
    by_key_b = {r.key: r for r in b}
    by_key_a = {r.key: r for r in a}
    wanted = list(keys) if keys is not None else [r.key for r in a]
    missing = [k for k in wanted if k not in by_key_a or k not in by_key_b]
    if missing:
        raise BackendError(f"sample {missing[0]} is missing from a run; the backend dropped a sample it was "
                           "asked for")
    return [Pair(by_key_a[k], by_key_b[k], dict(context or {})) for k in wanted]
