"""Round 6, the reference engine's requests and sampling: what it would have sampled, scored or
checked silently wrong (each test fails on the code before its fix)."""

from __future__ import annotations

import dataclasses
import math
from collections import deque

import numpy as np
import pytest

from parity.core.errors import ConfigError, InputError
from parity.core.top_k import TopKError
from parity.core.turns import Generate, Inject
from parity.core.types import Request, Rollout, SamplingParams
from parity.engine import ReferenceEngine, train_forward
from parity.engine.gold import gold_logprobs
from parity.engine.selfcheck import sampling_grid_check

MODEL = "tiny-llama"  # vocabulary 512, context 512


@pytest.fixture(scope="module")
def engine() -> ReferenceEngine:
    return ReferenceEngine(MODEL)


@pytest.fixture(scope="module")
def rollouts(engine: ReferenceEngine) -> list[Rollout]:
    sampling = SamplingParams(max_tokens=3, seed=1, top_k_logprobs=2)
    return engine.generate([Request((5, 9, 13, 21), sampling, "a")])


def test_repeated_request_ids_are_refused_not_given_one_key(engine):
    """Two requests of one id gave two rollouts keyed ('a', 0): every later match by key mixes them."""
    twice = [Request((5, 6, 7), SamplingParams(max_tokens=1, seed=1), "a"),
             Request((8, 9), SamplingParams(max_tokens=1, seed=2), "a")]
    with pytest.raises(InputError, match="'a' appears twice"):
        engine.generate(twice)


def test_a_stop_id_outside_the_vocabulary_is_refused(engine):
    """A stop id the model cannot sample never stops anything: the response ran on to max_tokens."""
    with pytest.raises(InputError, match="stop_token_ids: token id 1000000 is outside the vocabulary"):
        engine.generate([Request((5, 6, 7), SamplingParams(max_tokens=2, stop_token_ids=(10**6,)), "a")])
    turns = (Generate(2, stop_token_ids=(512,)), Inject((7,)), Generate(2))
    with pytest.raises(InputError, match=r"turns\[0\].stop_token_ids: token id 512"):
        engine.generate([Request((5, 6, 7), SamplingParams(max_tokens=8), "a", turns=turns)])


def test_a_seed_past_64_bits_is_refused_not_folded_onto_a_smaller_one(engine):
    """Seed 2^64 drew exactly the tokens of seed 0 (the noise hashes 64-bit words)."""
    with pytest.raises(ConfigError, match=r"seed 18446744073709551616 is 2\^64 or more.*seed 0"):
        engine.generate([Request((5, 6, 7), SamplingParams(max_tokens=1, seed=2**64), "a")])
    top, = engine.generate([Request((5, 6, 7), SamplingParams(max_tokens=1, seed=2**64 - 1), "a")])
    assert len(top.token_ids) == 1  # the largest 64-bit seed still samples


def test_a_temperature_whose_scaled_logits_overflow_is_refused(engine):
    """At temperature 1e-38 logits / temperature overflow float32: the engine sampled token 0 with
    NaN logprobs, and the training forward scored NaN."""
    with pytest.raises(ConfigError, match="temperature 1e-38 is below 1e-30"):
        engine.generate([Request((5, 6, 7), SamplingParams(max_tokens=2, temperature=1e-38), "a")])
    with pytest.raises(ConfigError, match="temperature 1e-38 is below 1e-30"):
        train_forward(MODEL, [((5, 6, 7), (8, 9))], temperature=1e-38)
    # raw logprobs do not depend on the temperature, and the floor itself samples finite numbers
    raw, = train_forward(MODEL, [((5, 6, 7), (8, 9))], temperature=1e-38, logprobs_mode="raw").logprobs
    assert raw.isfinite().all()
    low, = engine.generate([Request((5, 6, 7), SamplingParams(max_tokens=2, temperature=1e-30), "a")])
    assert all(math.isfinite(x) for x in low.logprobs)


def test_the_gold_scores_a_batch_of_empty_responses():
    """A micro-batch whose responses were all empty indexed with a float tensor: IndexError."""
    out = gold_logprobs(MODEL, [((5, 6, 7), ())])
    assert len(out) == 1 and out[0].shape == (0,)


def test_rollouts_in_a_deque_are_checked_against_their_model(rollouts):
    """A deque of Rollouts skipped every check of their record: another model scored them silently."""
    with pytest.raises(ConfigError, match="is not the model the rollouts were sampled with"):
        train_forward("tiny-qwen3", deque(rollouts))
    with pytest.raises(ConfigError, match="is not the model the rollouts were sampled with"):
        gold_logprobs("tiny-qwen3", deque(rollouts))
    from_deque, = train_forward(MODEL, deque(rollouts)).logprobs
    assert np.array_equal(from_deque.numpy(), np.array(rollouts[0].logprobs, dtype=np.float32))


def test_engine_top_k_ids_past_the_vocabulary_are_refused_before_the_forward(rollouts):
    """An id past the vocabulary crashed the distribution view with a bare RuntimeError."""
    ids = rollouts[0].top_k_ids.copy()
    ids[:, 1] = 700
    bad = dataclasses.replace(rollouts[0], top_k_ids=ids)
    with pytest.raises(TopKError, match="id >= the vocabulary size 512"):
        train_forward(MODEL, [bad], distribution=True)


@pytest.mark.parametrize("options, match", [({"requests": 0}, "requests must be an integer >= 1"),
                                            ({"grid": ()}, "grid is empty")])
def test_a_sampling_grid_check_of_nothing_is_refused(options, match):
    """requests=0 or an empty grid checked no token and read as every setting exact."""
    with pytest.raises(ConfigError, match=match):
        sampling_grid_check(MODEL, dtype="float32", **options)
