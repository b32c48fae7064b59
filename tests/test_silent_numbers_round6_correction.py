"""Round 6, rollout correction and the gold assessment: numbers that were silently wrong.

- The effective sample size kept verl's `E[w] + 1e-8`: with sequence weights ~2e-9 it read 34 (an
  ESS is a fraction in (0, 1]); below a mean weight of 1e-4 it is now the exact E[w]² / E[w²].
- float16 / bfloat16 logprobs had their IS weights stored in their own dtype before the batch
  normalization: float16 subnormals turned sequence weights 0.876 and 1.124 into 0.765 and 0.765,
  and a weight above 65504 came back inf. Weights are now computed in float32 and cast at the end;
  one that does not fit is an InputError.
- `correction_from_name` read a band through float(), which takes "_" as a digit separator:
  "token_tis:0.5_2" truncated at 0.52, "seq_mean_k1:1_2" kept ratios in [1/12, 12], and the
  documented "icepop:0.5_2" was refused. A band with two "_" ("0.5_2_0") read as [0.5, 20].
- The gold figures counted a NaN or +inf gold (or train / rollout) logprob as "outside the sampling
  support" and a positive gold as a logprob.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from parity.assess.accuracy import gold_summary
from parity.core.errors import ConfigError, InputError
from parity.correction import CorrectionConfig, correction_from_name, rollout_correction

ESS = "rollout_corr/rollout_is_eff_sample_size"


# -- effective sample size ---------------------------------------------------------------------------

def test_the_ess_of_tiny_sequence_weights_is_a_fraction() -> None:
    train, rollout = np.full((2, 3), -20.0), np.full((2, 3), -5.0)  # Σ Δ = -45: weight e^-20 each
    _, _, metrics = rollout_correction(train, rollout, np.ones((2, 3), bool), rollout_is="sequence")
    assert metrics[ESS] == pytest.approx(1.0, rel=1e-12)  # equal weights: every sample counts (was 34.2)


def test_the_ess_of_small_geometric_weights_is_exact() -> None:
    train, rollout = np.full((2, 3), -20.0), np.full((2, 3), -5.0)
    train[1] = -19.0
    weights, _, metrics = rollout_correction(train, rollout, np.ones((2, 3), bool), rollout_is="geometric")
    w = weights[:, 0]
    assert metrics[ESS] == pytest.approx(w.mean() ** 2 / (w ** 2).mean(), rel=1e-12)  # 0.824 (was 0.853)


def test_the_ess_of_ordinary_weights_is_still_verl_s() -> None:
    rollout = np.log(np.linspace(0.1, 0.9, 12)).reshape(3, 4) - 0.4  # train = rollout + 0.4 stays <= 0
    train = rollout + np.linspace(-0.4, 0.4, 12).reshape(3, 4)
    weights, _, metrics = rollout_correction(train, rollout, np.ones((3, 4), bool), rollout_is="token")
    mean = weights.mean()
    assert metrics[ESS] == pytest.approx(1.0 / np.mean((weights / (mean + 1e-8)) ** 2), rel=1e-12)


# -- half-precision weights --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_batch_normalized_half_precision_weights_are_the_exact_ones_rounded_once(dtype) -> None:
    train = torch.tensor([[-8.0, -8.5], [-8.25, -8.0]])  # sequence weights ~6e-8 and ~8e-8
    rollout, mask = torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool)
    options = {"rollout_is": "sequence", "rollout_is_batch_normalize": True}
    want, _, _ = rollout_correction(train.double(), rollout.double(), mask, **options)
    got, _, _ = rollout_correction(train.to(dtype), rollout.to(dtype), mask, **options)
    assert got.dtype == dtype
    # float16 gave 0.765 and 0.765 for 0.876 and 1.124; bfloat16 0.879 for 0.876 (rounded twice)
    torch.testing.assert_close(got, want.to(dtype), rtol=0.0, atol=0.0)


def test_a_float16_weight_above_its_range_is_refused_not_inf() -> None:
    train = torch.tensor([[-0.1, -0.1]], dtype=torch.float16)
    rollout = torch.tensor([[-15.0, -0.1]], dtype=torch.float16)  # ratio e^14.9 ≈ 2.9e6
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(InputError, match=r"float16.*65504.*float32"):
        rollout_correction(train, rollout, mask, rollout_is="token", rollout_is_threshold=1e6)
    weights, _, _ = rollout_correction(train.float(), rollout.float(), mask, rollout_is="token",
                                       rollout_is_threshold=1e6)
    assert weights[0, 0] == pytest.approx(1e6)
    # what fits float16 comes back in float16, the metrics computed in float64 as before
    weights, _, metrics = rollout_correction(train, rollout, mask, rollout_is="token")
    assert weights.dtype == torch.float16 and weights.tolist() == [[2.0, 1.0]]
    assert metrics["rollout_corr/rollout_is_max"] == 2.0


# -- correction names and bands -----------------------------------------------------------------------

def test_the_documented_icepop_band_is_a_band() -> None:
    rule = correction_from_name("icepop:0.5_2").is_rule  # was refused: float("0.5_2") is 0.52
    assert (rule.band_lower, rule.upper) == (0.5, 2.0)


def test_a_truncation_name_with_a_band_is_refused_not_read_as_a_number() -> None:
    for name in ("token_tis:0.5_2", "sequence_tis:0.5_2"):  # was TIS truncating at 0.52
        with pytest.raises(ConfigError, match=r"one upper bound.*icepop:0\.5_2"):
            correction_from_name(name)
    assert correction_from_name("token_tis:3").is_rule.upper == 3.0


def test_a_k1_band_in_a_name_keeps_its_two_bounds() -> None:
    [rule] = correction_from_name("seq_mean_k1:1_2").rs_rules  # was [1/12, 12]
    assert (rule.lower, rule.upper) == (0.0, pytest.approx(math.log(2.0)))


@pytest.mark.parametrize("options", [
    {"rollout_is": "token", "rollout_is_threshold": "0.5_2_0"},
    {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_2_0"},
])
def test_a_band_with_two_underscores_is_refused(options) -> None:
    with pytest.raises(ConfigError, match=r"0\.5_2_0"):  # was the band [0.5, 20]
        CorrectionConfig(**options)


# -- gold ---------------------------------------------------------------------------------------------

def _sides() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    train = np.array([[-1.0, -2.0, -0.5, 0.0]])
    rollout = np.array([[-1.1, -2.0, -0.4, 0.0]])
    gold = np.array([[-1.0, -2.05, -0.45, 0.0]])
    return train, rollout, gold, np.array([[True, True, True, False]])


@pytest.mark.parametrize("side", [0, 1, 2])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_nan_or_inf_logprob_is_not_counted_outside_the_support(side: int, value: float) -> None:
    arrays = list(_sides())
    arrays[side][0, 1] = value
    with pytest.raises(InputError, match=r"\[0, 1\] is (nan|inf)"):  # was num_tokens_outside_support 1
        gold_summary(*arrays, bootstrap=0)


def test_a_positive_gold_is_refused_and_padding_and_minus_inf_still_pass() -> None:
    train, rollout, gold, mask = _sides()
    bad = gold.copy()
    bad[0, 0] = 3.0
    with pytest.raises(InputError, match=r"gold logprob\[0, 0\] is 3\.0"):
        gold_summary(train, rollout, bad, mask, bootstrap=0)
    gold[0, 3] = math.nan  # padding may hold anything
    gold[0, 2] = -math.inf  # outside the gold's support: left out and counted
    summary = gold_summary(train, rollout, gold, mask, bootstrap=0)
    assert summary["gold/num_tokens"] == 2 and summary["gold/num_tokens_outside_support"] == 1
    assert summary["gold/train_mean_abs_logprob_diff"] == pytest.approx(0.025)
