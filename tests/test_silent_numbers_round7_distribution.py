"""Round 7, full-distribution drift: top-k that is no distribution, the engine's first bucket with mass on
one side only, infinite positions in the KL means, an empty response read back from JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest

from parity.assess.distribution import distribution_section
from parity.core.top_k import TopKError, check_top_k
from parity.core.types import Rollout
from parity.drift.distribution import position_drift, summarize_distribution, trainer_view


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    top = x.max(axis=-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))


def _rollout(request_id: str, ids: np.ndarray, logprobs: np.ndarray) -> Rollout:
    return Rollout(request_id, 0, (1, 2), tuple(int(i) for i in ids[:, 0]), tuple(logprobs[:, 0]), "stop",
                   "x", top_k_ids=ids, top_k_logprobs=logprobs)


# -- 1. a top-k that is no distribution ------------------------------------------------------------


def test_a_top_k_whose_probabilities_sum_far_above_one_is_refused():
    """Logits all <= 0 (mass 2.58) were scored: KL(train || engine) came out 0 and the engine's
    entropy 0.33 for a top-k that is no distribution at all."""
    with pytest.raises(TopKError, match=r"sum above 1.*position 1"):
        check_top_k([[0, 1, 2], [0, 1, 2]], [[-0.1, -3.0, -4.0], [-0.01, -0.02, -0.5]], "x")
    with pytest.raises(TopKError, match="sum above 1"):  # through a Rollout, as a dump or a user gives it
        Rollout("a", 0, (1,), (5,), (-0.01,), "stop", "x", top_k_ids=[[5, 7]],
                top_k_logprobs=[[-0.01, -0.02]])


def test_a_top_k_whose_first_entry_is_minus_inf_is_refused():
    """A row of -inf (no mass) gave KL(train || engine) inf and a finite KL(engine || train) of 2.9."""
    with pytest.raises(TopKError, match="first entry is -inf"):
        check_top_k([[0, 1]], [[-np.inf, -np.inf]], "x")


def test_bfloat16_rounded_top_k_of_a_real_distribution_is_still_accepted():
    """The mass check leaves room for a bfloat16 dump: 1000 near-uniform entries rounded to 8 bits."""
    rng = np.random.default_rng(0)
    logprobs = _log_softmax(rng.normal(scale=0.05, size=(8, 1000)))
    rounded = np.sort(logprobs, axis=1)[:, ::-1]
    as_bits = rounded.astype(np.float32).view(np.uint32)
    up = (as_bits + 0x7FFF + ((as_bits >> 16) & 1)) & 0xFFFF0000  # round to nearest even bfloat16
    bf16 = up.view(np.float32).astype(np.float64)
    assert np.exp(bf16).sum(axis=1).max() > 1.0  # the rounding pushed the mass above 1
    ids = np.tile(np.arange(1000), (8, 1))
    _, checked = check_top_k(ids, bf16, "x")
    assert np.array_equal(checked, bf16)
    check_top_k([[5, 7]], [[0, -20]], "x")  # a top-1 of all the mass, a far second


# -- 2. the engine's first bucket with mass on one side only ---------------------------------------


def test_greedy_engines_on_different_tokens_have_an_infinite_kl_not_zero():
    """Engine greedy on token 1 (listed [1, 2]), trainer greedy on token 0: TV 1 but both KL bounds 0,
    and the position not counted among the infinite ones, as if the two agreed."""
    train = np.array([[0.0, -np.inf, -np.inf, -np.inf]])
    view = trainer_view(train, np.array([[1, 2]]), np.array([1]))
    drift = position_drift(np.array([[0.0, -np.inf]]), view)
    assert drift.tv[0] == 1.0
    assert drift.kl_engine_train[0] == np.inf
    summary = summarize_distribution(drift, 2)
    assert summary["distribution/num_positions_infinite_kl"] == 1


def test_a_rounding_residue_is_not_the_mass_of_a_token_the_trainer_excludes():
    """Every token listed, the engine greedy on token 2, the trainer at -inf there: the trainer's tail (a
    residue of 1e-9, below TAIL_EPS) merged into that bucket gave KL(engine || train) = log(1e9) = 20.7,
    a number made of the residue, not inf (the engine puts all its mass where the trainer puts none)."""
    train = np.log(np.array([0.5, 0.3, 1.0, 0.2 - 1e-9]))
    train[2] = -np.inf
    ids = np.array([[2, 0, 1, 3]])
    drift = position_drift(np.array([[0.0, -np.inf, -np.inf, -np.inf]]), trainer_view(train[None], ids,
                                                                                      np.array([2])))
    assert drift.kl_engine_train[0] == np.inf
    assert summarize_distribution(drift, 4)["distribution/num_positions_infinite_kl"] == 1


def test_an_infinite_position_is_kept_out_of_both_kl_means():
    """docs/DISTRIBUTION.md: positions with an infinite bound are counted apart and kept out of the KL
    means. A greedy swap's vacuous KL(train || engine) = 0 stayed in that mean and halved it."""
    train = _log_softmax(np.array([[2.0, 1.0, 0.0, -1.0]]))
    engine = _log_softmax(np.array([[2.1, 0.9, 0.0, -1.0]]))
    ids = np.array([[0, 1]])
    close = position_drift(engine[:, :2], trainer_view(train, ids, np.array([0])))
    greedy_train = [0.0, -np.inf, -np.inf, -np.inf]  # greedy on token 0; the engine greedy on token 1
    both = position_drift(np.array([[engine[0, 0], engine[0, 1]], [0.0, -np.inf]]),
                          trainer_view(np.array([train[0], greedy_train]), np.array([[0, 1], [1, 2]]),
                                       np.array([0, 1])))
    assert both.kl_train_engine[1] == 0.0  # a vacuous lower bound
    summary = summarize_distribution(both, 2)
    assert summary["distribution/num_positions_infinite_kl"] == 1
    assert summary["distribution/kl_train_engine_mean"] == pytest.approx(close.kl_train_engine[0], rel=1e-12)
    assert summary["distribution/kl_engine_train_mean"] == pytest.approx(close.kl_engine_train[0], rel=1e-12)
    assert summary["distribution/tv_mean"] == pytest.approx((close.tv[0] + 1.0) / 2, rel=1e-12)


# -- 3. an empty response read back from JSON ------------------------------------------------------


def test_an_empty_response_read_back_from_json_does_not_break_the_section():
    """An empty response's top-k is [0, k] in memory but [] -> [0, 0] from JSON: concatenating it with
    the other rollouts' [n, k] raised a bare ValueError."""
    rows = _log_softmax(np.random.default_rng(0).normal(size=(3, 8)))
    ids = np.argsort(-rows, axis=1)[:, :4]
    logprobs = np.take_along_axis(rows, ids, axis=1)
    full = _rollout("a", ids, logprobs)
    empty = Rollout("b", 0, (1, 2), (), (), "stop", "x", top_k_ids=np.zeros((0, 4), np.int64),
                    top_k_logprobs=np.zeros((0, 4)))
    empty = Rollout.from_dict(json.loads(json.dumps(empty.to_dict())))
    assert empty.top_k_ids.shape == (0, 0)
    views = [trainer_view(rows, ids, ids[:, 0]),
             trainer_view(np.zeros((0, 8)), np.zeros((0, 0), np.int64), np.zeros(0, np.int64))]
    summary, section = distribution_section([empty, full], views[::-1])
    assert summary["distribution/num_positions"] == 3 and summary["distribution/top_k"] == 4
    assert summary["distribution/kl_train_engine_max"] == 0.0
    assert {w["request_id"] for w in section["worst"]} == {"a"}


def test_empty_ids_beside_non_empty_logprobs_are_a_named_error():
    """ids [] with logprobs [[-0.1]] crashed in a reshape (bare ValueError) instead of naming the shapes."""
    with pytest.raises(TopKError, match=r"top_k_ids \(0, 1\) and top_k_logprobs \(1, 1\)"):
        check_top_k([], [[-0.1]], "x", positions=1)
