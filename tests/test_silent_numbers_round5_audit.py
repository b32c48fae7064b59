"""Round 5, the audit, lifecycle and attribution: numbers and verdicts that were silently wrong.

- The audit's prefix_cache check compared every sample of the cache-off run with the warm run, even
  samples the cache-off run itself had read from the cache (SGLang bypasses by flushing, so a call's
  later requests read the prefix its first ones computed; a backend whose bypass does not work reads
  it everywhere): the cache was compared with itself and counted "identical". Now only samples
  prefilled whole when off and served when warm are compared; none left is a skip.
- Lifecycle checks compared every transition with the first run, so a change one transition left
  behind failed every later check too (a clean `kv_cache_release` failed for `sleep_wake`'s drift).
  Now each is judged against the run just before it.
- Lifecycle's max |Δlogp| took NaN from -inf - -inf (a token outside the support on both sides) or a
  NaN on one side, and Python's max() kept the number that came first: a 0.5-nat difference passed
  as "identical tokens and logprobs".
- The layer probe's max |Δ| and relative error were NaN for a stage whose elements overflowed to inf
  alike on both sides (inf - inf), a stage with no differing element included.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch

import parity
from parity.attribute.layers import StageDiff
from parity.audit.lifecycle import run_lifecycle, same_rollouts
from parity.backends.base import Backend, expand_samples
from parity.core.types import Rollout
from parity.workload.cases import default_case

CASE = default_case("tiny-llama", num_prompts=4, max_tokens=4)


class SharedPrefixFake(Backend):
    """A deterministic backend with a prefix cache whose warm reads move logprobs by 1e-6. Its cache-off
    run bypasses by flushing: with `shared_in_call` the call's later requests still read the prefix the
    first one computed; with `bypass_broken` every request of it does."""

    name = "fake"

    def __init__(self, *, shared_in_call=False, bypass_broken=False):
        super().__init__("tiny-llama", dtype="float32")
        self.shared_in_call, self.bypass_broken = shared_in_call, bypass_broken
        self.meta["enable_prefix_caching"] = True
        self.bypasses_prefix_cache = True

    def _run(self, requests, read):
        out = []
        for index, job in enumerate(expand_samples(requests)):
            rng = np.random.default_rng(job.seed)
            tokens = tuple(int(t) for t in rng.integers(3, 500, size=job.sampling.max_tokens))
            cached = read(index)
            shift = 1e-6 if cached else 0.0
            lps = [-int.from_bytes(hashlib.sha256(repr((job.request.prompt_ids, tokens[:j + 1])).encode())
                                   .digest()[:4], "little") / 2**28 + shift for j in range(len(tokens))]
            out.append(self.rollout(job, tokens, lps, "length",
                                    num_cached_tokens=256 if cached else 0))
        return out

    def generate(self, requests):
        return self._run(requests, lambda index: True)

    def generate_uncached(self, requests):
        return self._run(requests, lambda index: self.bypass_broken or (self.shared_in_call and index > 0))

    def _score(self, pairs, sampling):
        raise NotImplementedError

    def close(self):
        pass


def _prefix_cache(backend):
    result = parity.audit("tiny-llama", backend, case=CASE, dtype="float32", checks=["prefix_cache"])
    return result.checks["prefix_cache"], result.provenance["audit"].get("prefix_cache")


def test_prefix_cache_check_compares_the_cache_with_a_whole_prefill_only():
    """Every warm read moves the logprobs; the cache-off run read the cache for all but its first sample
    (4 requests, n=2). Was: "1 of 4 requests differ" (7 samples compared the cache with itself). Now:
    the one sample prefilled whole is compared, the 7 others are left out, and the notes say so."""
    check, notes = _prefix_cache(SharedPrefixFake(shared_in_call=True))
    assert check.skipped is None and not check.identical
    assert (check.requests, check.differing_requests) == (1, 1)
    assert notes["samples_compared"] == 1
    assert notes["samples_left_out"] == {"read_the_cache_when_off": 7, "not_served_when_warm": 0}
    # negative control: a sound bypass compares every sample, and all four requests differ
    check, notes = _prefix_cache(SharedPrefixFake())
    assert (check.requests, check.differing_requests) == (4, 4)
    assert notes["samples_compared"] == 8 and "samples_left_out" not in notes


def test_a_cache_off_run_that_read_the_cache_everywhere_is_no_identical_check():
    """Was: identical (4 requests), the warm cache against itself. Now: skipped, saying why."""
    check, _ = _prefix_cache(SharedPrefixFake(bypass_broken=True))
    assert check.skipped is not None and "8 read the cache when off" in check.skipped
    assert not check.identical and check.requests == 0


class SleepDrifts(Backend):
    """Only sleep moves the logprobs (by 1e-6, for good); every other transition is clean."""

    name = "fake"

    def __init__(self):
        super().__init__("tiny-llama", dtype="bfloat16")
        self.offset = 0.0
        self.meta["enable_sleep_mode"] = True

    def generate(self, requests):
        out = []
        for job in expand_samples(requests):
            rng = np.random.default_rng(job.seed)
            tokens = [int(t) for t in rng.integers(3, 500, size=job.sampling.max_tokens)]
            out.append(self.rollout(job, tokens, [float(x) + self.offset for x in -rng.random(len(tokens))],
                                    "length"))
        return out

    def _score(self, pairs, sampling):
        return [torch.full((len(r),), -1.0) for _, r in pairs]

    def reset_prefix_cache(self):
        pass

    def sleep(self, level=1):
        self.offset += 1e-6

    def wake_up(self):
        pass

    def release_kv_cache(self):
        pass

    def close(self):
        pass


def test_a_lifecycle_check_is_judged_against_the_run_just_before_its_transition():
    """Was: kv_cache_release failed with sleep's 1e-6. Now only sleep_wake fails."""
    report = run_lifecycle(SleepDrifts(), checks=("repeat", "prefix_cache_reset", "sleep_wake",
                                                   "kv_cache_release"))
    assert {r.name: r.status for r in report.results} == {
        "repeat": "pass", "prefix_cache_reset": "pass", "sleep_wake": "fail", "kv_cache_release": "pass"}
    assert report.results[2].metrics["max_abs_logprob_diff"] == pytest.approx(1e-6)


def _rollout(rid, logprobs):
    return Rollout(rid, 0, (1, 2), (5, 6), logprobs, "length", "fake")


@pytest.mark.parametrize(("before", "after", "expected"), [
    ((-math.inf, -1.0), (-math.inf, -1.5), 0.5),      # was 0.0: -inf - -inf is NaN, max() kept 0.0
    ((math.nan, -1.0), (-0.5, -1.0), math.nan),       # was 0.0: a NaN on one side
    ((-math.inf, -1.0), (-math.inf, -1.0), 0.0),      # the same -inf on both sides is no difference
    ((math.nan, -1.0), (math.nan, -1.0), 0.0),
])
def test_lifecycle_max_logprob_diff_sees_through_infinities_and_nans(before, after, expected):
    m = same_rollouts([_rollout("a", (-1.0, -2.0)), _rollout("b", before)],
                      [_rollout("a", (-1.0, -2.0)), _rollout("b", after)])
    got = m["max_abs_logprob_diff"]
    assert (math.isnan(got) and math.isnan(expected)) or got == expected


def test_a_stage_overflowing_alike_on_both_sides_keeps_its_numbers():
    inf = float("inf")
    a = [torch.tensor([[1.0, inf], [2.0, 3.0]], dtype=torch.float16)]
    same = StageDiff.between("layer.3", a, [t.clone() for t in a])
    assert (same.max_abs, same.rel_error, same.differing) == (0.0, 0.0, 0)  # max_abs was NaN
    moved = StageDiff.between("layer.3", a, [torch.tensor([[1.5, inf], [2.0, 3.0]], dtype=torch.float16)])
    assert moved.differing == 1 and moved.max_abs == 0.5  # was NaN
    assert moved.rel_error == pytest.approx(0.5 / math.sqrt(1 + 4 + 9))  # was NaN
    # an infinity on one side only is an infinite difference
    one = StageDiff.between("layer.3", [torch.tensor([1.0, 2.0])], [torch.tensor([1.0, inf])])
    assert one.differing == 1 and one.max_abs == inf and one.rel_error == inf


class DropsAScore(SharedPrefixFake):
    """Scores one sequence fewer than it is given (the cache is off: prefill_decode runs)."""

    def __init__(self):
        super().__init__()
        self.meta["enable_prefix_caching"] = False

    def _score(self, pairs, sampling):
        rollouts = {(r.prompt_ids, r.token_ids): r for r in self._last}
        return [torch.tensor(rollouts[(tuple(p), tuple(t))].logprobs, dtype=torch.float64)
                for p, t in pairs[:-1]]

    def generate_uncached(self, requests):
        self._last = super().generate_uncached(requests)
        return self._last


def test_prefill_decode_refuses_a_score_list_shorter_than_the_samples():
    """Was: zip compared the first 7 of 8 samples and said "identical (4 requests)"."""
    case = default_case("tiny-llama", num_prompts=4, max_tokens=4)
    neutral = type(case)(name="neutral", model="tiny-llama", requests=tuple(
        r.__class__(r.prompt_ids, r.sampling.replace(top_p=1.0, top_k=0, temperature=1.0), r.request_id)
        for r in case.requests))
    with pytest.raises(parity.ParityError, match="scored 7 sequences for the 8"):
        parity.audit("tiny-llama", DropsAScore(), case=neutral, dtype="float32", checks=["prefill_decode"])
