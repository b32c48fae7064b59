"""The audit's checks on one running backend: each samples seeded requests in two situations and
compares the bits (`parity.audit.diff`).

repeat: twice. batch: needles alone, then among other-length neighbours. order: shuffled.
prefill_decode: sampled logprobs against `Backend.score` (raw against raw: processed rollouts
are resampled at temperature 1 untruncated). prefix_cache: behind a shared prefix, cold then
warm. seed: other seeds must give other samples. All but prefix_cache bypass the cache
(`generate_uncached`), so each check varies one thing; runs are shared where they can be.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from parity.audit.derived import is_neutral, needle_batches, neutral, reseeded, shuffled, with_prefix
from parity.audit.diff import Pair, compare_pairs, pair_runs
from parity.audit.result import CHECKS, CheckResult
from parity.backends import Backend
from parity.backends.base import check_samples
from parity.core.errors import UnsupportedError
from parity.core.types import Request, Rollout

#: a shared prefix of this many KV blocks gives the prefix cache whole blocks to serve.
PREFIX_BLOCKS = 2
#: the prefix length when the backend does not say its KV block size.
DEFAULT_PREFIX_TOKENS = 256


@dataclass(frozen=True)
class AuditSettings:
    """What the checks run: which checks, the batch sizes, the seed of the derived requests and the
    model's context length (None when unknown)."""

    checks: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    seed: int
    context: int | None


class Runs:
    """Samples requests on the backend without reading its prefix cache where it can; keeps the
    notes a reader of the result needs (a cache it could not bypass, what a check sampled)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.notes: dict[str, Any] = {}
        self._base: list[Rollout] | None = None
        self.bypass = not backend.has_prefix_cache or backend.bypasses_prefix_cache
        if not self.bypass:
            self.notes["prefix_cache_reads"] = (
                f"backend {backend.name!r} cannot keep a request from reading its prefix cache, so repeat, "
                "batch and order may be served from the cache their earlier runs filled")

    def sample(self, requests: Sequence[Request]) -> list[Rollout]:
        """Every sample of `requests`, checked (one per request and sample index), cache bypassed."""
        generate = self.backend.generate_uncached if self.bypass else self.backend.generate
        return self._checked(requests, generate(list(requests)))

    def cached(self, requests: Sequence[Request]) -> list[Rollout]:
        """Every sample of `requests`, reading the prefix cache."""
        return self._checked(requests, self.backend.generate(list(requests)))

    def _checked(self, requests: Sequence[Request], rollouts: list[Rollout]) -> list[Rollout]:
        check_samples(requests, rollouts, self.backend.name)
        routed = sum(r.routed_experts is not None for r in rollouts)
        if routed:  # says that routes were compared, not only that none differed
            self.notes["samples_with_routes"] = self.notes.get("samples_with_routes", 0) + routed
        return rollouts

    def base(self, requests: Sequence[Request]) -> list[Rollout]:
        """The first run of the case's requests, shared by repeat, order, seed and prefill_decode."""
        if self._base is None:
            self._base = self.sample(requests)
        return self._base


def run_checks(backend: Backend, requests: Sequence[Request],
               settings: AuditSettings) -> tuple[dict[str, CheckResult], dict[str, Any]]:
    """Every check in `CHECKS` order (one not in `settings.checks` is skipped, saying so), and the
    notes on how they ran (for provenance)."""
    runs = Runs(backend)
    checks: dict[str, Callable[[], CheckResult]] = {
        "repeat": lambda: compare_pairs(pair_runs(runs.base(requests), runs.sample(requests))),
        "batch": lambda: _batch(runs, requests, settings),
        "order": lambda: _order(runs, requests, settings.seed),
        "prefill_decode": lambda: _prefill_decode(runs, requests),
        "prefix_cache": lambda: _prefix_cache(runs, requests, settings),
        "seed": lambda: _seed(runs, requests),
    }
    results, seconds = {}, {}
    for name in CHECKS:
        if name not in settings.checks:
            results[name] = CheckResult.skip("not asked for (checks=...)")
            continue
        t0 = time.perf_counter()
        try:
            results[name] = checks[name]()
        except UnsupportedError as e:
            results[name] = CheckResult.skip(str(e))
        seconds[name] = round(time.perf_counter() - t0, 3)
    # wall seconds per check (the first check to sample the case's requests pays for the shared run)
    return results, {**runs.notes, "seconds": seconds}


def _order(runs: Runs, requests: Sequence[Request], seed: int) -> CheckResult:
    if len(requests) < 2:
        return CheckResult.skip("one request: there is no other order")
    return compare_pairs(pair_runs(runs.base(requests), runs.sample(shuffled(requests, seed)),
                                   {"order": "shuffled"}))


def _seed(runs: Runs, requests: Sequence[Request]) -> CheckResult:
    # top_k=1 keeps the argmax alone at any temperature: its samples are as fixed as greedy ones, and
    # the control "failed" on them as if the backend ignored seeds
    if all(r.sampling.temperature == 0 or r.sampling.top_k == 1 for r in requests):
        return CheckResult.skip("every request is greedy (temperature 0 or top_k 1): seeds cannot change "
                                "its samples")
    return compare_pairs(pair_runs(runs.base(requests), runs.sample(reseeded(requests)),
                                   {"seeds": "request seed + 1000003"}))


def _batch(runs: Runs, requests: Sequence[Request], settings: AuditSettings) -> CheckResult:
    plan = needle_batches(requests, settings.batch_sizes, seed=settings.seed, context=settings.context)
    alone = {r.key: r for needle in plan.needles for r in runs.sample([needle])}
    pairs = []
    for size, batch in plan.batches.items():
        inside = {r.key: r for r in runs.sample(batch)}
        positions = {r.request_id: i for i, r in enumerate(batch)}
        pairs += [Pair(alone[key], inside[key], {"batch_size": size, "position_in_batch": positions[key[0]]})
                  for key in alone]
    runs.notes["batch"] = {"needles": [n.request_id for n in plan.needles],
                           "batch_sizes": list(settings.batch_sizes)}
    return compare_pairs(pairs)


def _prefill_decode(runs: Runs, requests: Sequence[Request]) -> CheckResult:
    raw = all(r.sampling.logprobs_mode == "raw" for r in requests)
    if raw or is_neutral(requests):
        sampled = runs.base(requests)
    else:
        sampled = runs.sample(neutral(requests))
        runs.notes["prefill_decode"] = ("sampled again at temperature 1 without top-k/top-p: prompt "
                                        "logprobs are raw, and processed logprobs equal raw ones only there")
    try:
        scores = runs.backend.score(sampled, logprobs_mode="raw")
    except UnsupportedError as e:
        return CheckResult.skip(f"the backend cannot score sequences: {e}")
    # one score row per sequence, each of its length: `Backend.score` checks it (`checked_scores`)
    scored = [dataclasses.replace(r, logprobs=tuple(float(x) for x in s.tolist()))
              for r, s in zip(sampled, scores)]
    return compare_pairs([Pair(a, b, {"a": "decode (sampled)", "b": "prefill (score)"})
                          for a, b in zip(sampled, scored)])


def _prefix_cache(runs: Runs, requests: Sequence[Request], settings: AuditSettings) -> CheckResult:
    backend = runs.backend
    if not backend.has_prefix_cache:
        return CheckResult.skip(f"backend {backend.name!r} runs without a prefix cache here "
                                "(enable_prefix_caching is off): nothing to turn on or off")
    if not runs.bypass:
        return CheckResult.skip(f"backend {backend.name!r} cannot run a request without reading its prefix "
                                "cache, so there is no cache-off run to compare with")
    block = backend.meta.get("block_size")
    length = PREFIX_BLOCKS * block if block else DEFAULT_PREFIX_TOKENS
    if settings.context is not None:
        room = settings.context - max(len(r.prompt_ids) + r.sampling.max_tokens for r in requests)
        length = min(length, room - room % block if block else room)
    if length < (block or 1):
        return CheckResult.skip(f"the model's context ({settings.context} positions) leaves no room for a "
                                f"shared prefix of one KV block ({block} tokens)")
    prefixed = with_prefix(requests, length, seed=settings.seed)
    off = runs.sample(prefixed)
    runs.cached(prefixed)  # fills the cache where the bypassing run did not write it (a server's salt)
    on = runs.cached(prefixed)
    served = [r.meta.get("num_cached_tokens") for r in on]
    if any(s is None for s in served):
        return CheckResult.skip(f"backend {backend.name!r} does not report how many prompt tokens its cache "
                                "served, so a run cannot be shown to have used it")
    if sum(served) == 0:
        return CheckResult.skip(f"the prefix cache served no prompt tokens (a shared prefix of {length} "
                                "tokens)")
    # only a sample prefilled whole when off and served from the cache when warm compares the two: a
    # backend that bypasses by flushing (SGLang) still lets a call's later requests read the prefix its
    # first ones computed, and a sample the warm run did not serve compares no cache with no cache
    all_pairs = pair_runs(off, on)
    read_off = sum(bool(p.a.meta.get("num_cached_tokens")) for p in all_pairs)
    unserved = sum(not p.b.meta["num_cached_tokens"] for p in all_pairs)
    pairs = [p for p in all_pairs if not p.a.meta.get("num_cached_tokens") and p.b.meta["num_cached_tokens"]]
    left_out = {"read_the_cache_when_off": read_off, "not_served_when_warm": unserved}
    if not pairs:
        return CheckResult.skip(f"no sample was prefilled whole with the cache off and served from it warm "
                                f"(of {len(all_pairs)}: {read_off} read the cache when off, {unserved} were "
                                "not served when warm)")
    runs.notes["prefix_cache"] = {"shared_prefix_tokens": length, "cached_tokens": int(sum(served)),
                                  "samples_compared": len(pairs),
                                  **({"samples_left_out": left_out} if len(pairs) < len(all_pairs) else {})}
    return compare_pairs([dataclasses.replace(p, context={"cached_tokens": p.b.meta["num_cached_tokens"]})
                          for p in pairs])
