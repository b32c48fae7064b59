"""Round 9, the numbers themselves: drift quantiles, bootstrap intervals and their seeds.

- `summarize` (and so the monitor's step and the report) raised IndexError on a batch whose strided
  quantile sample held only padding (8192 x 8, column 0 masked: the stride of 8 reads column 0 alone).
- A bootstrap over one sequence resamples that sequence: `summarize(..., bootstrap=N)`, `bootstrap_ci`
  and the advisor's bias interval (`bootstrap_ratio`) printed [x, x], a certainty one sequence cannot
  give; the gold ratio already says NaN there.
- A bootstrap seed of -1 or 1.5 raised NumPy's ValueError / TypeError naming no option; None drew a
  different interval on every call.
- `position_drift` read a finite trainer logprob of s_1 whose exp underflows (-800) as no mass: an
  infinite KL(engine || train), kept out of the KL means, where -700 gave a finite 679.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from parity.core.errors import ConfigError
from parity.drift.bootstrap import bootstrap_ratio
from parity.drift.distribution import position_drift, summarize_distribution, trainer_view
from parity.drift.metrics import BOOTSTRAP_KEYS, bootstrap_ci, summarize

QUANTILE_KEYS = ("is_ratio_min", "is_ratio_p01", "is_ratio_p99", "is_ratio_max")


def _batch(rows: int, seq: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    train = -np.abs(rng.normal(1.0, 0.5, (rows, seq)))
    rollout = np.minimum(train + rng.normal(0.0, 0.05, (rows, seq)), 0.0)
    return train, rollout


# -- 1. quantiles of a batch whose strided sample is all padding ---------------------------------------


def test_quantiles_when_every_sampled_slot_is_padding() -> None:
    train, rollout = _batch(8192, 8)
    mask = np.ones(train.shape, bool)
    mask[:, 0] = False  # 57344 valid tokens; the sample's stride of 8 reads column 0 only
    summary = summarize(train, rollout, mask)
    want = np.quantile(np.exp(np.clip((train - rollout)[mask], -20, 20)), [0.0, 0.01, 0.99, 1.0])
    assert [summary[k] for k in QUANTILE_KEYS] == pytest.approx(want, rel=1e-12)


# -- 2. a bootstrap over one sequence ------------------------------------------------------------------


def test_summarize_bootstrap_of_one_sequence_is_nan_not_a_certainty() -> None:
    train, rollout = _batch(1, 64)
    mask = np.ones(train.shape, bool)
    summary = summarize(train, rollout, mask, bootstrap=50)
    for key in BOOTSTRAP_KEYS:
        low, high = summary[f"{key}_ci95"]
        assert math.isnan(low) and math.isnan(high), key
    # empty rows beside the one sequence are not sequences
    padded = np.zeros((3, 64), bool)
    padded[1] = True
    train3, rollout3 = _batch(3, 64)
    assert all(math.isnan(v) for v in bootstrap_ci(train3, rollout3, padded, n_resamples=20)["k3_kl"])


def test_two_sequences_still_give_an_interval() -> None:
    train, rollout = _batch(2, 64)
    low, high = summarize(train, rollout, np.ones(train.shape, bool), bootstrap=200)["k1_kl_ci95"]
    assert math.isfinite(low) and math.isfinite(high) and low < high


def test_bootstrap_ratio_of_one_sequence_is_nan() -> None:
    for numerator, denominator in ((np.array([[3.0]]), np.array([2.0])),
                                   (np.array([[3.0], [0.0]]), np.array([2.0, 0.0]))):  # + an empty one
        low, high = bootstrap_ratio(numerator, denominator, 100, 0, 0.95, empty=None)
        assert np.isnan(low).all() and np.isnan(high).all()
    low, high = bootstrap_ratio(np.array([[3.0], [1.0]]), np.array([2.0, 2.0]), 200, 0, 0.95, empty=None)
    assert low[0] < high[0]


# -- 3. the bootstrap's seed ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [-1, 1.5, "0", None, True])
def test_a_bad_bootstrap_seed_is_a_config_error(seed: object) -> None:
    train, rollout = _batch(4, 8)
    mask = np.ones(train.shape, bool)
    with pytest.raises(ConfigError, match="seed"):
        summarize(train, rollout, mask, bootstrap=5, seed=seed)
    with pytest.raises(ConfigError, match="seed"):
        bootstrap_ci(train, rollout, mask, n_resamples=5, seed=seed)


def test_integer_seeds_still_work_and_an_unused_seed_is_not_checked() -> None:
    train, rollout = _batch(4, 8)
    mask = np.ones(train.shape, bool)
    a = summarize(train, rollout, mask, bootstrap=20, seed=np.int64(3))
    assert a == summarize(train, rollout, mask, bootstrap=20, seed=3)
    assert "k3_kl_ci95" not in summarize(train, rollout, mask, seed=None)  # no bootstrap: no seed used


# -- 4. a finite trainer logprob whose probability underflows -----------------------------------------


@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_a_finite_logprob_that_underflows_is_a_finite_kl_not_infinite(precision: str) -> None:
    """The trainer gives the engine's top token -800 nats: exp underflows to 0, and KL(engine || train)
    read inf, counted as 'infinite' and kept out of the KL means, though -700 gave a finite 679."""
    engine = np.log(np.array([0.97, 0.01, 0.01, 0.01]))
    ids = np.array([[0, 1]])
    got = {}
    for top in (-700.0, -800.0):
        trainer = np.array([top, math.log(0.5), math.log(0.25), math.log(0.25)])
        view = trainer_view(trainer[None], ids, np.array([0]))
        drift = position_drift(engine[ids].astype(precision), view, precision=precision)
        got[top] = float(drift.kl_engine_train[0])
        assert summarize_distribution(drift, 2)["distribution/num_positions_infinite_kl"] == 0
    # q_0 (a_0 - b_0) + q_1 (a_1 - b_1) + q_T log(q_T / p_T), the tails 0.02 and 0.5
    for top, value in got.items():
        want = 0.97 * (math.log(0.97) - top) + 0.01 * (math.log(0.01) - math.log(0.5)) \
            + 0.02 * math.log(0.02 / 0.5)
        assert value == pytest.approx(want, rel=1e-6)


def test_an_underflowing_logprob_beside_a_merged_tail_keeps_its_mass() -> None:
    """The trainer's top-k holds all its mass (tail merged into s_1) and gives s_1 a subnormal or zero
    probability: the merged bucket's log mass is log(p_0 + p_T), not log1p of an overflowing quotient."""
    engine = np.array([math.log(0.6), math.log(0.4)])
    for top in (-740.0, -800.0):
        trainer = np.array([top, 0.0])  # all the trainer's mass on s_2: p_T = 0
        view = trainer_view(trainer[None], np.array([[0, 1]]), np.array([0]))
        drift = position_drift(engine[None], view, precision="float64")
        want = 0.6 * (math.log(0.6) - top) + 0.4 * math.log(0.4)
        assert float(drift.kl_engine_train[0]) == pytest.approx(want, rel=1e-9)
