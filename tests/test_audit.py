"""The audit (parity.audit) without engines: the result's JSON, the comparison of two runs, the derived
requests, and every check against a fake backend with one planted defect each (the negative controls:
each check must fail on its defect and only there). Real engines: tests/test_audit_engines.py.
"""

import hashlib
import json

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import parity
from parity.audit import CHECKS, AuditResult, CheckResult
from parity.audit.derived import check_batch_sizes, needle_batches, reseeded, shuffled, with_prefix
from parity.audit.diff import Pair, common_prefix, compare_pairs, pair_runs, route_hash
from parity.audit.result import CHECK_KEYS, RESULT_KEYS
from parity.backends.base import Backend, expand_samples
from parity.core.errors import ConfigError, InputError
from parity.core.turns import Generate
from parity.core.types import Request, Rollout, SamplingParams
from parity.workload.cases import Case, default_case

# -- the result's JSON --------------------------------------------------------------------------------


def _check(identical=True, requests=3, differing=0, **kw):
    return CheckResult(identical=identical, requests=requests, differing_requests=differing,
                       first_difference=kw.pop("first", None), max_abs_logprob_diff=kw.pop("peak", 0.0),
                       mean_abs_logprob_diff=kw.pop("mean", 0.0), **kw)


def _result(**checks):
    full = {name: checks.get(name, _check()) for name in CHECKS}
    return AuditResult(backend="fake", model="tiny-llama", dtype="float32", provenance={"case": "x"},
                       checks=full)


def test_the_json_has_exactly_the_documented_keys_and_round_trips():
    result = _result(batch=_check(False, 4, 2, first={"what": "tokens"}, peak=0.5, mean=0.01),
                     prefix_cache=CheckResult.skip("no prefix cache"))
    d = json.loads(result.to_json())
    assert tuple(d) == RESULT_KEYS and tuple(d["checks"]) == CHECKS
    assert all(tuple(c) == CHECK_KEYS for c in d["checks"].values())
    assert d["deterministic"] is True and d["batch_invariant"] is False
    assert d["checks"]["prefix_cache"] == {"identical": False, "requests": 0, "differing_requests": 0,
                                           "first_difference": None, "max_abs_logprob_diff": 0.0,
                                           "mean_abs_logprob_diff": 0.0, "skipped": "no prefix cache"}
    assert AuditResult.from_json(result.to_json()) == result


def test_verdicts_follow_their_checks():
    assert not _result(repeat=_check(False, 3, 1)).deterministic
    assert not _result(order=_check(False, 3, 3)).batch_invariant
    assert not _result(batch=CheckResult.skip("not asked for")).batch_invariant  # a skip is not a pass
    assert _result(seed=_check(False, 3, 3)).control_held
    assert not _result(seed=_check(True, 3, 0)).control_held
    assert "control FAILED" in _result(seed=_check(True, 3, 0)).summary_text()


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("dtype"), "missing key 'dtype'"),
    (lambda d: d.update(extra=1), "unknown key 'extra'"),
    (lambda d: d["checks"]["repeat"].pop("skipped"), "missing key 'skipped'"),
    (lambda d: d["checks"].pop("seed"), "missing key 'seed'"),
    (lambda d: d.update(deterministic=False), "deterministic=False contradicts"),
    (lambda d: d["checks"]["order"].update(identical=False), "contradicts 0 of 3"),
    (lambda d: d["checks"]["order"].update(differing_requests=4), "exceeds requests"),
    (lambda d: d["checks"]["order"].update(max_abs_logprob_diff=-1.0), "max_abs_logprob_diff must be"),
])
def test_a_malformed_result_names_what_is_wrong(mutate, message):
    d = _result().to_dict()
    mutate(d)
    with pytest.raises(InputError, match=message):
        AuditResult.from_dict(d)


def test_a_skipped_check_compares_nothing():
    with pytest.raises(InputError, match="skipped check compares nothing"):
        _check(False, 3, 0, skipped="why")


# -- comparing two runs -------------------------------------------------------------------------------


def _rollout(tokens, logprobs, *, request="r", sample=0, routes=None, prompt=(5, 6, 7)):
    return Rollout(request_id=request, sample_index=sample, prompt_ids=prompt, token_ids=tuple(tokens),
                   logprobs=tuple(logprobs), finish_reason="length", backend="fake", routed_experts=routes)


def test_identical_runs_are_identical_and_measure_zero():
    a = _rollout([1, 2, 3], [-0.5, float("-inf"), float("nan")])
    result = compare_pairs([Pair(a, a)])
    assert result.identical and result.max_abs_logprob_diff == 0.0 and result.first_difference is None


def test_one_ulp_in_one_logprob_is_found_where_it_is():
    lps = [-0.5, -1.25, -2.0]
    b = list(lps)
    b[2] = float(np.nextafter(b[2], 0.0))
    result = compare_pairs([Pair(_rollout([1, 2, 3], lps), _rollout([1, 2, 3], b))])
    assert not result.identical and result.differing_requests == 1
    assert result.first_difference["what"] == "logprobs" and result.first_difference["position"] == 2
    assert result.max_abs_logprob_diff == abs(b[2] - lps[2]) > 0


def test_diverged_tokens_count_and_logprobs_are_measured_on_the_common_prefix_only():
    a = _rollout([1, 2, 3, 4], [-1.0, -1.5, -2.0, -9.0])
    b = _rollout([1, 2, 7, 8], [-1.0, -1.25, -0.1, -0.2])  # diverges at token 2; logprob 1 differs too
    result = compare_pairs([Pair(a, b, {"batch_size": 8})])
    assert result.differing_requests == 1 and result.max_abs_logprob_diff == 0.25
    assert result.mean_abs_logprob_diff == 0.125  # over the 2 tokens of the common prefix
    assert result.first_difference["what"] == "logprobs" and result.first_difference["position"] == 1
    same_lps = compare_pairs([Pair(a, _rollout([1, 2, 7, 8], [-1.0, -1.5, -2.0, -9.0]))])
    assert same_lps.first_difference["what"] == "tokens" and same_lps.first_difference["position"] == 2
    assert same_lps.first_difference["a_token"] == 3 and same_lps.first_difference["b_token"] == 7
    assert same_lps.max_abs_logprob_diff == 0.0 and not same_lps.identical  # tokens differ: not identical


def test_a_shorter_response_is_a_token_difference():
    result = compare_pairs([Pair(_rollout([1, 2, 3], [-1.0] * 3), _rollout([1, 2], [-1.0] * 2))])
    assert result.first_difference["what"] == "tokens" and result.first_difference["position"] == 2
    assert result.first_difference["b_token"] is None


def test_routes_are_compared_as_sets_over_positions_whose_inputs_agree():
    routes = np.array([[[0, 1], [2, 3]]] * 5, np.int32)  # prompt 3 + 3 tokens - 1 = 5 positions
    reordered = routes[:, :, ::-1].copy()  # the same sets, other order: not a difference
    flipped = routes.copy()
    flipped[3, 1] = [2, 4]
    a = _rollout([1, 2, 3], [-1.0] * 3, routes=routes)
    assert compare_pairs([Pair(a, _rollout([1, 2, 3], [-1.0] * 3, routes=reordered))]).identical
    result = compare_pairs([Pair(a, _rollout([1, 2, 3], [-1.0] * 3, routes=flipped))])
    first = result.first_difference
    assert not result.identical and first["what"] == "routes"
    assert (first["route_position"], first["route_layer"]) == (3, 1)
    assert first["route_hashes"][0] == route_hash(reordered) != first["route_hashes"][1]
    # after a divergence at token 0 only the prompt's positions (0..2) are comparable: position 3 is not
    diverged = compare_pairs([Pair(a, _rollout([9, 2, 3], [-1.0] * 3, routes=flipped))])
    assert diverged.first_difference["what"] == "tokens" and "route_position" not in diverged.first_difference


@given(st.integers(0, 2**32 - 1), st.sampled_from(["none", "token", "logprob", "route"]))
@pytest.mark.slow
def test_a_single_planted_difference_is_always_found_at_its_place(seed, kind):
    rng = np.random.default_rng(seed)
    samples = int(rng.integers(1, 6))
    pairs, planted_at = [], None
    for i in range(samples):
        length = int(rng.integers(1, 12))
        tokens, lps = rng.integers(0, 50, length).tolist(), (-rng.exponential(size=length)).tolist()
        routes = rng.integers(0, 8, (3 + length - 1, 2, 2)).astype(np.int32)
        a = _rollout(tokens, lps, request=f"r{i}", routes=routes)
        b_tokens, b_lps, b_routes = list(tokens), list(lps), routes.copy()
        if i == samples - 1 and kind != "none":
            planted_at = int(rng.integers(0, length))
            if kind == "token":
                b_tokens[planted_at] += 1
            elif kind == "logprob":
                b_lps[planted_at] = float(np.nextafter(b_lps[planted_at], -np.inf))
            else:
                planted_at = int(rng.integers(0, routes.shape[0]))
                b_routes[planted_at, 1, 0] = 8  # an expert no set holds
        pairs.append(Pair(a, _rollout(b_tokens, b_lps, request=f"r{i}", routes=b_routes)))
    result = compare_pairs(pairs)
    assert result.identical == (kind == "none")
    if kind != "none":
        first = result.first_difference
        assert result.differing_requests == 1 and first["request_id"] == f"r{samples - 1}"
        key = "route_position" if kind == "route" else "position"
        assert first[key] == planted_at


def test_pairs_must_be_the_same_samples():
    a, b = _rollout([1], [-1.0], request="a"), _rollout([1], [-1.0], request="b")
    with pytest.raises(parity.ParityError, match="missing from a run"):
        pair_runs([a], [b])
    with pytest.raises(parity.ParityError, match="was paired with"):
        compare_pairs([Pair(a, b)])
    assert common_prefix([1, 2, 3], [1, 2]) == 2 and common_prefix([], [1]) == 0


# -- the derived requests -----------------------------------------------------------------------------


def test_needles_sit_alone_then_spread_over_batches_of_other_length_neighbours():
    case = default_case("tiny-llama", num_prompts=6)
    plan = needle_batches(case.requests, (1, 8, 64), seed=0, context=512)
    assert [n.request_id for n in plan.needles] == [r.request_id for r in case.requests[:4]]
    assert all(n.sampling.n == 1 and n.sampling.seed == r.sampling.seed
               for n, r in zip(plan.needles, case.requests))
    needle_lengths = {len(n.prompt_ids) for n in plan.needles}
    pool = {t for r in case.requests[:4] for t in r.prompt_ids}
    for size, batch in plan.batches.items():
        assert len(batch) == size and len({r.request_id for r in batch}) == size
        where = [i for i, r in enumerate(batch) if r in plan.needles]
        assert where[0] == 0 and where[-1] == size - 1 and len(where) == 4
        neighbours = [r for r in batch if r not in plan.needles]
        assert all(len(r.prompt_ids) not in needle_lengths and set(r.prompt_ids) <= pool for r in neighbours)
        # same sampling but the seed: a backend grouping requests by sampling batches them together
        assert all(r.sampling.replace(seed=0) == plan.needles[0].sampling.replace(seed=0) for r in neighbours)
        assert len({r.sampling.seed for r in batch}) == size


def test_derived_requests_keep_ids_and_change_one_thing():
    requests = default_case("tiny-llama").requests
    order = shuffled(requests, 0)
    assert order != requests and set(order) == set(requests)
    other = reseeded(requests)
    assert [r.prompt_ids for r in other] == [r.prompt_ids for r in requests]
    assert not {r.sampling.seed for r in other} & {r.sampling.seed for r in requests}
    prefixed = with_prefix(requests, 256, seed=0)
    assert len({r.prompt_ids[:256] for r in prefixed}) == 1
    assert all(p.prompt_ids[256:] == r.prompt_ids for p, r in zip(prefixed, requests))


@pytest.mark.parametrize("sizes", [(8, 64), (1, 8), (1, 0, 8), "1,8,64", (1, 8, 8)])
def test_batch_sizes_need_one_and_two_larger(sizes):
    with pytest.raises(ConfigError, match="batch_sizes"):
        check_batch_sizes(sizes)


# -- the checks, against a fake backend with one planted defect each ----------------------------------


class Fake(Backend):
    """A backend whose tokens come from each sample's seed and whose logprobs are a function of
    the sequence, so that it is deterministic, batch-invariant and prefill==decode, unless `defect`
    plants one flaw:

    repeat: a batch sampled before moves by 1e-6 nat the second time; batch: logprobs move by 1e-6
    per sample in the call; order: by 1e-6 per position in the call (scores are computed the same
    way, so decode still equals prefill); prefill: scores are 1e-6 off; seed: tokens ignore the
    seed; cache: a cached read moves logprobs (the cache is on and can be bypassed); routes: routes
    change with the batch size (MoE).
    """

    name = "fake"

    def __init__(self, model="tiny-llama", *, dtype="float32", defect=None):
        super().__init__(model, dtype=dtype)
        self.defect = defect
        self.calls = 0
        self.seen = set()
        self.meta["enable_prefix_caching"] = defect == "cache"
        self.bypasses_prefix_cache = True

    @staticmethod
    def _logprob(prompt, tokens):
        digest = hashlib.sha256(repr((prompt, tokens)).encode()).digest()
        return -int.from_bytes(digest[:4], "little") / 2**28

    def _run(self, requests, cached):
        jobs = expand_samples(requests)
        batch = tuple((r.request_id, r.prompt_ids, r.sampling) for r in requests)
        again, out = batch in self.seen, []
        self.seen.add(batch)
        for position, job in enumerate(jobs):
            rng = np.random.default_rng(0 if self.defect == "seed" else job.seed)
            tokens = tuple(int(t) for t in rng.integers(3, 500, size=job.sampling.max_tokens))
            shift = {"repeat": again, "batch": len(jobs), "order": position}.get(self.defect, 0) * 1e-6
            if cached and self.defect == "cache":
                shift = 1e-6
            lps = [self._logprob(job.request.prompt_ids, tokens[:j + 1]) + shift for j in range(len(tokens))]
            routes = None
            if self.defect == "routes":
                routes = np.zeros((len(job.request.prompt_ids) + len(tokens) - 1, 2, 2), np.int32)
                routes[-1, 0, 0] = len(jobs) > 1
            out.append(self.rollout(job, tokens, lps, "length", routes,
                                    num_cached_tokens=len(job.request.prompt_ids) if cached else 0))
        self.calls += 1
        return out

    def generate(self, requests):
        return self._run(requests, cached=self.has_prefix_cache)

    def generate_uncached(self, requests):
        return self._run(requests, cached=False)

    def _score(self, pairs, sampling):
        out = []
        for position, (p, r) in enumerate(pairs):
            off = {"prefill": 1, "batch": len(pairs), "order": position}.get(self.defect, 0) * 1e-6
            out.append(torch.tensor([self._logprob(p, tuple(r[:j + 1])) + off for j in range(len(r))],
                                    dtype=torch.float64))
        return out

    def close(self):
        pass


SMALL = default_case("tiny-llama", num_prompts=4, max_tokens=4)
#: the checks each defect must break, and no other (a row's place in its batch also moves a needle)
BROKEN_BY = {"repeat": {"repeat"}, "batch": {"batch"}, "order": {"order", "batch"},
             "prefill": {"prefill_decode"},
             "cache": {"prefix_cache"}, "seed": {"seed"}, "routes": {"batch"}}


def _audit(defect, **kw):
    return parity.audit("tiny-llama", Fake(defect=defect), case=SMALL, dtype="float32", **kw)


def test_a_sound_backend_is_identical_everywhere_and_the_control_holds():
    result = _audit(None)
    assert result.deterministic and result.batch_invariant and result.control_held
    assert all(result.checks[c].identical for c in ("repeat", "batch", "order", "prefill_decode"))
    assert "without a prefix cache" in result.checks["prefix_cache"].skipped
    assert result.checks["seed"].differing_requests == 4


@pytest.mark.parametrize("defect", sorted(BROKEN_BY))
def test_each_planted_defect_breaks_its_check_and_only_it(defect):
    result = _audit(defect)
    for name, check in result.checks.items():
        if name == "seed":
            assert check.identical == (defect == "seed"), name  # the control: identical if seeds are ignored
        elif name == "prefix_cache" and defect != "cache":
            assert check.skipped is not None
        else:
            assert check.identical != (name in BROKEN_BY[defect]), (name, check)
    assert result.deterministic == (defect != "repeat")
    assert result.batch_invariant == (defect not in ("batch", "order", "routes"))
    if defect == "routes":
        first = result.checks["batch"].first_difference
        assert first["what"] == "routes" and first["route_layer"] == 0 and first["context"]["batch_size"] == 8
    if defect == "cache":
        assert result.checks["prefix_cache"].first_difference["context"]["cached_tokens"] > 0
        assert result.provenance["audit"]["prefix_cache"]["shared_prefix_tokens"] == 256


@given(seed=st.integers(0, 2**31 - 1),
       sizes=st.lists(st.integers(2, 70), min_size=2, max_size=3, unique=True).map(lambda s: [1, *s]))
@pytest.mark.slow
def test_any_batch_composition_leaves_a_sound_needle_alone_and_moves_a_batch_variant_one(seed, sizes):
    """Generated neighbours (the audit's seed) and batch sizes: the check holds for an invariant
    backend and fails for one whose logprobs follow the batch size (the negative control)."""
    sound = parity.audit("tiny-llama", Fake(), case=SMALL, dtype="float32", checks=["batch"],
                         batch_sizes=sizes, seed=seed)
    assert sound.checks["batch"].identical
    variant = parity.audit("tiny-llama", Fake(defect="batch"), case=SMALL, dtype="float32", checks=["batch"],
                           batch_sizes=sizes, seed=seed)
    assert not variant.checks["batch"].identical and variant.checks["batch"].differing_requests >= 1


def test_processed_logprobs_under_truncation_are_resampled_neutral_for_prefill_decode():
    truncated = default_case("tiny-llama", num_prompts=2, max_tokens=4)  # top_p 0.95
    result = parity.audit("tiny-llama", Fake(), case=truncated, dtype="float32", checks=["prefill_decode"])
    assert result.checks["prefill_decode"].identical
    assert "temperature 1" in result.provenance["audit"]["prefill_decode"]


def test_checks_not_asked_for_and_greedy_control_are_skipped_with_the_reason():
    greedy = Case(name="greedy", model="tiny-llama", requests=tuple(
        Request(r.prompt_ids, r.sampling.replace(temperature=0.0), r.request_id) for r in SMALL.requests))
    result = parity.audit("tiny-llama", Fake(), case=greedy, dtype="float32", checks=["repeat", "seed"])
    assert result.checks["batch"].skipped.startswith("not asked for")
    assert "greedy" in result.checks["seed"].skipped and result.control_held
    one = Case(name="one", model="tiny-llama", requests=SMALL.requests[:1])
    assert "one request" in parity.audit("tiny-llama", Fake(), case=one, checks=["order"],
                                         dtype="float32").checks["order"].skipped


def test_a_cache_the_backend_cannot_bypass_skips_the_cache_check_and_says_why():
    backend = Fake(defect="cache")
    backend.bypasses_prefix_cache = False
    result = parity.audit("tiny-llama", backend, case=SMALL, dtype="float32",
                          checks=["repeat", "prefix_cache"])
    assert "cannot run a request without reading its prefix cache" in result.checks["prefix_cache"].skipped
    assert "served from the cache" in result.provenance["audit"]["prefix_cache_reads"]


def _trajectory_case():
    return Case(name="t", model="tiny-llama", kind="trajectory", requests=(
        Request((5, 6), SamplingParams(max_tokens=4), "t0", turns=(Generate(4),)),))


@pytest.mark.parametrize("kwargs, message", [
    ({"checks": ["repeat", "nope"]}, "unknown"),
    ({"batch_sizes": (1, 8)}, "batch_sizes"),
    ({"device": "cuda:7"}, "CUDA device"),
    ({"case": "no-such-case.toml"}, "no-such-case"),
    ({"seed": -1}, "seed"),
    ({"dtype": "float64"}, "dtype"),
    ({"case": _trajectory_case()}, "multi-turn"),
    ({"case": Case(name="big", model="tiny-llama", requests=(Request((600,), SamplingParams(), "x"),))},
     "vocabulary"),
])
def test_bad_input_is_refused_before_the_backend_runs(kwargs, message):
    backend = Fake()
    with pytest.raises(parity.ParityError, match=message):
        parity.audit("tiny-llama", backend, **{"case": SMALL, **kwargs})
    assert backend.calls == 0


def test_a_running_backend_takes_no_options_and_must_match_model_and_dtype():
    with pytest.raises(ConfigError, match="already running"):
        parity.audit("tiny-llama", Fake(), case=SMALL, batch_invariant=True)
    with pytest.raises(ConfigError, match="dtype"):
        parity.audit("tiny-llama", Fake(), case=SMALL, dtype="bfloat16")
    with pytest.raises(ConfigError, match="not model"):
        parity.audit("tiny-qwen3", Fake(), case=SMALL, dtype="float32")


def test_the_page_renders_from_the_stored_json():
    from parity.render.audit import audit_html

    result = _audit("batch")
    page = audit_html(json.loads(result.to_json()))
    assert page.startswith("<!DOCTYPE html>")
    assert "batch-invariant: no" in page and "deterministic: yes" in page
    assert "without a prefix cache" in page and "batch_size" in page
