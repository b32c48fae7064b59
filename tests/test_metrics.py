"""parity.drift.metrics: the summary against a plain NumPy reference, breakdowns, bootstrap, errors,
properties."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import batches

from parity.core.errors import ConfigError, InputError
from parity.drift.metrics import (
    BOOTSTRAP_KEYS,
    SUMMARY_KEYS,
    bootstrap_ci,
    drift_by_position,
    drift_by_probability,
    summarize,
    token_arrays,
)
from parity.drift.quantiles import QuantilePass, interpolate, order_statistics, quantile_ranks


def _reference(train: np.ndarray, rollout: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """The summary written the obvious way, token by token, in float64."""
    d = (train - rollout)[mask]
    c = np.clip(d, -20.0, 20.0)
    r = np.exp(c)
    rows = mask.any(-1)
    seq = np.clip(np.where(mask, train - rollout, 0.0).sum(-1)[rows], -20.0, 20.0)
    pt, pr = np.exp(train[mask]), np.exp(rollout[mask])
    return {
        "max_abs_logprob_diff": np.abs(d).max(),
        "mean_abs_logprob_diff": np.abs(d).mean(),
        "is_ratio_mean": r.mean(),
        "is_ratio_std": r.std(),
        "is_ratio_min": r.min(),
        "is_ratio_max": r.max(),
        "is_ratio_p01": np.quantile(r, 0.01),
        "is_ratio_p99": np.quantile(r, 0.99),
        "seq_is_ratio_mean": np.exp(seq).mean(),
        "k1_kl": (-d).mean(),
        "k2_kl": (0.5 * d**2).mean(),
        "k3_kl": (r - 1 - c).mean(),
        "chi2_token": (r**2).mean() - 1,
        "rollout_probs_diff_max": np.abs(pt - pr).max(),
        "rollout_probs_diff_mean": np.abs(pt - pr).mean(),
        "rollout_probs_pearson": np.corrcoef(pt, pr)[0, 1],
        "token_mult_prob_error": np.exp(np.abs(c)).mean(),
        "frac_tokens_ratio_gt_2": (np.maximum(r, 1 / r) > 2).mean(),
        "num_tokens": d.size,
        "num_sequences": int(rows.sum()),
    }


def _example(seed: int = 0, batch: int = 7, seq: int = 40) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    rollout = np.log(rng.beta(0.5, 0.3, size=(batch, seq)).clip(1e-9, 1.0))
    train = np.minimum(rollout + rng.normal(0.0, 0.2, size=(batch, seq)), 0.0)
    train[0, 3] = rollout[0, 3] - 25.0  # beyond the ±20 clamp
    lengths = rng.integers(1, seq + 1, size=batch)
    lengths[2] = 0
    mask = np.arange(seq)[None, :] < lengths[:, None]
    return train, rollout, mask


def test_summary_matches_reference() -> None:
    train, rollout, mask = _example()
    summary = summarize(train, rollout, mask)
    assert tuple(summary) == SUMMARY_KEYS
    ref = _reference(train, rollout, mask)
    for key in SUMMARY_KEYS:
        assert summary[key] == pytest.approx(ref[key], rel=1e-9, abs=1e-12), key
    assert isinstance(summary["num_tokens"], int) and isinstance(summary["num_sequences"], int)
    assert all(type(summary[k]) is float for k in SUMMARY_KEYS if not k.startswith("num_"))
    json.dumps(summary, allow_nan=False)


def test_summary_accepts_torch_and_float32() -> None:
    train, rollout, mask = _example(1)
    from_numpy = summarize(train, rollout, mask)
    from_torch = summarize(torch.from_numpy(train), torch.from_numpy(rollout), torch.from_numpy(mask).int())
    assert from_torch == from_numpy
    from_f32 = summarize(train.astype(np.float32), rollout.astype(np.float32), mask)
    assert from_f32["num_tokens"] == from_numpy["num_tokens"]


def test_read_only_arrays_are_accepted_silently() -> None:
    train, rollout, mask = _example(4)
    ref = summarize(train, rollout, mask)
    for x in (train, rollout, mask):
        x.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert summarize(train, rollout, mask) == ref


def test_neg_inf_padding_is_fine() -> None:
    train, rollout, mask = _example(2)
    ref = summarize(train, rollout, mask)
    assert summarize(np.where(mask, train, -np.inf), np.where(mask, rollout, -np.inf), mask) == ref


def test_checked_token_arrays_stand_in_for_the_three_arrays() -> None:
    """One `token_arrays` check serves every metric of a batch, with the same results."""
    from parity.correction import rollout_correction

    train, rollout, mask = _example(5)
    int_mask = mask.astype(np.int8)
    tok = token_arrays(train, rollout, int_mask)
    assert summarize(tok, bootstrap=20) == summarize(train, rollout, mask, bootstrap=20)
    assert bootstrap_ci(tok, n_resamples=20) == bootstrap_ci(train, rollout, mask, n_resamples=20)
    assert drift_by_position(tok) == drift_by_position(train, rollout, mask)
    assert drift_by_probability(tok) == drift_by_probability(train, rollout, mask)
    options = {"rollout_is": "token", "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01}
    weights, new_mask, metrics = rollout_correction(tok, **options)
    want_weights, want_mask, want_metrics = rollout_correction(train, rollout, int_mask, **options)
    assert metrics == want_metrics
    assert isinstance(weights, np.ndarray) and weights.dtype == np.float64
    np.testing.assert_array_equal(weights, want_weights)
    assert new_mask.dtype == np.int8
    np.testing.assert_array_equal(new_mask, want_mask)
    with pytest.raises(InputError, match="TokenArrays alone"):
        summarize(tok, rollout, mask)


def test_bootstrap_intervals() -> None:
    train, rollout, mask = _example(3, batch=30)
    summary = summarize(train, rollout, mask, bootstrap=200, seed=5)
    assert summary == summarize(train, rollout, mask, bootstrap=200, seed=5)
    for key in BOOTSTRAP_KEYS:
        low, high = summary[f"{key}_ci95"]
        assert low <= summary[key] <= high, key
    ci = bootstrap_ci(train, rollout, mask, n_resamples=200, seed=5)
    assert ci["k3_kl"] == tuple(summary["k3_kl_ci95"])
    narrow = bootstrap_ci(train, rollout, mask, n_resamples=200, confidence=0.5, seed=5)
    assert narrow["k3_kl"][1] - narrow["k3_kl"][0] < ci["k3_kl"][1] - ci["k3_kl"][0]
    json.dumps(summary, allow_nan=False)


def test_drift_by_position() -> None:
    train = np.array([[-1.0, -1.0, -2.0, -3.0], [-1.0, -0.5, -1.0, -9.0]])
    rollout = np.array([[-1.5, -1.0, -1.0, -3.0], [-1.0, -1.0, -1.0, -1.0]])
    mask = np.array([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=bool)
    rows = drift_by_position(train, rollout, mask)
    assert [(r["lo"], r["hi"], r["num_tokens"]) for r in rows] == [(0, 1, 2), (1, 2, 2), (2, 4, 3)]
    assert rows[0]["mean_abs_logprob_diff"] == pytest.approx(0.25)
    assert rows[0]["mean_log_ratio"] == pytest.approx(0.25)
    assert rows[1]["max_abs_logprob_diff"] == pytest.approx(0.5)
    assert rows[2]["max_abs_logprob_diff"] == pytest.approx(1.0)
    assert rows[2]["mean_log_ratio"] == pytest.approx(-1.0 / 3)
    custom = drift_by_position(train, rollout, mask, edges=[1, 3])
    assert [(r["lo"], r["hi"], r["num_tokens"]) for r in custom] == [(1, 3, 4)]
    json.dumps(rows, allow_nan=False)


def test_drift_by_probability() -> None:
    rollout = np.log(np.array([[0.00005, 0.3, 0.95, 1.0]]))
    train = rollout + np.array([[0.4, -0.1, 0.0, 0.0]])
    rows = drift_by_probability(train, rollout, np.ones((1, 4), bool))
    by_lo = {r["lo"]: r for r in rows}
    assert by_lo[0.0]["num_tokens"] == 1 and by_lo[0.0]["mean_abs_logprob_diff"] == pytest.approx(0.4)
    assert by_lo[0.1]["num_tokens"] == 1 and by_lo[0.1]["mean_log_ratio"] == pytest.approx(-0.1)
    assert by_lo[0.99]["num_tokens"] == 1  # p = 1.0 lands in the last bucket, which includes hi
    assert by_lo[0.9]["num_tokens"] == 1
    assert by_lo[1e-3]["num_tokens"] == 0 and by_lo[1e-3]["mean_abs_logprob_diff"] is None
    assert sum(r["num_tokens"] for r in rows) == 4
    json.dumps(rows, allow_nan=False)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda t, r, m: drift_by_position(t, r, m, edges=[0, 0, 3]), "strictly increasing"),
        (lambda t, r, m: drift_by_position(t, r, m, edges=[0, 1.5]), "integers"),
        (lambda t, r, m: drift_by_position(t, r, m, edges=[0, 10_000]), "within"),
        (lambda t, r, m: drift_by_probability(t, r, m, edges=[0.5]), "at least 2"),
        (lambda t, r, m: drift_by_probability(t, r, m, edges=[-1.0, 0.5]), "within"),
        (lambda t, r, m: summarize(t, r, m, bootstrap=-1), "bootstrap"),
        (lambda t, r, m: bootstrap_ci(t, r, m, n_resamples=0), "n_resamples"),
        (lambda t, r, m: bootstrap_ci(t, r, m, confidence=1.0), "confidence"),
    ],
)
def test_bad_options_raise_config_error(call, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        call(*_example())


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda t, r, m: (t, r[:, 1:], m), "same"),
        (lambda t, r, m: (np.where(m, np.nan, t), r, m), "NaN"),
        (lambda t, r, m: (t, np.full_like(r, np.inf), m), r"\+inf"),
        (lambda t, r, m: (t, np.where(m, -np.inf, r), m), "-inf at a valid"),
        (lambda t, r, m: (t, r, np.zeros_like(m)), "no valid token"),
        (lambda t, r, m: (t, r, m.astype(float) * 0.5), "0 and 1"),
    ],
)
def test_bad_inputs_raise_input_error(mutate, match: str) -> None:
    for fn in (summarize, drift_by_position, drift_by_probability, bootstrap_ci):
        with pytest.raises(InputError, match=match):
            fn(*mutate(*_example()))


# ---------------------------------------------------------------------------------------------
# Properties.


def _same(a: dict, b: dict, rel: float = 1e-12) -> bool:
    return a.keys() == b.keys() and all(math.isclose(a[k], b[k], rel_tol=rel, abs_tol=1e-12)
                                        or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


@given(batches())
def test_identical_inputs_are_exactly_on_policy(data) -> None:
    _, rollout, mask = data
    s = summarize(rollout, rollout, mask)
    for key in ("is_ratio_mean", "is_ratio_min", "is_ratio_max", "is_ratio_p01", "is_ratio_p99",
                "seq_is_ratio_mean", "token_mult_prob_error", "rollout_probs_pearson"):
        assert s[key] == 1.0, key
    for key in ("max_abs_logprob_diff", "mean_abs_logprob_diff", "is_ratio_std", "k1_kl", "k2_kl", "k3_kl",
                "chi2_token", "rollout_probs_diff_max", "rollout_probs_diff_mean", "frac_tokens_ratio_gt_2"):
        assert s[key] == 0.0, key


@given(batches(), st.integers(0, 4), st.integers(0, 3))
def test_padding_never_changes_the_summary(data, extra_cols: int, extra_rows: int) -> None:
    train, rollout, mask = data
    ref = summarize(train, rollout, mask)
    batch, seq = train.shape

    def pad(x: np.ndarray, value: float) -> np.ndarray:
        x = np.hstack([x, np.full((batch, extra_cols), value, dtype=x.dtype)])
        return np.vstack([x, np.full((extra_rows, seq + extra_cols), value, dtype=x.dtype)])

    got = summarize(pad(train, -np.inf), pad(rollout, -3.0), pad(mask, False))
    # Sums over extra zeros may round differently in the last bit.
    assert _same(got, ref)


@given(batches(), st.randoms(use_true_random=False))
def test_permuting_sequences_changes_no_metric(data, rnd) -> None:
    train, rollout, mask = data
    perm = np.array(rnd.sample(range(train.shape[0]), train.shape[0]))
    assert _same(summarize(train[perm], rollout[perm], mask[perm]), summarize(train, rollout, mask))


@given(batches())
def test_float32_and_float64_agree(data) -> None:
    train, rollout, mask = data
    exact = summarize(train, rollout, mask)
    rounded = summarize(train.astype(np.float32), rollout.astype(np.float32), mask)
    # Rounding a logprob to float32 moves it by <= 2^-24 of its size; Δ moves by twice that.
    scale = float(np.abs(np.concatenate([train[mask], rollout[mask]])).max())
    tol = 4 * 2.0**-24 * max(scale, 1.0) * train.shape[1]
    for key, value in exact.items():
        if key == "frac_tokens_ratio_gt_2":
            continue  # a count: a token within tol of |Δ| = log 2 may flip
        assert math.isclose(rounded[key], value, rel_tol=tol, abs_tol=tol) or (
            math.isnan(rounded[key]) and math.isnan(value)), key


@given(st.integers(0, 2**32 - 1), st.sampled_from([100, 40_000, 200_000]),
       st.sampled_from(["normal", "ties", "zeros", "spikes"]))
def test_order_statistics_are_exact(seed, n, kind):
    """The tail selection gives numpy's partition values exactly, ties and heavy tails included
    (the ranks of the summary's quantiles: 0, 1%, 99%, n-1 and their neighbours)."""
    rng = np.random.default_rng(seed)
    values = {"normal": rng.normal(size=n), "ties": rng.integers(-3, 4, n).astype(np.float64),
              "zeros": np.where(rng.random(n) < 0.97, 0.0, rng.normal(size=n)),
              "spikes": np.where(rng.random(n) < 0.02, rng.choice([-20.0, 20.0], n),
                                 rng.normal(0, 1e-3, n))}[kind]
    ks = sorted({0, 1, n // 100, n // 100 + 1, (99 * (n - 1)) // 100, (99 * (n - 1)) // 100 + 1, n - 2, n - 1,
                 n // 2})
    want = np.partition(values, ks)
    assert order_statistics(values, ks) == {k: float(want[k]) for k in ks}


def _tail_data(seed: int, kind: str, padding: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """1024 x 192 logprobs (196k slots: three blocks) whose clamped log ratios follow `kind`."""
    rng = np.random.default_rng(seed)
    shape = (1024, 192)
    d = {"normal": rng.normal(0.0, 0.05, shape), "ties": rng.integers(-3, 4, shape) * 0.25,
         "zeros": np.where(rng.random(shape) < 0.97, 0.0, rng.normal(size=shape)),
         "spikes": np.where(rng.random(shape) < 0.02, rng.choice([-30.0, 30.0], shape),
                            rng.normal(0.0, 1e-3, shape))}[kind]
    rollout = -rng.exponential(2.0, shape) - 30.0
    mask = {"dense": np.ones(shape, bool), "random": rng.random(shape) < 0.8,
            "right": np.arange(shape[1])[None, :] < rng.integers(1, shape[1] + 1, shape[0])[:, None]}[padding]
    return rollout + d, rollout, mask


def _scanned_quantiles(tok, qs, increasing) -> tuple[list[float], int]:
    """`QuantilePass`'s quantiles of `tok` and how many scans of its blocks it took."""
    converted = []
    real_block = type(tok).block
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(tok), "block", lambda self, *args: converted.append(1) or real_block(self, *args))
        p = QuantilePass(tok, qs)
        tok.scan(p)
        result = p.result(increasing)
    return result, len(converted) // len(list(tok.row_blocks()))


QS = (0.0, 0.01, 0.99, 1.0)


def _exact_quantiles(values: np.ndarray) -> list[float]:
    """The summary's quantiles of exp(values), from the order statistics of all of them."""
    return interpolate(order_statistics(values, quantile_ranks(values.size, QS)), values.size, QS, math.exp)


@given(st.integers(0, 2**32 - 1), st.sampled_from(["normal", "ties", "zeros", "spikes"]),
       st.sampled_from(["dense", "random", "right"]))
def test_the_quantile_pass_is_exact(seed, kind, padding):
    """`QuantilePass` keeps only each block's tail values, in one scan, and its quantiles are
    those of the exact order statistics of the clamped log ratio over every valid token."""
    train, rollout, mask = _tail_data(seed, kind, padding)
    got, scans = _scanned_quantiles(token_arrays(train, rollout, mask), QS, math.exp)
    values = np.clip(train - rollout, -20.0, 20.0)[mask]
    assert scans == 1
    assert got == _exact_quantiles(values)
    assert got == pytest.approx(np.quantile(np.exp(values), QS), rel=1e-14)


def test_a_bracket_that_falls_short_takes_a_second_scan():
    """The brackets come from a sample of strided slots; when the sampled slots hold the batch's
    most extreme values, the low bracket selects too few: the pass scans every value again and
    the quantiles are still exact."""
    train, rollout, mask = _tail_data(0, "normal", "dense")
    flat = np.arange(0, train.size, train.size // 8192)
    train.reshape(-1)[flat] = rollout.reshape(-1)[flat] - 5.0  # every sampled slot: Δ = -5
    got, scans = _scanned_quantiles(token_arrays(train, rollout, mask), QS, math.exp)
    values = np.clip(train - rollout, -20.0, 20.0)[mask]
    assert scans == 2
    assert got == _exact_quantiles(values)
