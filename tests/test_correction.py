"""parity.correction against verl 0.9.1's own outputs, plus parity's extras, errors and properties.

The vectors in tests/data/verl_vectors/ were produced by tools/gen_verl_vectors.py running verl's
`compute_rollout_correction_and_rejection_mask` on the inputs stored next to its outputs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import batches

from parity.core.errors import ConfigError, InputError
from parity.correction import RS_OPTIONS, CorrectionConfig, rollout_correction

VECTORS = Path(__file__).parent / "data" / "verl_vectors"
DATASETS = {path.stem: json.loads(path.read_text()) for path in sorted(VECTORS.glob("*.json"))}
CASES = [(name, i) for name, doc in DATASETS.items() for i in range(len(doc["cases"]))]


def _inputs(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    inputs = DATASETS[name]["inputs"]
    return (np.array(inputs["train_logprobs"]), np.array(inputs["rollout_logprobs"]),
            np.array(inputs["mask"], dtype=np.int64))


def _close(key: str, got: float, want: float, rel: float = 1e-6) -> bool:
    # `*_std` keys are verl's sqrt(E[x²] - E[x]²): when the spread is tiny next to the mean (or
    # every x is clamped to one threshold) that is the root of a cancelled difference, rounding
    # noise up to ~1e-8·|x| (verl reports e.g. 1.1e-9 for a constant), which changes with the
    # summation order. Everything else must match to `rel`.
    abs_tol = 1e-8 if key.endswith("_std") else 1e-12
    return math.isclose(got, want, rel_tol=rel, abs_tol=abs_tol)


def test_vectors_cover_every_is_and_rs_combination() -> None:
    seen = set()
    for doc in DATASETS.values():
        for case in doc["cases"]:
            cfg = case["config"]
            for option in (cfg.get("rollout_rs") or "").split(",") or [""]:
                seen.add((cfg.get("rollout_is"), option.strip() or None))
    wanted = {(level, option) for level in (None, "token", "sequence") for option in (None, *RS_OPTIONS)}
    assert wanted <= seen
    assert len(CASES) >= 16
    for name in DATASETS:
        _, _, mask = _inputs(name)
        assert (mask.sum(-1) == 0).any(), "every dataset has an empty row"


@pytest.mark.parametrize(("name", "index"), CASES, ids=[f"{n}-{i}" for n, i in CASES])
@pytest.mark.slow
def test_matches_verl(name: str, index: int) -> None:
    case = DATASETS[name]["cases"][index]
    train, rollout, mask = _inputs(name)
    weights, new_mask, metrics = rollout_correction(train, rollout, mask, **case["config"])
    if "verl_raises" in case:
        # verl divides by zero computing the ESS when IcePop zeroes every weight; parity reports 0.
        assert case["verl_raises"] == "ZeroDivisionError"
        assert metrics["rollout_corr/rollout_is_eff_sample_size"] == 0.0
        assert not weights.any()
        return
    want = case["metrics"]
    assert sorted(metrics) == sorted(want)
    wrong = {k: (metrics[k], want[k]) for k in want if not _close(k, metrics[k], want[k])}
    assert not wrong
    assert new_mask.dtype == mask.dtype
    np.testing.assert_array_equal(new_mask, np.array(case["new_mask"]))
    if case["weights"] is None:
        assert weights is None
    else:
        assert weights.dtype == np.float64
        np.testing.assert_allclose(weights, np.array(case["weights"]), rtol=1e-6, atol=0)


@pytest.mark.parametrize(("name", "index"), CASES, ids=[f"{n}-{i}" for n, i in CASES])
@pytest.mark.slow
def test_metrics_only_gives_the_same_metrics_bit_for_bit(name: str, index: int) -> None:
    """`metrics_only` (the monitor's call) skips the [batch, seq] outputs and nothing else."""
    from parity.correction import apply_correction

    config = CorrectionConfig(**DATASETS[name]["cases"][index]["config"])
    train, rollout, mask = _inputs(name)
    _, _, full = apply_correction(config, train, rollout, mask)
    assert apply_correction(config, train, rollout, mask, metrics_only=True) == (None, None, full)


@pytest.mark.parametrize("options", [{"rollout_is": "token", "rollout_is_threshold": 2.0},
                                     {"rollout_is": "token", "rollout_is_threshold": "0.5_2.0"},
                                     {"rollout_is": "token", "rollout_is_threshold": 2.0,
                                      "rollout_rs": "token_k1,seq_mean_k3",
                                      "rollout_rs_threshold": "0.5_2.0,0.01"}])
def test_blocks_without_padding_skip_their_masks_and_change_nothing(options) -> None:
    """A batch with every slot valid takes the unmasked reductions (`Block.dense`); the same batch
    with one padding column takes the masked ones: the metrics agree to the last bit that the
    summation order allows."""
    rng = np.random.default_rng(5)
    rollout = np.log(rng.uniform(1e-3, 1.0, (6, 9)))
    train = np.minimum(rollout + rng.normal(0.0, 0.4, rollout.shape), 0.0)
    dense = np.ones(rollout.shape, bool)
    pad = lambda a, v: np.concatenate([a, np.full((6, 1), v, a.dtype)], axis=1)  # noqa: E731
    _, _, a = rollout_correction(train, rollout, dense, **options)
    _, _, b = rollout_correction(pad(train, -5.0), pad(rollout, -np.inf), pad(dense, False), **options)
    assert a.keys() == b.keys() and all(math.isclose(a[k], b[k], rel_tol=1e-12, abs_tol=1e-15) for k in a)


def test_torch_inputs_give_torch_outputs() -> None:
    train, rollout, mask = (torch.from_numpy(x) for x in _inputs("spiky"))
    case = DATASETS["spiky"]["cases"][-6]
    weights, new_mask, metrics = rollout_correction(train, rollout, mask.bool(), **case["config"])
    assert isinstance(weights, torch.Tensor) and weights.dtype == torch.float64
    assert new_mask.dtype == torch.bool
    np.testing.assert_array_equal(new_mask.numpy(), np.array(case["new_mask"]).astype(bool))
    assert all(_close(k, metrics[k], v) for k, v in case["metrics"].items())


def test_neg_inf_padding_is_ignored() -> None:
    train, rollout, mask = _inputs("small_drift")
    case = DATASETS["small_drift"]["cases"][20]
    padded_train, padded_rollout = train.copy(), rollout.copy()
    padded_train[mask == 0] = -np.inf
    padded_rollout[mask == 0] = -np.inf
    w_ref, m_ref, ref = rollout_correction(train, rollout, mask, **case["config"])
    w, m, got = rollout_correction(padded_train, padded_rollout, mask, **case["config"])
    assert got == ref
    np.testing.assert_array_equal(w, w_ref)
    np.testing.assert_array_equal(m, m_ref)


# ---------------------------------------------------------------------------------------------
# Extras: geometric-mean sequence IS, lower-bounded TIS, NeMo-RL seq-mask-TIS.


def _toy() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    rollout = -rng.uniform(0.0, 3.0, size=(4, 6))
    train = rollout + rng.normal(0.0, 0.5, size=(4, 6))
    mask = np.ones((4, 6), dtype=bool)
    mask[1, 3:] = False
    mask[3, :] = False
    return train, rollout, mask


def test_geometric_sequence_is() -> None:
    train, rollout, mask = _toy()
    weights, _, metrics = rollout_correction(
        train, rollout, mask, rollout_is="geometric", rollout_is_threshold=1.5
    )
    d = np.where(mask, train - rollout, 0.0)
    n = mask.sum(-1)
    geo = np.exp(np.divide(d.sum(-1), n, out=np.zeros(4), where=n > 0))
    np.testing.assert_allclose(weights, np.minimum(geo, 1.5)[:, None] * mask, rtol=1e-12)
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(geo.max())


def test_lower_bounded_tis() -> None:
    train, rollout, mask = _toy()
    weights, _, metrics = rollout_correction(
        train, rollout, mask, rollout_is="token", rollout_is_threshold=1.5, rollout_is_clamp_lower=0.8
    )
    expected = np.clip(np.exp(train - rollout), 0.8, 1.5) * mask
    np.testing.assert_allclose(weights, expected, rtol=1e-12)
    low = ((np.exp(train - rollout) < 0.8) & mask).sum() / mask.sum()
    assert metrics["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(low)


def test_seq_mask_tis() -> None:
    train, rollout, mask = _toy()
    weights, new_mask, metrics = rollout_correction(
        train, rollout, mask, rollout_is="seq_mask_tis", rollout_is_threshold="0.9_1.1"
    )
    d = np.where(mask, train - rollout, 0.0)
    n = mask.sum(-1)
    geo = np.exp(np.divide(d.sum(-1), n, out=np.zeros(4), where=n > 0))
    kept = (geo >= 0.9) & (geo <= 1.1)
    np.testing.assert_allclose(weights, np.exp(d) * mask * kept[:, None], rtol=1e-12)
    np.testing.assert_array_equal(new_mask, mask)
    dropped = (~kept & (n > 0)).sum() / (n > 0).sum()
    assert metrics["rollout_corr/rollout_is_seq_masked_fraction"] == pytest.approx(dropped)


# ---------------------------------------------------------------------------------------------
# Errors.


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"rollout_is": "tokens"}, "rollout_is must be"),
        ({"rollout_is": "token", "rollout_is_threshold": None}, "needs rollout_is_threshold"),
        ({"rollout_is": "token", "rollout_is_threshold": True}, "rollout_is_threshold"),
        ({"rollout_is": "token", "rollout_is_threshold": "abc"}, "not a number"),
        ({"rollout_is": "token", "rollout_is_threshold": "2_1"}, "lower <= upper"),
        ({"rollout_is": "token", "rollout_is_threshold": -1.0}, "positive"),
        ({"rollout_is": "token", "rollout_is_threshold": float("nan")}, "positive"),
        ({"rollout_is": "token", "rollout_is_threshold": " "}, "not a number"),
        ({"rollout_is": "seq_mask_tis", "rollout_is_threshold": 2.0}, "lower_upper"),
        ({"rollout_is": "token", "rollout_is_threshold": "0.5_2", "rollout_is_clamp_lower": 0.5},
         "truncated IS"),
        ({"rollout_is": "token", "rollout_is_clamp_lower": 3.0}, "rollout_is_clamp_lower"),
        ({"rollout_is": None, "rollout_is_clamp_lower": 0.5}, "truncated IS"),
        ({"rollout_is_batch_normalize": "yes"}, "batch_normalize"),
        ({"rollout_rs": "token_k4", "rollout_rs_threshold": 1.0}, "unknown"),
        ({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": 1.0}, "unknown"),
        ({"rollout_rs": " , ", "rollout_rs_threshold": 1.0}, "at least one"),
        ({"rollout_rs": ["token_k1"], "rollout_rs_threshold": 1.0}, "comma-separated"),
        ({"rollout_rs": "token_k2"}, "rollout_rs_threshold is required"),
        ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.5_2"}, "single upper bound"),
        ({"rollout_rs": "token_k2,token_k3", "rollout_rs_threshold": "1,2,3"}, "3 entries"),
        ({"rollout_rs": "token_k1", "rollout_rs_threshold": 0}, "positive"),
        ({"rollout_rs": "token_k1", "rollout_rs_threshold": "2_1"}, "lower <= upper"),
        ({"rollout_rs": "token_k1", "rollout_rs_threshold": "x_1"}, "not a number"),
        ({"rollout_rs": "token_k3", "rollout_rs_threshold": -0.1}, "positive"),
        ({"rollout_rs": "token_k3", "rollout_rs_threshold": False}, "number"),
    ],
)
def test_bad_options_raise_config_error(options: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CorrectionConfig(**options)


def test_from_dict_rejects_unknown_options() -> None:
    assert CorrectionConfig.from_dict({"rollout_is": "token"}).is_rule.upper == 2.0
    with pytest.raises(ConfigError, match="unknown option"):
        CorrectionConfig.from_dict({"rollout_is": "token", "rollout_is_treshold": 2.0})
    with pytest.raises(TypeError):
        rollout_correction(*_toy(), rollout_iss="token")


def test_duplicate_rs_options_are_dropped_like_verl() -> None:
    cfg = CorrectionConfig(rollout_rs="token_k3,token_k3,seq_sum_k2", rollout_rs_threshold="0.03,0.8")
    assert [r.option for r in cfg.rs_rules] == ["token_k3", "seq_sum_k2"]


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda t, r, m: (t[:, :-1], r, m), "same"),
        (lambda t, r, m: (t, r, m[:-1]), "same"),
        (lambda t, r, m: (t[0], r[0], m[0]), "2-D"),
        (lambda t, r, m: (np.where(m, np.nan, t), r, m), "NaN"),
        (lambda t, r, m: (t, np.where(~m, np.inf, r), m), r"\+inf"),
        (lambda t, r, m: (np.where(m, -np.inf, t), r, m), "-inf at a valid"),
        (lambda t, r, m: (t, r, np.zeros_like(m)), "no valid token"),
        (lambda t, r, m: (t, r, m * 2), "0 and 1"),
        (lambda t, r, m: (t.astype(np.int64), r, m), "floating point"),
        (lambda t, r, m: ("x", r, m), "torch tensor or NumPy"),
    ],
)
def test_bad_inputs_raise_input_error(mutate, match: str) -> None:
    train, rollout, mask = mutate(*_toy())
    with pytest.raises(InputError, match=match):
        rollout_correction(train, rollout, mask, rollout_is="token")


# ---------------------------------------------------------------------------------------------
# Properties.

LEVELS = ("token", "sequence", "geometric")


@given(batches(), st.sampled_from(LEVELS), st.sampled_from(RS_OPTIONS), st.floats(1.0, 10.0))
@pytest.mark.slow
def test_identical_inputs_weights_one_nothing_rejected(
    data, level: str, option: str, threshold: float
) -> None:
    _, rollout, mask = data
    weights, new_mask, metrics = rollout_correction(
        rollout, rollout, mask, rollout_is=level, rollout_is_threshold=threshold,
        rollout_rs=option, rollout_rs_threshold=threshold,
    )
    np.testing.assert_array_equal(weights, mask.astype(np.float64))
    np.testing.assert_array_equal(new_mask, mask)
    for key in ("kl", "k3_kl", "chi2_token", "log_ppl_diff", "rollout_rs_masked_fraction"):
        assert metrics[f"rollout_corr/{key}"] == 0.0
    assert metrics["rollout_corr/rollout_is_mean"] == 1.0


@given(batches(), st.sampled_from(LEVELS), st.floats(1.0, 5.0), st.booleans())
def test_truncation_never_exceeds_threshold(data, level: str, threshold: float, lower_clamp: bool) -> None:
    train, rollout, mask = data
    low = threshold / 2 if lower_clamp else None
    weights, _, _ = rollout_correction(
        train, rollout, mask, rollout_is=level, rollout_is_threshold=threshold, rollout_is_clamp_lower=low
    )
    assert (weights <= threshold).all()
    assert (weights[~mask] == 0).all()
    if low is not None:
        assert (weights[mask] >= low).all()


@given(batches(), st.integers(1, 5), st.sampled_from(LEVELS), st.sampled_from(RS_OPTIONS))
def test_padding_columns_change_nothing(data, extra: int, level: str, option: str) -> None:
    train, rollout, mask = data
    options = {"rollout_is": level, "rollout_rs": option, "rollout_rs_threshold": 1.5}
    w, m, ref = rollout_correction(train, rollout, mask, **options)
    pad = np.full((train.shape[0], extra), -7.0)
    w2, m2, got = rollout_correction(
        np.hstack([train, pad]), np.hstack([rollout, pad - 1.0]), np.hstack([mask, np.zeros_like(pad, bool)]),
        **options,
    )
    # Row sums over more (zero) columns may round differently in the last bit.
    np.testing.assert_allclose(w2[:, : w.shape[1]], w, rtol=1e-14, atol=0)
    assert (w2[:, w.shape[1]:] == 0).all()
    np.testing.assert_array_equal(m2[:, : m.shape[1]], m)
    assert got.keys() == ref.keys()
    assert all(_close(k, got[k], ref[k], rel=1e-12) for k in ref)


@given(batches(), st.randoms(use_true_random=False), st.sampled_from(LEVELS), st.sampled_from(RS_OPTIONS))
def test_permuting_sequences_changes_no_batch_metric(data, rnd, level: str, option: str) -> None:
    train, rollout, mask = data
    perm = np.array(rnd.sample(range(train.shape[0]), train.shape[0]))
    options = {"rollout_is": level, "rollout_rs": option, "rollout_rs_threshold": 1.5}
    w, m, ref = rollout_correction(train, rollout, mask, **options)
    w2, m2, got = rollout_correction(train[perm], rollout[perm], mask[perm], **options)
    np.testing.assert_array_equal(w2, w[perm])
    np.testing.assert_array_equal(m2, m[perm])
    assert all(_close(k, got[k], ref[k], rel=1e-12) for k in ref)


@given(batches(), st.sampled_from(LEVELS), st.sampled_from(RS_OPTIONS))
@pytest.mark.slow
def test_float32_and_float64_agree(data, level: str, option: str) -> None:
    train, rollout, mask = data
    train32, rollout32 = train.astype(np.float32), rollout.astype(np.float32)
    options = {"rollout_is": level, "rollout_rs": option, "rollout_rs_threshold": 1.5}
    # Same float32-representable values in both dtypes: only the result dtype may differ...
    w64, m64, ref = rollout_correction(
        train32.astype(np.float64), rollout32.astype(np.float64), mask, **options
    )
    w32, m32, got = rollout_correction(train32, rollout32, mask, **options)
    assert w32.dtype == np.float32
    np.testing.assert_array_equal(m32, m64)
    np.testing.assert_allclose(w32, w64, rtol=1e-6, atol=0)
    assert got == ref
    # ...and rounding the inputs to float32 moves every metric by no more than float32 precision.
    _, _, exact = rollout_correction(train, rollout, mask, rollout_is=level)
    _, _, rounded = rollout_correction(train32, rollout32, mask, rollout_is=level)
    scale = 1.0 + float(np.abs(np.concatenate([train[mask], rollout[mask]])).max())
    for k, v in exact.items():
        assert math.isclose(rounded[k], v, rel_tol=1e-5, abs_tol=1e-6 * scale), k
