"""Round 14, the numbers (parity/drift, parity/correction): figures that were silently wrong.

- A TIS cap below 1 (rollout_is_threshold=0.5) took its low-side bound as 1/0.5 = 2, above the cap:
  rollout_is_ratio_fraction_high and _low were both 1.0 for the same tokens. Now a ConfigError
  naming the field and the fix (a threshold >= 1, or an explicit rollout_is_clamp_lower).
- rollout_is_clamp_lower=inf (under rollout_is_threshold='inf') made every weight inf and the ESS NaN.
- rollout_probs_pearson of one token, or of a constant side, was 0.0 ("uncorrelated"); it is
  undefined: NaN, which the text, page and JSON renderers carry.
- The bootstraps (`bootstrap_ratio`, `summarize(bootstrap=)`) drew every resample at once:
  200 x 1M sequences held 3.2 GB. They draw in chunks past `MAX_DRAWS`, from one generator stream.
- drift_by_turn read after_injection with astype(bool) (0.3 or 2 counted as "first after an
  injection") and dropped counted tokens of turn -1 or -2 from every turn row.
- The summary's k3_kl (Δ clamped to ±20) and verl's rollout_corr/k3_kl (unclamped) differ beyond
  |Δ| = 20, by design (verl has both); the summary's docstring now says so.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import parity.drift.bootstrap as boot
import parity.drift.metrics as metrics
from parity.core.errors import ConfigError, InputError
from parity.core.schema import json_safe
from parity.correction import CorrectionConfig, correction_from_name, rollout_correction
from parity.drift.metrics import drift_by_turn, summarize
from parity.render.report_page import key_value_table
from parity.report.document import number_text


def _batch(seed: int = 0, batch: int = 6, seq: int = 8) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    rollout = np.log(rng.uniform(0.05, 1.0, (batch, seq)))
    train = np.minimum(rollout + rng.normal(0.0, 0.3, (batch, seq)), 0.0)
    mask = np.ones((batch, seq), bool)
    mask[1, 5:] = False
    return train, rollout, mask


# -- TIS cap below 1 ------------------------------------------------------------------------------

@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_a_tis_cap_below_one_is_refused_naming_the_field_and_the_fix(level: str) -> None:
    with pytest.raises(ConfigError, match=r"rollout_is_threshold=0\.5.*>= 1.*rollout_is_clamp_lower"):
        CorrectionConfig(rollout_is=level, rollout_is_threshold=0.5)
    with pytest.raises(ConfigError, match="rollout_is_threshold"):
        correction_from_name(f"{level}_tis:0.5")


def test_a_cap_below_one_with_its_own_low_bound_or_a_band_still_runs() -> None:
    train, rollout, mask = _batch()
    _, _, m = rollout_correction(train, rollout, mask, rollout_is="token", rollout_is_threshold=0.5,
                                 rollout_is_clamp_lower=0.2)
    # coherent: a token is at most one of "above the cap" and "below the low bound"
    high, low = (m[f"rollout_corr/rollout_is_ratio_fraction_{side}"] for side in ("high", "low"))
    assert high + low <= 1
    CorrectionConfig(rollout_is="token", rollout_is_threshold=1.0)
    CorrectionConfig(rollout_is="token", rollout_is_threshold="0.5_0.8")  # IcePop band below 1
    CorrectionConfig(rollout_is="seq_mask_tis", rollout_is_threshold="0.5_0.9")


def test_an_infinite_lower_clamp_is_refused() -> None:
    with pytest.raises(ConfigError, match="rollout_is_clamp_lower must be a finite number"):
        CorrectionConfig(rollout_is="token", rollout_is_threshold="inf", rollout_is_clamp_lower=math.inf)
    train, rollout, mask = _batch()  # no truncation at all stays possible
    weights, _, m = rollout_correction(train, rollout, mask, rollout_is="token", rollout_is_threshold="inf")
    assert np.isfinite(weights).all() and math.isfinite(m["rollout_corr/rollout_is_eff_sample_size"])


# -- Pearson of one token or a constant side -------------------------------------------------------

def test_pearson_of_one_token_or_a_constant_side_is_undefined() -> None:
    one = np.ones((1, 1), bool)
    assert math.isnan(summarize(np.array([[-0.5]]), np.array([[-0.7]]), one)["rollout_probs_pearson"])
    assert summarize(np.array([[-0.5]]), np.array([[-0.5]]), one)["rollout_probs_pearson"] == 1.0
    train, rollout, mask = _batch()
    constant = np.full_like(rollout, math.log(0.4))
    assert math.isnan(summarize(constant, rollout, mask)["rollout_probs_pearson"])
    assert math.isnan(summarize(np.log(np.full((2, 3), 0.4)), np.log(np.full((2, 3), 0.5)),
                                np.ones((2, 3), bool))["rollout_probs_pearson"])
    assert 0.0 < summarize(train, rollout, mask)["rollout_probs_pearson"] <= 1.0  # defined: unchanged


def test_an_undefined_pearson_renders_as_text_page_and_strict_json() -> None:
    summary = summarize(np.array([[-0.5]]), np.array([[-0.7]]), np.ones((1, 1), bool))
    assert number_text(summary["rollout_probs_pearson"]) == "nan"
    assert "<td>nan</td>" in key_value_table({"rollout_probs_pearson": summary["rollout_probs_pearson"]})
    assert json.loads(json.dumps(json_safe(summary), allow_nan=False))["rollout_probs_pearson"] == "nan"


# -- the bootstraps' memory ------------------------------------------------------------------------

def _spy(monkeypatch: pytest.MonkeyPatch, module: object) -> list[tuple[int, int]]:
    """Record (rows, width) of every chunk `module` draws."""
    calls: list[tuple[int, int]] = []
    real = boot.resample_chunks

    def spy(resamples: int, width: int):  # type: ignore[no-untyped-def]
        for rows in real(resamples, width):
            calls.append((rows, width))
            yield rows

    monkeypatch.setattr(module, "resample_chunks", spy)
    return calls


def test_bootstrap_ratio_draws_in_bounded_chunks_with_the_same_result(monkeypatch: pytest.MonkeyPatch,
                                                                      ) -> None:
    rng = np.random.default_rng(3)
    # integer sums are exact in any order: the chunked result must equal the one-shot bit for bit
    numerator = rng.integers(-50, 50, (37, 4)).astype(np.float64)
    denominator = rng.integers(0, 40, 37).astype(np.float64)
    real = [boot.bootstrap_ratio(numerator, denominator, 101, 7, 0.9, empty=e) for e in (0.0, None)]
    floats = rng.normal(size=(37, 4)), rng.uniform(1, 9, 37)
    real_floats = boot.bootstrap_ratio(*floats, 101, 7, 0.9, empty=None)
    calls = _spy(monkeypatch, boot)
    monkeypatch.setattr(boot, "MAX_DRAWS", 37 * 10)
    for want, empty in zip(real, (0.0, None)):
        got = boot.bootstrap_ratio(numerator, denominator, 101, 7, 0.9, empty=empty)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    got_floats = boot.bootstrap_ratio(*floats, 101, 7, 0.9, empty=None)
    for got, want in zip(got_floats, real_floats):  # BLAS may block a chunk's sums differently
        np.testing.assert_allclose(got, want, rtol=1e-12)
    assert len(calls) == 3 * 11 and all(rows * width <= 370 for rows, width in calls)
    assert sum(rows for rows, _ in calls[:11]) == 101


def test_summary_bootstrap_draws_in_bounded_chunks_with_the_same_result(monkeypatch: pytest.MonkeyPatch,
                                                                        ) -> None:
    train, rollout, mask = _batch(seed=5, batch=30)
    want = summarize(train, rollout, mask, bootstrap=50, seed=4)
    calls = _spy(monkeypatch, metrics)
    monkeypatch.setattr(boot, "MAX_DRAWS", 30 * 7)
    got = summarize(train, rollout, mask, bootstrap=50, seed=4)
    assert len(calls) == 8 and all(rows * width <= 210 for rows, width in calls)
    for key in metrics.BOOTSTRAP_KEYS:
        np.testing.assert_allclose(got[f"{key}_ci95"], want[f"{key}_ci95"], rtol=1e-12, atol=1e-15)


def test_the_one_shot_path_is_kept_below_the_bound() -> None:
    assert list(boot.resample_chunks(200, 10_000)) == [200]  # the usual size: unchanged, one product
    assert max(boot.resample_chunks(200, 1_000_000)) * 1_000_000 <= boot.MAX_DRAWS


# -- drift_by_turn's flags and turns ---------------------------------------------------------------

def _turn_inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    train = np.log(np.full((1, 4), 0.5))
    rollout = train - np.array([[0.1, 0.2, 0.3, 0.4]])
    return train, rollout, np.ones((1, 4), bool), np.array([[0, 0, 1, 1]])


@pytest.mark.parametrize("flags", [np.array([[0.0, 0.0, 0.3, 0.0]]), np.array([[0, 0, 2, 0]]),
                                   np.array([[0.0, 0.0, np.nan, 0.0]]), np.array([["", "", "x", ""]])])
def test_after_injection_must_be_flags(flags: np.ndarray) -> None:
    train, rollout, mask, turns = _turn_inputs()
    with pytest.raises(InputError, match="after_injection must be bool or hold only 0 and 1"):
        drift_by_turn(train, rollout, mask, turns=turns, after_injection=flags)


def test_zero_one_after_injection_reads_as_its_bools() -> None:
    train, rollout, mask, turns = _turn_inputs()
    flags = np.array([[False, False, True, False]])
    want = drift_by_turn(train, rollout, mask, turns=turns, after_injection=flags)
    for given in (flags.astype(np.int64), flags.astype(np.float32)):
        assert drift_by_turn(train, rollout, mask, turns=turns, after_injection=given) == want
    assert [r["num_tokens"] for r in want["after_injection"]] == [1, 3]


@pytest.mark.parametrize("turns", [[[0, 0, -2, 1]], [[0, -1, 1, 1]], [[0, 0, 1, 4]]])
def test_a_counted_token_needs_a_turn(turns: list[list[int]]) -> None:
    train, rollout, mask, _ = _turn_inputs()
    with pytest.raises(InputError, match=r"drift_by_turn: turns\[0, \d\] is"):
        drift_by_turn(train, rollout, mask, turns=np.array(turns), after_injection=np.zeros((1, 4), bool))


def test_injected_tokens_left_out_by_the_mask_keep_turn_minus_one() -> None:
    train, rollout, _, _ = _turn_inputs()
    mask = np.array([[True, False, True, True]])
    out = drift_by_turn(train, rollout, mask, turns=np.array([[0, -1, 1, 1]]),
                        after_injection=np.array([[False, False, True, False]]))
    assert [r["num_tokens"] for r in out["by_turn"]] == [1, 2]
    turn_tokens = sum(r["num_tokens"] for r in out["by_turn"])
    assert turn_tokens == sum(r["num_tokens"] for r in out["after_injection"])


# -- k3: the summary's and verl's --------------------------------------------------------------------

def test_the_two_k3_figures_are_documented_apart_beyond_the_clamp() -> None:
    train, rollout, mask = np.array([[-1.0, -1.0]]), np.array([[-31.0, -1.0]]), np.ones((1, 2), bool)
    summary = summarize(rollout, train, mask)  # Δ = -30 on one token
    _, _, corr = rollout_correction(rollout, train, mask, rollout_is="token")
    c = np.array([-20.0, 0.0])
    assert summary["k3_kl"] == pytest.approx(np.mean(np.exp(c) - 1 - c), rel=1e-12)  # ~9.5: clamped
    assert corr["rollout_corr/k3_kl"] == pytest.approx((np.exp(-30.0) - 1 + 30) / 2, rel=1e-12)  # 14.5
    doc = " ".join((summarize.__doc__ or "").split())
    assert "rollout_corr/k3_kl" in doc and "unclamped" in doc
