"""Nightly verdicts that compared unlike rows or printed numbers that were not what they said (round 5).
No engine starts: rows are written to a history by hand and judged as the runner judges them."""

from __future__ import annotations

import json
import types

import numpy as np

from parity.nightly.history import History
from parity.nightly.markdown_report import render_summary
from parity.nightly.regression import (
    DISTRIBUTION_CHANGE_KEY,
    DISTRIBUTION_VERDICT_KEY,
    Noise,
    RegressionPolicy,
    Verdict,
    compare_drift,
    distribution_verdict,
    judge_with_noise,
)
from parity.nightly.rows import BASELINE_SKIPPED, RowKey, RowResult
from parity.nightly.runner import NightlyConfig, judge_row

POLICY = RegressionPolicy()
KEY = RowKey("smoke", "hf", "float32")
COMPARE = types.SimpleNamespace(kind="compare")


def drift(scale: float, n: int = 2000, seed: int = 0) -> np.ndarray:
    return np.abs(scale * np.random.default_rng(seed).standard_normal(n))


def provenance(case_hash: str = "aaaa", **more: object) -> dict[str, object]:
    return {"case": "smoke", "case_hash": case_hash, "model": "tiny", "model_hash": "m1",
            "reference_kernels": "invariant", "device": "cpu", "versions": {"parity": "1", "vllm": "0.6.0"},
            **more}


def history_with(tmp_path, *rows: tuple[str, str, dict, np.ndarray]) -> History:
    h = History(tmp_path / "history.sqlite")
    for run_id, status, prov, diff in rows:
        h.start_run(run_id, {}, {})
        mean = float(diff.mean()) if diff.size else 0.5
        h.add_row(RowResult(run_id, KEY, status, summary={"mean_abs_logprob_diff": mean}, provenance=prov,
                            abs_diff=diff))
    return h


def config(tmp_path, baseline: str | None = None) -> NightlyConfig:
    return NightlyConfig(cases="x", backends=("hf",), out=tmp_path, device="cpu", baseline=baseline)


def test_a_case_edited_under_its_name_is_not_judged_against_the_old_workload(tmp_path):
    # r0 ran the edited case's contents (bbbb) before; r1 the old contents (aaaa), with 50x less drift
    with history_with(tmp_path, ("r0", "pass", provenance("bbbb"), drift(0.05, seed=3)),
                      ("r1", "pass", provenance("aaaa"), drift(0.001))) as h:
        h.start_run("r2", {}, {})
        row = RowResult("r2", KEY, "pass", provenance=provenance("bbbb"), abs_diff=drift(0.05, seed=1))
        judged = judge_row(row, COMPARE, config(tmp_path), h)
        # was: "regression vs r1" (another workload); now the newest row of the same workload
        assert judged.status == "pass" and judged.verdict.baseline_run == "r0"
        assert judged.verdict.change == "unchanged"
        # an explicit --baseline of another workload: no verdict, and the row says why
        named = judge_row(row, COMPARE, config(tmp_path, baseline="r1"), h)
        assert named.verdict is None and named.status == "pass"
        assert "case_hash aaaa → bbbb" in named.provenance[BASELINE_SKIPPED]
        run = h.run("r2")
        assert "not compared with r1: another workload" in render_summary(run, [named])


def test_other_weights_under_the_same_model_name_are_another_workload(tmp_path):
    with history_with(tmp_path, ("r1", "pass", provenance(model_hash="old"), drift(0.001))) as h:
        h.start_run("r2", {}, {})
        row = RowResult("r2", KEY, "pass", provenance=provenance(model_hash="new"), abs_diff=drift(0.05))
        assert judge_row(row, COMPARE, config(tmp_path), h).verdict is None


def test_a_verdict_against_another_setting_names_it(tmp_path):
    newer = provenance(versions={"parity": "1", "vllm": "0.7.0"}, reference_kernels="native")
    with history_with(tmp_path, ("r1", "pass", provenance(), drift(0.001))) as h:
        h.start_run("r2", {}, {})
        row = RowResult("r2", KEY, "pass", provenance=newer, abs_diff=drift(0.05, seed=1))
        judged = judge_row(row, COMPARE, config(tmp_path), h)
        assert judged.status == "regression"  # a backend upgrade is what the nightly watches
        text = judged.verdict.describe()
        assert "reference_kernels invariant → native" in text and "versions.vllm 0.6.0 → 0.7.0" in text


def test_a_loop_row_gets_no_verdict_from_its_empty_token_arrays(tmp_path):
    prov = {**provenance(), "kind": "loop"}
    with history_with(tmp_path, ("r1", "pass", prov, np.zeros(0))) as h:
        h.start_run("r2", {}, {})
        row = RowResult("r2", KEY, "pass", summary={"mean_abs_logprob_diff": 0.5}, provenance=prov)
        judged = judge_row(row, types.SimpleNamespace(kind="loop"), config(tmp_path), h)
        # was: "unchanged vs r1: mean |Δlogp| 0 → 0 nats" beside a summary of 0.5
        assert judged.verdict is None


def test_tokens_outside_the_support_neither_hide_a_regression_nor_make_up_a_mean():
    base, cur = drift(0.001), drift(0.05, seed=1)
    base[:3] = np.inf  # 0.15% of tokens outside the support: within the default tolerance, a passing row
    cur[:3] = np.inf
    v = compare_drift(cur, base, baseline_run="r1", policy=POLICY)
    # was: "unchanged ... inf → inf nats (+nan, p=1)" although p_worse was 0
    assert v.change == "regression" and v.p_value == v.p_worse < 1e-6
    assert np.isclose(v.baseline_mean, np.mean(base[3:])) and np.isclose(v.current_mean, np.mean(cur[3:]))
    assert "non-finite on 3 of 2000 → 3 of 2000 tokens" in v.describe()
    one_base, one_cur = drift(0.001, seed=2), drift(0.001, n=1990, seed=4)
    one_base[0] = one_cur[0] = np.inf
    same = compare_drift(one_cur, one_base, baseline_run="r1", policy=POLICY)
    # was: means of 9e+304 nats and an effect of 4.5e+302
    assert same.change == "unchanged" and same.current_mean < 0.01 and abs(same.effect) < 1e-3


def test_more_tokens_outside_the_support_are_worse_even_within_the_repeat_noise():
    base = drift(0.01, n=400)
    cur = base.copy()
    cur[:60] = np.inf
    v = compare_drift(cur, base, baseline_run="r1", policy=POLICY)
    assert v.change == "regression" and abs(v.effect) < 0.01  # the finite tokens are the same
    noisy = Noise(source="audit", deterministic=False, mean_abs_logprob_diff=0.05, max_abs_logprob_diff=0.3,
                  differing_requests=2, requests=4)
    assert judge_with_noise(v, noisy, cur, base).change == "regression"
    assert compare_drift(base, cur, baseline_run="r1", policy=POLICY).change == "improved"


def test_a_verdict_stored_before_the_new_fields_reads_back():
    v = compare_drift(drift(0.02), drift(0.01), baseline_run="r0", policy=POLICY)
    old = {k: val for k, val in v.to_dict().items()
           if k not in ("current_nonfinite", "baseline_nonfinite", "settings_changed")}
    back = Verdict.from_dict(json.loads(json.dumps(old)))
    assert back == v and back.describe() == v.describe()


def test_kl_bounds_of_two_top_k_widths_are_not_compared():
    def report(k: int, kl: list[float]) -> str:
        return json.dumps({"extras": {"distribution": {"top_k": k, "kl_train_engine": kl}}})

    low = [0.001] * 200
    high = list(drift(0.05, n=200))  # a wider top-k sees more of the distribution: larger bounds
    out = distribution_verdict(report(20, high), report(5, low), baseline_run="r1", policy=POLICY)
    assert DISTRIBUTION_CHANGE_KEY not in out
    assert "top-k was 5 there, 20 here" in out[DISTRIBUTION_VERDICT_KEY]
    same = distribution_verdict(report(5, high), report(5, low), baseline_run="r1", policy=POLICY)
    assert same[DISTRIBUTION_CHANGE_KEY] == "regression"


def test_an_explicit_error_baseline_row_still_gives_no_verdict(tmp_path):
    with History(tmp_path / "h.sqlite") as h:
        h.start_run("r1", {}, {})
        h.add_row(RowResult("r1", KEY, "error", error="boom", provenance=provenance()))
        h.start_run("r2", {}, {})
        row = RowResult("r2", KEY, "pass", provenance=provenance(), abs_diff=drift(0.01))
        assert judge_row(row, COMPARE, config(tmp_path, baseline="r1"), h).verdict is None


def test_a_variant_row_is_not_judged_against_the_plain_engines_noise():
    """An audit row measures the noise of the engine it ran (no route capture, no prefix cache); a
    variant row ran another engine, so its noise is unknown rather than the plain one's."""
    from parity.nightly.noise import AUDIT, backend_noise

    repeat = {"skipped": None, "identical": False, "mean_abs_logprob_diff": 0.01, "max_abs_logprob_diff": 0.1,
              "differing_requests": 2, "requests": 8}
    audit = RowResult(run_id="r1", key=RowKey("audit", "vllm", "bfloat16"), status="pass",
                      provenance={"kind": AUDIT, "model": "tiny", AUDIT: {"checks": {"repeat": repeat}}})
    plain, variant = (RowResult(run_id="r1", key=RowKey("moe", "vllm", "bfloat16", v), status="pass",
                                provenance={"model": "tiny"}) for v in ("", "R3"))
    assert backend_noise([audit], plain).mean_abs_logprob_diff == 0.01  # the control
    assert backend_noise([audit], variant) is None
