"""Accuracy against the gold: the gold summary, its interval and verdict, the report's gold array,
pages and tables, the advisor's note and the default rule of when the gold runs."""

from __future__ import annotations

import numpy as np
import pytest

from parity.advisor import advise
from parity.assess.accuracy import gold_by_position, gold_summary, verdict
from parity.assess.reporting import build_report
from parity.core.errors import ConfigError, InputError
from parity.core.schema import GOLD_RATIO_CI_KEY, GOLD_RATIO_KEY, GOLD_SUMMARY_KEYS, GOLD_VERDICT_KEY
from parity.core.types import Rollout
from parity.drift.bootstrap import bootstrap_ratio
from parity.drift.tolerance import DEFAULTS, Tolerance
from parity.engine.gold import DEFAULT_SHARE, GOLD_FLOPS, decide
from parity.nightly.markdown_report import render_summary
from parity.render import report_html
from parity.report.document import ParityReport, format_worst_tokens

ROWS, COLS = 24, 40


def sides(rollout_scale: float, train_scale: float = 1.0, seed: int = 0):
    """[ROWS, COLS] gold, train and rollout logprobs: each side off the gold by |N(0, scale * 0.01)|;
    all three shifted down where a side would be above 0 (a logprob is <= 0; the offsets are kept)."""
    rng = np.random.default_rng(seed)
    gold = -rng.exponential(1.0, (ROWS, COLS))
    train = gold + train_scale * 0.01 * rng.standard_normal((ROWS, COLS))
    rollout = gold + rollout_scale * 0.01 * rng.standard_normal((ROWS, COLS))
    lift = np.maximum(np.maximum(train, rollout), 0.0)
    return ((train - lift).astype(np.float32), (rollout - lift).astype(np.float32), gold - lift,
            np.ones((ROWS, COLS), bool))


def test_summary_keys_in_schema_order_and_plain_values():
    summary = gold_summary(*sides(2.0))
    assert tuple(summary) == GOLD_SUMMARY_KEYS
    floats = [v for k, v in summary.items() if k.endswith("logprob_diff") or k == GOLD_RATIO_KEY]
    assert len(floats) == 5 and all(type(v) is float for v in floats)
    assert summary["gold/num_tokens"] == ROWS * COLS and summary["gold/num_tokens_outside_support"] == 0


def test_identical_sides_give_a_ratio_of_exactly_one():
    train, _, gold, mask = sides(1.0)
    summary = gold_summary(train, train.copy(), gold, mask)
    assert summary[GOLD_RATIO_KEY] == 1.0 and summary[GOLD_RATIO_CI_KEY] == [1.0, 1.0]
    assert summary["gold/train_mean_abs_logprob_diff"] == summary["gold/rollout_mean_abs_logprob_diff"] > 0
    assert "identical" in summary[GOLD_VERDICT_KEY]


@pytest.mark.parametrize(("rollout_scale", "train_scale", "says"), [
    (2.0, 1.0, "the rollout is "), (1.0, 3.0, "the trainer is "),
    (1.0, 1.0, "the rollout and the trainer are equally far from the gold within noise"),
])
def test_ratio_interval_and_verdict(rollout_scale, train_scale, says):
    summary = gold_summary(*sides(rollout_scale, train_scale))
    ratio, (low, high) = summary[GOLD_RATIO_KEY], summary[GOLD_RATIO_CI_KEY]
    assert low <= ratio <= high
    assert summary[GOLD_VERDICT_KEY].startswith(says)
    assert ("farther" in summary[GOLD_VERDICT_KEY]) == (rollout_scale != train_scale)
    assert ratio == pytest.approx(rollout_scale / train_scale, rel=0.1)


def test_tokens_outside_a_support_are_counted_apart():
    train, rollout, gold, mask = sides(2.0)
    gold[0, 0], train[1, 1], rollout[2, 2] = -np.inf, -np.inf, -np.inf
    mask[3, 5:] = False
    summary = gold_summary(train, rollout, gold, mask)
    assert summary["gold/num_tokens_outside_support"] == 3
    assert summary["gold/num_tokens"] == int(mask.sum()) - 3
    assert np.isfinite(summary["gold/train_max_abs_logprob_diff"])
    with pytest.raises(InputError, match="no token"):
        gold_summary(train, rollout, np.full_like(gold, -np.inf), mask)


def test_bootstrap_ratio_counts_empty_resamples_as_told():
    numerator = np.array([[0.0], [2.0]])
    low, high = bootstrap_ratio(numerator, np.array([0.0, 1.0]), 400, 0, 0.95, empty=1.0)
    assert low[0] == 1.0 and high[0] == 2.0  # drawing only the first sequence is 0/0: "empty"
    assert np.isnan(bootstrap_ratio(numerator, np.ones(2), 0, 0, 0.95, empty=0.0)[0]).all()


def test_verdict_without_an_interval():
    nan = float("nan")
    assert verdict(1.9, nan, nan) == "the rollout is 1.9x farther from the gold than the trainer"
    assert verdict(0.5, 0.4, 0.6).startswith("the trainer is 2x farther from the gold than the rollout")


def test_by_position_gives_each_side_the_drift_buckets():
    train, rollout, gold, mask = sides(2.0)
    rows = gold_by_position(train, rollout, gold, mask)
    assert set(rows) == {"train", "rollout"} and [r["lo"] for r in rows["train"]] == [0, 1, 2, 4, 8, 16, 32]
    assert sum(r["num_tokens"] for r in rows["rollout"]) == ROWS * COLS
    assert all(r["mean_abs_logprob_diff"] > t["mean_abs_logprob_diff"]
               for r, t in zip(rows["rollout"], rows["train"]) if r["num_tokens"] > 100)


def report_with_gold(rollout_scale: float, train_scale: float = 1.0) -> ParityReport:
    train, rollout, gold, _ = sides(rollout_scale, train_scale)
    rollouts = [Rollout(f"r{i}", 0, (1, 2), tuple(range(3, 3 + COLS)), tuple(map(float, rollout[i])),
                        "length", "fake") for i in range(ROWS)]
    return build_report(rollouts, list(train), tolerance=Tolerance(), gold_logprobs=list(gold),
                        extras={"gold": {"ran": True, "reason": "gold=True was asked for"}})


def test_report_stores_the_gold_and_round_trips_bit_for_bit():
    report = report_with_gold(2.0)
    assert report.gold_logprobs.dtype == np.float64
    assert set(GOLD_SUMMARY_KEYS) <= set(report.summary) and "gold_by_position" in report.breakdowns
    again = ParityReport.from_json(report.to_json())
    assert again == report and np.array_equal(again.gold_logprobs, report.gold_logprobs)
    train_err, rollout_err, positions = again.gold_errors()
    assert train_err.shape == rollout_err.shape == positions.shape == (ROWS * COLS,)
    plain = build_report(
        [Rollout("a", 0, (1,), (3,), (-1.0,), "length", "fake")], [np.array([-1.0])], tolerance=Tolerance())
    assert plain.gold_logprobs is None and plain.gold_errors() is None
    assert "gold_logprobs" not in plain.to_dict()["arrays"]


@pytest.mark.slow
def test_worst_tokens_page_and_text_show_the_gold():
    report = report_with_gold(2.0)
    worst = report.worst_tokens(3)
    assert all("gold_logprob" in row for row in worst)
    assert "gold_logprob" in format_worst_tokens(worst).splitlines()[0]
    page = report_html(report)
    assert "Which side moved" in page and "gold logprob" in page
    assert page.count("<img") >= 5  # three drift plots and the two gold figures
    assert "the rollout is 1.97x farther from the gold" in page


@pytest.mark.slow
def test_a_report_without_its_gold_says_why():
    report = report_with_gold(2.0)
    report.gold_logprobs = None
    report.extras["gold"] = {"ran": False, "reason": "by default: estimated 9 s > 20% of the row's 1 s"}
    assert "did not run: by default: estimated 9 s" in report_html(report)


@pytest.mark.slow
def test_advisor_says_a_rollout_correction_cannot_fix_a_trainer_that_moved():
    trainer_farther = advise(report_with_gold(1.0, 3.0))
    assert "does not fix" in trainer_farther.gold and "fp32" in trainer_farther.gold
    assert trainer_farther.to_dict()["gold"] == trainer_farther.gold
    assert trainer_farther.gold in trainer_farther.text()
    assert advise(report_with_gold(3.0, 1.0)).gold is None  # the rollout moved: correcting it is the point
    train, rollout, _, mask = sides(1.0, 3.0)
    assert advise(train, rollout, mask).gold is None  # arrays carry no gold
    page = report_html(report_with_gold(1.0, 3.0))
    assert "does not fix" in page


def test_nightly_summary_shows_the_ratio_column():
    from parity.nightly.history import RunInfo
    from parity.nightly.rows import RowKey, RowResult

    said = "the rollout is 1.93x farther from the gold than the trainer"
    summary = {"max_abs_logprob_diff": 0.1, "mean_abs_logprob_diff": 0.01, "k3_kl": 1e-4,
               GOLD_RATIO_KEY: 1.93, GOLD_VERDICT_KEY: said}
    row = RowResult(run_id="r", key=RowKey("smoke", "vllm", "bfloat16"), status="fail", summary=summary)
    run = RunInfo(run_id="r", seq=1, created_at="now", finished_at=None, config={}, environment={})
    text = render_summary(run, [row])
    assert "gold: rollout/train error" in text and "| 1.93 |" in text and "which side moved" in text


def test_nightly_trends_chart_the_gold_errors_not_its_counts():
    from parity.nightly.charts import trend_metrics

    summary = gold_summary(*sides(2.0))
    charted = trend_metrics([summary])
    assert GOLD_RATIO_KEY in charted and "gold/train_mean_abs_logprob_diff" in charted
    left_out = {"gold/num_tokens", "gold/num_tokens_outside_support", GOLD_RATIO_CI_KEY, GOLD_VERDICT_KEY}
    assert not left_out & set(charted)


def test_default_rule_runs_the_gold_when_it_costs_under_a_second_or_at_most_a_fifth_of_the_row():
    params, tokens = 135_000_000, 2_000
    estimate = 2.0 * params * tokens / GOLD_FLOPS["cpu"]
    cheap = decide(None, parameters=params, tokens=tokens, row_seconds=estimate / DEFAULT_SHARE, device="cpu")
    assert cheap.run and cheap.estimated_seconds == pytest.approx(estimate) and "by default" in cheap.reason
    dear = decide(None, parameters=params, tokens=tokens, row_seconds=estimate / DEFAULT_SHARE * 0.99,
                  device="cpu")
    assert not dear.run and ">" in dear.reason
    assert decide(True, parameters=params, tokens=tokens, row_seconds=0.0, device="cpu").run
    tiny = decide(None, parameters=426_624, tokens=1_500, row_seconds=0.01, device="cpu")
    assert tiny.run and "under 1 s" in tiny.reason  # a built-in model: the bar, not the row's time
    assert not decide(False, parameters=1, tokens=1, row_seconds=1e9, device="cpu").run


def test_default_tolerances_follow_the_dtype():
    """docs/PRECISION.md derives one row of limits per dtype; the class defaults are the bf16 row."""
    assert Tolerance() == Tolerance.for_backend("vllm") == Tolerance.for_backend("vllm", "bfloat16")
    for dtype, limits in DEFAULTS.items():
        assert Tolerance.for_backend("hf", dtype).to_dict() == limits
        assert Tolerance.for_backend("reference", dtype) == Tolerance.exact()
    fp32 = Tolerance.for_backend("vllm", "float32")
    assert fp32.mean_abs_logprob_diff < Tolerance.for_backend("vllm", "float16").mean_abs_logprob_diff \
        < Tolerance().mean_abs_logprob_diff
    relaxed = Tolerance.resolve({"max_abs_logprob_diff": 0.01}, "vllm", "float32")
    assert relaxed.max_abs_logprob_diff == 0.01 and relaxed.k3_kl_max == fp32.k3_kl_max
    with pytest.raises(ConfigError, match="dtype must be one of"):
        Tolerance.for_backend("vllm", "float64")


def test_a_gold_that_measured_no_token_says_so_on_the_page():
    """Every gold logprob -inf: the gold ran, no token is finite on all three sides, so the summary has
    no gold figures; the page says why instead of an empty verdict ('.')."""
    from parity.render.gold import gold_html

    rollouts = [Rollout("a", 0, (1,), (3, 4), (-1.0, -2.0), "length", "fake")]
    report = build_report(rollouts, [np.array([-1.0, -2.0])], tolerance=Tolerance(),
                          gold_logprobs=[np.array([-np.inf, -np.inf])], extras={"gold": {"ran": True}})
    assert GOLD_VERDICT_KEY not in report.summary
    page = gold_html(report)
    assert "nothing was measured" in page and '<p class="advice">.</p>' not in page
    assert GOLD_VERDICT_KEY in report_with_gold(2.0).summary  # the control: a measured gold has its verdict
