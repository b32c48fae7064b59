"""Needles among neighbours: requests spread evenly through a batch of other prompts.

Batch invariance is judged on such batches: the audit's batch check (`parity.audit.derived`) and
the engine probe's fillers (`parity.attribute.probe`) build them here, so both put the same kind of
neighbours around the requests they watch (steps that mix one request's decode with another's prefill).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from parity.core.types import Request


def token_pool(requests: Sequence[Request]) -> np.ndarray:
    """The distinct token ids of the requests' prompts."""
    return np.unique(np.concatenate([np.asarray(r.prompt_ids, np.int64) for r in requests]))


def spread(needles: Sequence[Request], size: int, rng: np.random.Generator, *, context: int | None = None
           ) -> list[Request | tuple[int, ...]]:
    """`size` positions (>= len(needles)): the needles in order at evenly spread positions, at every
    other one a prompt (token ids) drawn from the needles' tokens at a length none of them has: up to
    twice the longest plus 8, leaving room for the longest generation within `context` (None: unknown).
    """
    pool = token_pool(needles)
    taken = {len(r.prompt_ids) for r in needles}
    longest = max(taken)
    budget = min(2 * longest + 8, context - max(r.sampling.max_tokens for r in needles)) if context else \
        2 * longest + 8
    lengths = [n for n in range(1, budget + 1) if n not in taken] or [longest]
    # evenly spaced slots at least one apart (len(needles) <= size), so rounding keeps them distinct
    slots = np.unique(np.linspace(0, size - 1, len(needles)).round().astype(int))
    needle_at = dict(zip(slots.tolist(), needles))
    return [needle_at[position] if position in needle_at
            else tuple(int(t) for t in rng.choice(pool, size=int(rng.choice(lengths))))
            for position in range(size)]
