"""HF adapter (plain generate, padded batches) and the reference adapter, run for real."""

import pytest
import torch

from parity.backends import shared_backend
from parity.backends.hf import translate_sampling
from parity.core.types import Request, SamplingParams

PROMPTS = [(1, 40, 41, 42, 43, 44), (1, 70, 71), (1, 100, 101, 102, 103, 104, 105, 106, 107, 108)]


def requests(**kw):
    base = dict(n=2, temperature=0.7, top_p=0.9, max_tokens=10, seed=3)
    return [Request(p, SamplingParams(**{**base, **kw}), f"r{i}") for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def hf():
    return shared_backend("hf", "tiny-llama", dtype="float32")


def test_translation_is_explicit():
    sp = SamplingParams(temperature=0.7, top_k=0, top_p=0.9, max_tokens=5, stop_token_ids=(9,))
    fields = translate_sampling(sp, (2,), 0)
    assert fields["top_k"] == 0  # HF would use 50 if left unset
    assert fields["max_new_tokens"] == 5 and fields["eos_token_id"] == [9, 2]
    assert translate_sampling(sp.replace(ignore_eos=True), (2,), 0)["eos_token_id"] == [9]
    assert translate_sampling(sp.replace(temperature=0), (2,), 0)["do_sample"] is False


@pytest.mark.slow
def test_generate_padded_batch_matches_score(hf):
    """Processed logprobs from HF's warped scores equal score(processed) on the same tokens."""
    reqs = requests()
    rollouts = hf.generate(reqs)
    assert [r.key for r in rollouts] == [(f"r{i}", s) for i in range(3) for s in range(2)]
    assert [r.sampling for r in rollouts] == [q.sampling for q in reqs for _ in range(2)]
    assert all(r.backend == "hf" and r.meta["padding"] == "left" for r in rollouts)
    gen = torch.tensor([lp for r in rollouts for lp in r.logprobs])
    score = torch.cat(hf.score(rollouts, logprobs_mode="processed", temperature=0.7, top_p=0.9))
    # fp32, left- vs right-padded SDPA: equal up to float rounding
    assert (gen - score).abs().max() < 1e-4


@pytest.mark.slow
def test_raw_mode_greedy_and_stops(hf):
    raw = hf.generate(requests(logprobs_mode="raw", n=1))
    score = torch.cat(hf.score(raw))
    assert (torch.tensor([lp for r in raw for lp in r.logprobs]) - score).abs().max() < 1e-4
    greedy = hf.generate(requests(temperature=0, n=1))
    assert all(lp == 0.0 for r in greedy for lp in r.logprobs)  # point mass under greedy
    assert all("greedy_conversion" in r.meta for r in greedy)
    stop_at = greedy[0].token_ids[1]
    stopped = hf.generate([Request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10,
                                                              stop_token_ids=(stop_at,)), "s")])[0]
    assert stopped.token_ids == greedy[0].token_ids[:greedy[0].token_ids.index(stop_at) + 1]
    assert stopped.finish_reason == "stop"
    long = hf.generate([Request(PROMPTS[1], SamplingParams(max_tokens=30, ignore_eos=True), "l")])[0]
    assert len(long.token_ids) == 30 and long.finish_reason == "length"


@pytest.mark.slow
def test_reference_backend_is_bitwise_equal_to_its_score():
    ref = shared_backend("reference", "tiny-qwen3-moe", dtype="float32")
    reqs = requests()
    rollouts = ref.generate(reqs)
    assert all(r.backend == "reference" and r.meta["batch_invariant"] for r in rollouts)
    assert [r.sampling for r in rollouts] == [q.sampling for q in reqs for _ in range(2)]
    scores = ref.score(rollouts, logprobs_mode="processed", temperature=0.7, top_p=0.9)
    assert all(torch.equal(s, torch.tensor(r.logprobs)) for s, r in zip(scores, rollouts))
