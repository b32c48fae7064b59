"""Round 5, drift and correction: numbers that were silently wrong on valid inputs.

- `rollout_probs_pearson` came from raw sums Σp², Σp·q that cancel to rounding noise where the
  probabilities barely vary (confident tokens, p ≈ 1): it read 1.41 (above 1), or 0.0 for a
  correlation of 0.9. Now centred moments merged block by block.
- `drift_by_probability` dropped a token whose rollout logprob is a hair above 0 (accepted as
  log(1) rounded, `MAX_LOGPROB`) from every default bucket: exp of it is above 1.
- `router_agreement` of routes with no MoE layer or an empty top-k set compared nothing and said
  1.0 (or NaN beside an "any diff" of 0.0).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from parity.core.errors import InputError, ParityError
from parity.core.logprobs import MAX_LOGPROB
from parity.drift.metrics import drift_by_probability, summarize
from parity.drift.routes import router_agreement
from parity.drift.token_arrays import BLOCK_TOKENS


def _confident(rng: np.random.Generator, shape: tuple[int, int], spread: float
               ) -> tuple[np.ndarray, np.ndarray]:
    """Probabilities within `spread` of 1 on both sides, correlated (~0.9)."""
    p_train = 1.0 - np.abs(rng.normal(0.0, spread, shape))
    p_rollout = np.clip(p_train + rng.normal(0.0, spread / 3, shape), 0.0, 1.0)
    return p_train, p_rollout


@pytest.mark.parametrize(("tokens", "spread"), [(1000, 1e-8), (100_000, 1e-7), (100_000, 1e-6)])
def test_pearson_of_confident_tokens_is_their_correlation(tokens: int, spread: float) -> None:
    rng = np.random.default_rng(1)
    p_train, p_rollout = _confident(rng, (1, tokens), spread)
    got = summarize(np.log(p_train), np.log(p_rollout), np.ones((1, tokens), bool))["rollout_probs_pearson"]
    want = np.corrcoef(p_train[0], p_rollout[0])[0, 1]
    assert -1.0 <= got <= 1.0  # was 1.41 and 1.29 for the first two
    assert math.isclose(got, want, rel_tol=1e-6)


def test_pearson_merges_padded_blocks_exactly() -> None:
    """Several row blocks with ragged padding: ordinary and confident probabilities alike."""
    rng = np.random.default_rng(3)
    batch, seq = 40, 4000
    assert batch * seq > 2 * BLOCK_TOKENS
    lengths = rng.integers(0, seq + 1, batch)
    lengths[0] = seq
    mask = np.arange(seq)[None, :] < lengths[:, None]
    rollout = np.log(rng.beta(0.5, 0.3, (batch, seq)).clip(1e-9, 1.0))
    train = np.minimum(rollout + rng.normal(0.0, 0.2, (batch, seq)), 0.0)
    for t, r in ((train, rollout), tuple(np.log(x) for x in _confident(rng, (batch, seq), 1e-8))):
        got = summarize(t, r, mask)["rollout_probs_pearson"]
        want = np.corrcoef(np.exp(t[mask]), np.exp(r[mask]))[0, 1]
        assert math.isclose(got, want, rel_tol=1e-9), (got, want)  # confident: was 0.0 for 0.90


def test_pearson_keeps_its_documented_edge_values() -> None:
    rng = np.random.default_rng(0)
    rollout = np.log(rng.uniform(0.29, 0.31, (2, 500)))
    mask = np.ones_like(rollout, bool)
    assert summarize(rollout, rollout, mask)["rollout_probs_pearson"] == 1.0
    constant = np.full_like(rollout, math.log(0.3))  # one side constant: undefined (NaN), not noise
    assert math.isnan(summarize(constant, rollout, mask)["rollout_probs_pearson"])
    assert math.isnan(summarize(rollout, constant, mask)["rollout_probs_pearson"])


def test_a_logprob_a_hair_above_zero_is_in_the_top_probability_bucket() -> None:
    rollout = np.array([[MAX_LOGPROB / 2, -0.5, -2.0, 0.0]])
    train = np.array([[-0.3, -0.49, -1.98, -0.2]])
    mask = np.ones_like(rollout, bool)
    rows = drift_by_probability(train, rollout, mask)
    assert sum(r["num_tokens"] for r in rows) == summarize(train, rollout, mask)["num_tokens"] == 4
    top = rows[-1]
    assert (top["lo"], top["hi"], top["num_tokens"]) == (0.99, 1.0, 2)  # was 1: the token vanished
    assert top["max_abs_logprob_diff"] == pytest.approx(0.3 + MAX_LOGPROB / 2)


@pytest.mark.parametrize("shape", [(5, 3, 0), (5, 0, 2)])
def test_routes_with_nothing_to_compare_are_refused_not_full_agreement(shape) -> None:
    a, b = np.zeros(shape, np.int32), np.ones(shape, np.int32)
    with pytest.raises(InputError, match=r"reference\[0\].*MoE layer.*top_k") as info:
        router_agreement([a], [b])
    assert isinstance(info.value, ParityError)
    ok = np.tile(np.array([0, 1], np.int32), (5, 3, 1))  # a top-2 row names two distinct experts
    assert router_agreement([ok], [ok])["router_agreement"] == 1.0


def test_a_rejected_token_keeps_its_weight_as_in_verl_and_leaves_the_mask() -> None:
    """The docstring said 0 at rejections; verl (and parity, tests/data/verl_vectors) keep the weight
    and drop the token from the mask: the weights are used with `new_mask`."""
    from parity.correction import rollout_correction

    rollout = np.array([[-0.5, -2.0, -2.0]])
    train = rollout + np.array([[0.0, 1.5, 0.1]])  # the middle token's ratio e^1.5 leaves [0.5, 2]
    weights, new_mask, _ = rollout_correction(train, rollout, np.ones((1, 3), bool), rollout_is="token",
                                              rollout_is_threshold=2.0, rollout_rs="token_k1",
                                              rollout_rs_threshold="0.5_2.0")
    np.testing.assert_array_equal(new_mask, [[True, False, True]])
    np.testing.assert_allclose(weights, [[1.0, 2.0, math.exp(0.1)]])
