"""Full-distribution drift (`parity.drift.distribution`) against a brute-force computation per
position, on random distributions with -inf entries, ties at the k-th place and k above the
vocabulary; and the top-k refusals (`parity.core.top_k`)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parity.core.errors import BackendError, ConfigError
from parity.core.schema import DISTRIBUTION_SUMMARY_KEYS, json_safe
from parity.core.top_k import TopKError, check_same_processing, check_top_k
from parity.core.types import Rollout, SamplingParams
from parity.drift.distribution import (
    EXP32_REL_ERROR,
    TAIL_EPS,
    TrainerView,
    position_drift,
    summarize_distribution,
    trainer_view,
)
from parity.nightly.regression import RegressionPolicy, distribution_verdict
from parity.rollouts.dumps import dump_rollouts, load_rollouts


def log_rows(rng: np.random.Generator, n: int, vocab: int, scale: float, frac_inf: float,
             grid: float) -> np.ndarray:
    """Random log-softmax rows [n, vocab]; some entries -inf, logits rounded to `grid` (ties)."""
    logits = rng.normal(0.0, scale, size=(n, vocab))
    if grid:
        logits = np.round(logits / grid) * grid
    off = rng.random((n, vocab)) < frac_inf
    off[np.arange(n), rng.integers(vocab, size=n)] = False
    logits[off] = -np.inf
    top = logits.max(axis=1, keepdims=True)
    return logits - (top + np.log(np.exp(logits - top).sum(axis=1, keepdims=True)))


def engine_top_k(rng: np.random.Generator, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The engine's top-min(k, V) of `rows`, descending, ties at the k-th place broken at random."""
    ids = []
    for row in rows:
        shuffled = rng.permutation(row.size)
        order = shuffled[np.argsort(-row[shuffled], kind="stable")][:k]
        ids.append(order)
    ids_a = np.array(ids)
    return ids_a, np.take_along_axis(rows, ids_a, axis=1)


def xlogy_ratio(x: float, y: float) -> float:
    """x log(x / y) with 0 log(0 / y) = 0 and x log(x / 0) = inf for x > 0."""
    if x == 0:
        return 0.0
    return math.inf if y == 0 else x * (math.log(x) - math.log(y))


def brute(train: np.ndarray, ids: np.ndarray, lps: np.ndarray, sampled: int) -> dict[str, float]:
    """docs/DISTRIBUTION.md's formulas for one position, one bucket at a time."""
    vocab = train.size
    k = len(ids)
    full = train
    q = [math.exp(x) for x in lps]
    p = [math.exp(train[i]) for i in ids]
    q_tail, p_tail = max(0.0, 1.0 - float(np.sum(q))), max(0.0, 1.0 - float(np.sum(p)))
    buckets = list(zip(p, q))
    if q_tail > TAIL_EPS and p_tail > TAIL_EPS:
        buckets.append((p_tail, q_tail))
    else:
        buckets[0] = (p[0] + p_tail, q[0] + q_tail)
    kl_pq = max(0.0, sum(xlogy_ratio(a, b) for a, b in buckets))
    kl_qp = max(0.0, sum(xlogy_ratio(b, a) for a, b in buckets))
    tv = 0.5 * (sum(abs(a - b) for a, b in zip(p, q)) + abs(p_tail - q_tail))
    kth = sorted(train, reverse=True)[min(k, vocab) - 1]
    ranked = sorted(full, reverse=True)
    finite = [x > -math.inf for x in lps]
    overlap = sum(1 for i, f in zip(ids, finite) if f and train[i] >= kth and train[i] > -math.inf)
    h_p = -sum(math.exp(x) * x for x in full if x > -math.inf)
    h_q = -sum(b * x for b, x in zip(q, lps) if b > 0) if q_tail <= TAIL_EPS else math.nan
    return {"kl_train_engine": kl_pq, "kl_engine_train": kl_qp, "tv": tv, "overlap": overlap,
            "engine_entries": sum(finite), "argmax_agrees": full[ids[0]] == ranked[0],
            "entropy_train": h_p, "entropy_engine": h_q,
            "sampled_rank": sum(1 for x in full if x > full[sampled])}


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), vocab=st.integers(1, 12), k=st.integers(1, 16),
       scale=st.sampled_from([0.0, 0.3, 2.0, 8.0]), frac_inf=st.sampled_from([0.0, 0.3, 0.7]),
       grid=st.sampled_from([0.0, 0.5]), noise=st.sampled_from([0.0, 1e-3, 0.5]))
@pytest.mark.slow
def test_every_metric_equals_the_brute_force_formula(seed: int, vocab: int, k: int, scale: float,
                                                     frac_inf: float, grid: float, noise: float) -> None:
    rng = np.random.default_rng(seed)
    n = 4
    train = log_rows(rng, n, vocab, scale, frac_inf, grid)
    engine_rows = train + rng.normal(0, noise, size=train.shape)  # -inf entries stay -inf
    engine_rows -= np.log(np.exp(engine_rows).sum(axis=1, keepdims=True))
    ids, lps = engine_top_k(rng, engine_rows, k)
    sampled = ids[:, 0]
    drift = position_drift(lps, trainer_view(train, ids, sampled))
    for row in range(n):
        want = brute(train[row], ids[row], lps[row], int(sampled[row]))
        for name, value in want.items():
            got = getattr(drift, name)[row]
            if isinstance(value, float) and math.isnan(value):
                assert math.isnan(got), name
            elif isinstance(value, float) and math.isinf(value):
                assert got == value, name
            else:
                assert got == pytest.approx(value, rel=1e-9, abs=1e-12), (name, row)
        # the bounds never exceed the full-vocabulary values (data-processing inequality)
        p, q = np.exp(train[row]), np.exp(engine_rows[row])
        true_kl = sum(xlogy_ratio(a, b) for a, b in zip(p, q))
        assert drift.kl_train_engine[row] <= true_kl + 1e-9
        assert drift.kl_engine_train[row] <= sum(xlogy_ratio(b, a) for a, b in zip(p, q)) + 1e-9
        assert drift.tv[row] <= 0.5 * np.abs(p - q).sum() + 1e-9


def test_identical_distributions_give_exactly_zero_and_a_perturbation_does_not() -> None:
    rng = np.random.default_rng(3)
    train = log_rows(rng, 64, 40, 2.0, 0.2, 0.0)
    ids, lps = engine_top_k(rng, train, 8)
    view = trainer_view(train, ids, ids[:, 1])
    same = position_drift(lps, view)
    assert np.array_equal(same.kl_train_engine, np.zeros(64)) and np.array_equal(same.tv, np.zeros(64))
    assert np.array_equal(same.kl_engine_train, np.zeros(64)) and same.argmax_agrees.all()
    # negative control: one ulp-scale change of one logprob per row is seen
    moved = position_drift(np.nextafter(lps, -np.inf, where=np.isfinite(lps), out=lps.copy()), view)
    assert (moved.tv > 0).all()


def test_k_above_the_vocabulary_covers_the_support_so_the_entropy_is_computable() -> None:
    rng = np.random.default_rng(5)
    train = log_rows(rng, 8, 6, 1.0, 0.0, 0.0)
    ids, lps = engine_top_k(rng, train, 20)
    assert ids.shape == (8, 6)
    drift = position_drift(lps, trainer_view(train, ids, ids[:, 0]))
    np.testing.assert_allclose(drift.entropy_engine, drift.entropy_train, rtol=1e-12)
    summary = summarize_distribution(drift, 20)
    assert tuple(summary) == DISTRIBUTION_SUMMARY_KEYS
    assert summary["distribution/frac_positions_entropy_computable"] == 1.0


def test_trainer_mass_where_the_engine_reports_minus_inf_is_an_infinite_kl_counted_apart() -> None:
    train = np.log(np.array([[0.5, 0.3, 0.2]]))
    ids, lps = np.array([[0, 1, 2]]), np.array([[math.log(0.6), math.log(0.4), -math.inf]])
    drift = position_drift(lps, trainer_view(train, ids, np.array([0])))
    assert drift.kl_train_engine[0] == math.inf and math.isfinite(drift.kl_engine_train[0])
    assert summarize_distribution(drift, 3)["distribution/num_positions_infinite_kl"] == 1


def float32_sides(seed: int, n: int, vocab: int, k: int, scale: float, frac_inf: float, grid: float,
                  noise: float) -> tuple[np.ndarray, TrainerView]:
    """Engine top-k logprobs and a trainer view of them, both float32 (as engines and dumps give)."""
    rng = np.random.default_rng(seed)
    train = log_rows(rng, n, vocab, scale, frac_inf, grid)
    engine_rows = np.where(np.isfinite(train), train + rng.normal(0.0, noise, train.shape), -np.inf)
    engine_rows -= np.log(np.exp(engine_rows).sum(axis=1, keepdims=True))
    ids, lps = engine_top_k(rng, engine_rows, k)
    view = trainer_view(train, ids, ids[:, 0])
    view32 = TrainerView(view.at_engine.astype(np.float32), view.top_ids,
                         view.top_logprobs.astype(np.float32), view.entropy, view.sampled_rank,
                         view.sampled_ids)
    return lps.astype(np.float32), view32


@pytest.mark.parametrize("scale, frac_inf, grid, noise", [
    (2.0, 0.0, 0.0, 1e-3), (2.0, 0.0, 0.0, 0.3), (8.0, 0.3, 0.0, 1e-2), (0.3, 0.0, 0.5, 0.0),
    (2.0, 0.7, 0.0, 0.5), (40.0, 0.0, 0.0, 1e-2)])
def test_float32_exps_stay_within_the_stated_error_bound_of_float64_ones(scale, frac_inf, grid,
                                                                         noise) -> None:
    """The "float32" path against "float64" on float32 inputs: each KL bound within
    R (sum_S p|d| + 2 |1 + log(x/y)| + 2 x/y) of its bucket masses x, y (docs/DISTRIBUTION.md),
    TV within 2R."""
    lps, view = float32_sides(7, 3000, 40, 20, scale, frac_inf, grid, noise)
    fast, exact = (position_drift(lps, view, precision=p) for p in ("float32", "float64"))
    assert (position_drift(lps, view).tv == fast.tv).all()  # "auto" takes float32 for float32 inputs
    a, b = lps.astype(np.float64), view.at_engine.astype(np.float64)
    q, p = np.exp(a), np.exp(b)
    with np.errstate(invalid="ignore", divide="ignore"):
        d = np.where(np.isfinite(a) & np.isfinite(b), np.abs(b - a), 0.0)
        q_tail, p_tail = np.maximum(1 - q.sum(axis=1), 0), np.maximum(1 - p.sum(axis=1), 0)
        separate = (q_tail > TAIL_EPS) & (p_tail > TAIL_EPS)
        x_p = np.where(separate, p_tail, p[:, 0] + p_tail)
        x_q = np.where(separate, q_tail, q[:, 0] + q_tail)
        r = EXP32_REL_ERROR
        bound_pq = r * ((p * d).sum(axis=1) + 2 * np.abs(1 + np.log(x_p / x_q)) + 2 * x_p / x_q)
        bound_qp = r * ((q * d).sum(axis=1) + 2 * np.abs(1 + np.log(x_q / x_p)) + 2 * x_q / x_p)
    near = (np.abs(q_tail - TAIL_EPS) < 4 * r) | (np.abs(p_tail - TAIL_EPS) < 4 * r)  # a merge may flip
    for got, want, bound in ((fast.kl_train_engine, exact.kl_train_engine, bound_pq),
                             (fast.kl_engine_train, exact.kl_engine_train, bound_qp)):
        both = np.isfinite(want) & ~near
        assert (np.isinf(got) == np.isinf(want)).all()
        assert (np.abs(got - want)[both] <= bound[both] * 1.001 + 1e-15).all()
    assert (np.abs(fast.tv - exact.tv) <= 2 * r + 1e-15).all()
    np.testing.assert_allclose(fast.entropy_engine[~near], exact.entropy_engine[~near], rtol=2 * r)
    assert (fast.overlap == exact.overlap).all()


def test_float32_exps_give_exactly_zero_for_identical_sides_and_see_a_one_ulp_change() -> None:
    lps, view = float32_sides(8, 500, 30, 8, 2.0, 0.2, 0.0, 0.0)
    same = TrainerView(lps.copy(), view.top_ids, lps.copy(), view.entropy, view.sampled_rank,
                       view.sampled_ids)
    zero = position_drift(lps, same, precision="float32")
    for values in (zero.kl_train_engine, zero.kl_engine_train, zero.tv):
        assert np.array_equal(values, np.zeros(500))
    nudged = np.nextafter(lps, np.float32(-np.inf), where=np.isfinite(lps), out=lps.copy())
    moved = position_drift(nudged, same, precision="float32")  # negative control
    assert (moved.tv > 0).all()


def test_a_block_with_a_logprob_below_the_float32_range_takes_float64_exps() -> None:
    """exp(-110) is below float32's normal range: the block's exps are float64 (a finite KL stays finite)."""
    lps = np.log(np.array([[0.7, 0.2, 0.1]])).astype(np.float32)
    train = np.array([[-110.0, math.log(0.5), math.log(0.4)]], dtype=np.float32)
    view = TrainerView(train, np.array([[1, 2, 0]]), np.sort(train)[:, ::-1], np.ones(1),
                       np.zeros(1, np.int64), np.ones(1, np.int64))
    fast, exact = (position_drift(lps, view, precision=p) for p in ("float32", "float64"))
    assert math.isfinite(exact.kl_engine_train[0])
    assert fast.kl_engine_train[0] == exact.kl_engine_train[0] and fast.tv[0] == exact.tv[0]
    with pytest.raises(ConfigError, match="precision"):
        position_drift(lps, view, precision="float16")


def test_float32_exp_relative_error_is_within_the_stated_constant() -> None:
    """A sample of the exhaustive measurement behind `EXP32_REL_ERROR` (every float32 in [-87, 0])."""
    x = np.random.default_rng(0).uniform(-87.0, 0.0, 2_000_000).astype(np.float32)
    exact = np.exp(x.astype(np.float64))
    assert (np.abs(np.exp(x).astype(np.float64) - exact) <= EXP32_REL_ERROR * exact).all()


def good_top_k() -> tuple[np.ndarray, np.ndarray]:
    return np.array([[3, 1, 2], [0, 2, 1]]), np.log(np.array([[0.5, 0.2, 0.1], [0.6, 0.3, 0.1]]))


@pytest.mark.parametrize("change, message", [
    (lambda ids, lps: (np.array([[3, 3, 2], [0, 2, 1]]), lps), "twice"),
    (lambda ids, lps: (ids, lps[:, ::-1]), "descending"),
    (lambda ids, lps: (ids + 10, lps), "vocabulary"),
    (lambda ids, lps: (ids - 4, lps), "negative"),
    (lambda ids, lps: (ids, lps + 1.0), "> 0"),
    (lambda ids, lps: (ids[:, :2], lps), "one shape"),
    (lambda ids, lps: (ids[:1], lps[:1]), "response tokens"),
])
def test_malformed_top_k_is_refused_naming_the_problem(change, message) -> None:
    ids, lps = good_top_k()
    check_top_k(ids, lps, "rollout 'a'", positions=2, vocab_size=8)  # the control passes
    bad_ids, bad_lps = change(ids, lps)
    with pytest.raises(TopKError, match=message):
        check_top_k(bad_ids, bad_lps, "rollout 'a'", positions=2, vocab_size=8)


def test_top_k_of_another_processing_than_the_sampled_logprobs_is_refused() -> None:
    ids, lps = good_top_k()
    tokens = np.array([1, 5])
    check_same_processing(ids, lps, tokens, np.array([math.log(0.2), math.log(0.05)]), "r")
    with pytest.raises(TopKError, match="another temperature"):  # listed token, other logprob
        check_same_processing(ids, lps, tokens, np.array([math.log(0.3), math.log(0.05)]), "r")
    with pytest.raises(TopKError, match="another temperature"):  # unlisted token above the k-th entry
        check_same_processing(ids, lps, tokens, np.array([math.log(0.2), math.log(0.2)]), "r")


def rollout_with_top_k(**changes) -> Rollout:
    ids, lps = good_top_k()
    fields = dict(request_id="a", sample_index=0, prompt_ids=(1, 2), token_ids=(1, 5),
                  logprobs=(math.log(0.2), math.log(0.05)), finish_reason="length", backend="vllm",
                  sampling=SamplingParams(top_k_logprobs=3), top_k_ids=ids, top_k_logprobs=lps)
    return Rollout(**{**fields, **changes})


def test_a_rollout_carries_top_k_through_json_and_old_records_still_read() -> None:
    ro = rollout_with_top_k(top_k_logprobs=np.array([[math.log(0.5), math.log(0.2), -math.inf],
                                                     [math.log(0.6), math.log(0.3), math.log(0.1)]]))
    back = Rollout.from_dict(json.loads(json.dumps(ro.to_dict(), allow_nan=False)))
    assert np.array_equal(back.top_k_ids, ro.top_k_ids)
    assert np.array_equal(back.top_k_logprobs, ro.top_k_logprobs)
    assert back.sampling == ro.sampling
    old = ro.to_dict()
    for key in ("top_k_ids", "top_k_logprobs"):
        del old[key]
    del old["sampling"]["top_k_logprobs"]
    assert Rollout.from_dict(old).top_k_ids is None
    assert "top_k_logprobs" not in SamplingParams().to_dict()  # case hashes stay what they were


def test_a_rollout_refuses_half_or_malformed_top_k() -> None:
    with pytest.raises(TopKError, match="together"):
        rollout_with_top_k(top_k_logprobs=None)
    with pytest.raises(TopKError, match="twice"):
        rollout_with_top_k(top_k_ids=np.array([[3, 3, 2], [0, 2, 1]]))
    with pytest.raises(TopKError, match="another temperature"):
        rollout_with_top_k(logprobs=(math.log(0.3), math.log(0.05)))


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_dumps_carry_top_k_columns_in_both_layouts(tmp_path, suffix: str) -> None:
    ro = rollout_with_top_k(top_k_logprobs=np.array([[math.log(0.5), math.log(0.2), -math.inf],
                                                     [math.log(0.6), math.log(0.3), math.log(0.1)]]))
    back = load_rollouts(dump_rollouts(tmp_path / f"d.{suffix}", [ro]))[0]
    assert np.array_equal(back.top_k_ids, ro.top_k_ids)
    assert np.array_equal(back.top_k_logprobs, ro.top_k_logprobs)
    # verl/NeMo-RL spellings, a dense [response, k] array per row, cut with the response's padding
    row = {"prompts": [1, 2], "responses": [1, 5, 0],
           "rollout_log_probs": [math.log(0.2), math.log(0.05), -1.0],
           "attention_mask": [1, 1, 1, 1, 0], "temperature": 1.0,
           "topk_ids": np.vstack([ro.top_k_ids, [[7, 8, 9]]]).tolist(),
           "topk_logprobs": np.vstack([ro.top_k_logprobs, [[-1.0, -2.0, -3.0]]]).tolist()}
    (tmp_path / "verl.jsonl").write_text(json.dumps(json_safe(row)) + "\n")
    dense = load_rollouts(tmp_path / "verl.jsonl")[0]
    assert np.array_equal(dense.top_k_ids, ro.top_k_ids) and dense.top_k_logprobs.shape == (2, 3)
    with pytest.raises(TopKError, match="twice"):
        row["topk_ids"][0] = [3, 3, 2]
        (tmp_path / "bad.jsonl").write_text(json.dumps(json_safe(row)) + "\n")
        load_rollouts(tmp_path / "bad.jsonl")


@pytest.mark.slow
def test_nightly_judges_the_per_position_kl_against_the_baseline_row() -> None:
    def report(kl: np.ndarray) -> str:
        return json.dumps({"extras": {"distribution": {"kl_train_engine": json_safe(kl.tolist())}}})

    rng = np.random.default_rng(0)
    base = rng.exponential(1e-3, size=500)
    policy = RegressionPolicy(alpha=0.01, min_effect=1e-4)
    same = distribution_verdict(report(base), report(base), baseline_run="r0", policy=policy)
    assert same["distribution/regression_change"] == "unchanged"
    worse = distribution_verdict(report(base * 10), report(base), baseline_run="r0", policy=policy)
    assert worse["distribution/regression_change"] == "regression"
    assert "KL(train || engine)" in worse["distribution/regression_verdict"]
    without = json.dumps({"extras": {}})  # a baseline from before top-k: no verdict, a note saying so
    assert list(distribution_verdict(report(base), without, baseline_run="r0", policy=policy)) \
        == ["distribution/regression_verdict"]


def test_vllm_steps_and_greedy_point_masses_become_top_k_rows() -> None:
    from types import SimpleNamespace as Entry

    from parity.backends.base import greedy_top_k
    from parity.backends.vllm import top_k_of

    # vLLM lists the sampled token too when it ranks below k: it is left out of the top-k
    step = {5: Entry(rank=3, logprob=-2.5), 7: Entry(rank=1, logprob=-0.5), 2: Entry(rank=2, logprob=-1.0)}
    assert top_k_of([step], 2) == ([[7, 2]], [[-0.5, -1.0]])
    assert top_k_of([step], 0) is None
    ids, logprobs = greedy_top_k([7], [[2, 7, 9]])  # parity's processed greedy: a point mass
    assert ids == [[7, 2, 9]] and logprobs == [[0.0, -math.inf, -math.inf]]


def test_sglang_output_top_logprobs_become_top_k_rows() -> None:
    from parity.backends.sglang import parse_top_logprobs

    out = {"meta_info": {"output_top_logprobs": [[(-0.5, 7, None), (-1.0, 2, None), (-2.5, 5, None)]]}}
    assert parse_top_logprobs(out, 2) == ([[7, 2]], [[-0.5, -1.0]])
    assert parse_top_logprobs(out, 0) is None
    with pytest.raises(BackendError, match="top_logprobs_num"):
        parse_top_logprobs({"meta_info": {}}, 2)
