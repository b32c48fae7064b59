"""The audit's requests, all derived from one case's seeded requests (NumPy only).

`shuffled` (another order), `reseeded` (the control), `needle_batches` (n=1 needles alone, then
spread over larger batches among neighbours of other lengths and seeds with the same sampling,
since some kernels treat a row by its position), `with_prefix` (a shared prefix of whole KV
blocks) and `neutral` (temperature 1, no truncation: processed equals raw). Extra tokens come
from the case's prompts, so every id is valid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from parity.core.errors import ConfigError
from parity.core.types import Request
from parity.workload.neighbours import spread, token_pool

#: the default batch sizes of the batch check, in sequences: the needle alone, then two batches.
BATCH_SIZES: tuple[int, ...] = (1, 8, 64)
#: seeds of neighbours and of the control start here: far from any case's seeds (cases use 0-10^4).
_OTHER_SEEDS = 1_000_003


@dataclass(frozen=True)
class BatchPlan:
    """The batch check's runs: `needles` one at a time, then each of `batches` (size -> requests)."""

    needles: tuple[Request, ...]
    batches: dict[int, tuple[Request, ...]]


def check_batch_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    """Distinct sizes >= 1, sorted; they must hold 1 (the needle alone) and two larger sizes."""
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes):
        raise ConfigError(f"batch_sizes must be a list of integers >= 1, got {sizes!r}")
    out = tuple(sorted(set(sizes)))
    if out[:1] != (1,) or len(out) < 3:
        raise ConfigError(f"batch_sizes must hold 1 (the needle alone) and at least two larger sizes, e.g. "
                          f"{list(BATCH_SIZES)}; got {list(sizes)}")
    return out


def single_turn(requests: Sequence[Request], where: str) -> tuple[Request, ...]:
    """`requests` if none is a multi-turn trajectory (the audit samples single responses)."""
    turns = [r.request_id for r in requests if r.turns]
    if turns:
        raise ConfigError(f"{where}: requests {turns[:3]} are multi-turn trajectories; the audit samples "
                          "single-turn requests: use a case without [[turns]]")
    if not requests:
        raise ConfigError(f"{where}: no requests to audit")
    return tuple(requests)


def shuffled(requests: Sequence[Request], seed: int) -> tuple[Request, ...]:
    """`requests` in a seeded order other than the given one (unchanged when there is one request)."""
    if len(requests) < 2:
        return tuple(requests)
    rng = np.random.Generator(np.random.PCG64(seed))
    order = np.arange(len(requests))
    while np.array_equal(order, np.arange(len(requests))):
        order = rng.permutation(len(requests))
    return tuple(requests[i] for i in order)


def reseeded(requests: Sequence[Request]) -> tuple[Request, ...]:
    """The same requests with seeds nobody else uses (request seed + a large odd offset)."""
    return tuple(Request(r.prompt_ids, r.sampling.replace(seed=r.sampling.seed + _OTHER_SEEDS), r.request_id)
                 for r in requests)


def neutral(requests: Sequence[Request]) -> tuple[Request, ...]:
    """The same prompts and seeds under temperature 1 without truncation."""
    return tuple(Request(r.prompt_ids, r.sampling.replace(temperature=1.0, top_k=0, top_p=1.0), r.request_id)
                 for r in requests)


def is_neutral(requests: Sequence[Request]) -> bool:
    """Whether every request samples at temperature 1 without top-k or top-p (processed == raw)."""
    return all(r.sampling.temperature == 1.0 and r.sampling.top_k == 0 and r.sampling.top_p == 1.0
               for r in requests)


def needle_batches(requests: Sequence[Request], sizes: Sequence[int], *, seed: int,
                   context: int | None) -> BatchPlan:
    """Needles and the batches they are audited in; at most half the smallest batch above 1 are
    needles. `context`: the model's positions (None: unknown).
    """
    sizes = check_batch_sizes(sizes)
    count = max(1, min(len(requests), sizes[1] // 2))
    needles = tuple(Request(r.prompt_ids, r.sampling.replace(n=1), r.request_id) for r in requests[:count])
    rng = np.random.Generator(np.random.PCG64(seed))
    batches = {}
    for size in sizes[1:]:
        batch: list[Request] = []
        for position, item in enumerate(spread(needles, size, rng, context=context)):
            if isinstance(item, Request):
                batch.append(item)
                continue
            sampling = needles[position % count].sampling.replace(seed=_OTHER_SEEDS + size * 1000 + position)
            batch.append(Request(item, sampling, f"neighbour-{size}-{position}"))
        batches[size] = tuple(batch)
    return BatchPlan(needles=needles, batches=batches)


def with_prefix(requests: Sequence[Request], length: int, *, seed: int) -> tuple[Request, ...]:
    """`requests` behind one shared prefix of `length` tokens (same seeds and sampling)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    prefix = tuple(int(t) for t in rng.choice(token_pool(requests), size=length))
    return tuple(Request(prefix + r.prompt_ids, r.sampling, r.request_id) for r in requests)
