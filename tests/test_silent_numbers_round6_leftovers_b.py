"""No silent wrong numbers, round 6 leftovers (b): leads other reviewers found in routes, the correction
options, the advisor's reason and the nightly trend footnote. Each input below was accepted on the old
code and gave a number that was not what it seemed (one expert handed a whole gate weight in R3, a batch
normalization never applied, a nonzero share printed as 0.00%), or a valid NumPy threshold was refused.
No engine starts.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from parity.advisor.evaluate import FIGURES, Drift, Evaluation
from parity.advisor.grid import Candidate
from parity.advisor.rule import AdviceRule, choose_removal, choose_reweighting, noise_clause
from parity.core.errors import ConfigError, InputError
from parity.correction.config import CorrectionConfig
from parity.drift.routes import check_routes
from parity.nightly.charts import trend_charts

# -- 1. a row of recorded routes is top_k distinct experts -------------------------------------------


def test_repeated_expert_in_a_route_row_is_refused_naming_its_position_and_layer():
    """R3 forcing renormalizes the picked probabilities: [6, 6] would give expert 6 weight 0.5 + 0.5 = 1.0,
    which no real top-2 does."""
    routes = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 6]], [[1, 0], [3, 2]]])  # position 1, layer 1: [6, 6]
    with pytest.raises(InputError, match=r"position 1, MoE layer 1 .*\[6, 6\].*distinct"):
        check_routes(routes, positions=3, moe_layers=2, top_k=2, num_experts=8, where="seq")


def test_distinct_experts_in_any_order_still_pass():
    routes = np.array([[[7, 0, 3]], [[3, 0, 7]]], np.uint8)  # vLLM's narrow dtype, unsorted rows
    out = check_routes(routes, positions=2, moe_layers=1, top_k=3, num_experts=8)
    assert out.dtype == np.int32 and out.tolist() == [[[7, 0, 3]], [[3, 0, 7]]]


# -- 2. correction options: a batch normalization of no weights; NumPy numbers ----------------------


def test_batch_normalize_without_importance_sampling_is_refused_naming_both_fields():
    with pytest.raises(ConfigError, match=r"rollout_is_batch_normalize=True.*rollout_is=None"):
        CorrectionConfig(rollout_is=None, rollout_is_batch_normalize=True)
    with pytest.raises(ConfigError, match="rollout_is_batch_normalize"):
        CorrectionConfig(rollout_is=None, rollout_is_batch_normalize=True, rollout_rs="token_k1",
                         rollout_rs_threshold=2.0)
    assert CorrectionConfig(rollout_is="token", rollout_is_batch_normalize=True).is_rule.batch_normalize
    assert CorrectionConfig(rollout_is=None, rollout_is_batch_normalize=False).is_rule is None


@pytest.mark.parametrize("value", [np.float32(2.0), np.int64(2), np.float64(2.0), np.int32(2)])
def test_numpy_scalar_thresholds_are_numbers(value):
    config = CorrectionConfig(rollout_is="token", rollout_is_threshold=value,
                              rollout_is_clamp_lower=value / 4,
                              rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold=value)
    assert config.is_rule.upper == 2.0 and config.is_rule.clamp_lower == 0.5
    assert [r.upper for r in config.rs_rules] == [pytest.approx(np.log(2.0)), 2.0]
    # stored as plain Python numbers: a monitor record or an exported config writes 2.0, not np.float32(2.0)
    assert type(config.rollout_is_threshold) in (int, float)
    assert type(config.rollout_rs_threshold) in (int, float)
    assert type(config.rollout_is_clamp_lower) is float
    assert json.loads(json.dumps({"t": config.rollout_is_threshold})) == {"t": 2}
    assert "np." not in repr(config)


@pytest.mark.parametrize("bad", [True, np.bool_(True), [2.0], b"2"])
def test_bools_and_non_numbers_are_still_refused_as_thresholds(bad):
    with pytest.raises(ConfigError, match="rollout_is_threshold must be a number"):
        CorrectionConfig(rollout_is="token", rollout_is_threshold=bad)
    with pytest.raises(ConfigError, match="rollout_rs_threshold must be a number"):
        CorrectionConfig(rollout_rs="token_k3", rollout_rs_threshold=bad)
    with pytest.raises(ConfigError, match=r"rollout_is_clamp_lower must be a (finite )?number"):
        CorrectionConfig(rollout_is="token", rollout_is_clamp_lower=bad)


# -- 3. the advisor's reason never prints a nonzero share as 0 ---------------------------------------


def _evaluation(drift: Drift, **figures: list[float]) -> Evaluation:
    cands = (Candidate("token_rs", CorrectionConfig(rollout_rs="token_k1", rollout_rs_threshold=2.0)),
             Candidate("token_tis", CorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)))
    fig = {k: np.zeros(2) for k in FIGURES}
    fig["ess"][:], fig["max_weight"][:] = 1.0, 1.0
    for name, values in figures.items():
        fig[name][:] = values
    return Evaluation(cands, fig, drift, 0)


def test_removal_reason_prints_a_tiny_removed_share_as_below_the_last_digit():
    ev = _evaluation(Drift(1.0, 0.5, 0.1, 100_000, 5_000), drift_removed=[0.9, 0.0],
                     frac_tokens_removed=[3e-5, 0.0], frac_seqs_removed=[2e-4, 0.0])
    clause = choose_removal(ev, AdviceRule()).clause
    assert "(<0.01% of tokens, <0.1% of sequences)" in clause and "0.00%" not in clause
    assert clause.startswith("90.0% of the mismatch")


def test_reweighting_reasons_print_a_tiny_truncated_mass_as_below_the_last_digit():
    drift = Drift(1.0, 0.5, 0.1, 100_000, 5_000)
    light = choose_reweighting(_evaluation(drift, mass_removed=[0.0, 2e-6]), AdviceRule()).clause
    assert "(<0.001%, ESS" in light and "0.000%" not in light
    least = choose_reweighting(_evaluation(drift, mass_removed=[0.0, 3e-5]),
                               AdviceRule(max_mass_removed=1e-6))
    assert "(<0.01%) of the corrections" in least.clause and "at most" not in least.clause


def test_noise_reason_prints_a_tiny_ratio_spread_as_below_the_last_digit():
    ev = _evaluation(Drift(0.01, 1e-10, 0.0, 100, 5))
    clause = noise_clause(ev, AdviceRule(noise_ratio_var=1e-12))
    assert "vary by <0.01% RMS" in clause and "bounds <0.01% and" in clause and "0.00%" not in clause


# -- 4. the trend footnote says what else is left out ------------------------------------------------


def test_trend_footnote_says_points_of_an_earlier_workload_are_left_out():
    page = trend_charts([], [])
    assert "error rows are omitted" in page
    assert "before its workload last changed" in page and "case, model or LoRA adapter" in page
