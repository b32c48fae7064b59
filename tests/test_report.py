"""ParityReport: JSON round trip, worst tokens, HTML page, the testing helpers, tolerances."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from parity.assess.reporting import build_report
from parity.core.errors import ConfigError, InputError
from parity.core.types import Rollout
from parity.drift.tolerance import Tolerance, Violation
from parity.render import report_html
from parity.report.document import ParityReport, format_worst_tokens
from parity.testing import assert_is_ratio_close, assert_parity, failure_message


def make_report(*, scale: float = 0.01, rows: int = 4, width: int = 12, seed: int = 0,
                tolerance: Tolerance | None = None) -> ParityReport:
    """A report from synthetic rollouts (no engine): train logprobs = rollout + `scale` * N(0, 1),
    both sides shifted down where that lifts train above 0 (a logprob is <= 0)."""
    rng = np.random.default_rng(seed)
    rollouts, train = [], []
    for i in range(rows):
        n = width if i == 0 else int(rng.integers(3, width + 1))
        rollout_lp = -rng.exponential(1.0, n).astype(np.float32)
        ids = tuple(rng.integers(3, 259, n))
        train_lp = rollout_lp + np.float32(scale) * rng.standard_normal(n).astype(np.float32)
        lift = np.maximum(train_lp, np.float32(0))
        rollouts.append(Rollout(f"r{i}", 0, tuple(range(5, 12)), ids, tuple((rollout_lp - lift).tolist()),
                                "length", "fake"))
        train.append(train_lp - lift)
    provenance = {"backend": "fake", "model": "tiny-llama", "dtype": "bfloat16", "seeds": (1, 2)}
    return build_report(rollouts, train, tolerance=tolerance or Tolerance(), provenance=provenance)


def test_json_round_trip_is_exact():
    report = make_report(scale=0.3)
    report.extras["router"] = {"agreement": np.float32(0.75), "layers": (0, 1), "undefined": float("nan")}
    again = ParityReport.from_json(report.to_json())
    assert again == report
    assert again.to_json() == report.to_json()
    for name in ("train_logprobs", "rollout_logprobs", "mask", "positions", "token_ids"):
        a, b = getattr(report, name), getattr(again, name)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))  # bit for bit
    assert math.isnan(again.extras["router"]["undefined"])
    assert again.violations == report.violations and isinstance(again.violations[0], Violation)


def test_round_trip_keeps_non_finite_and_empty_reports():
    report = make_report()
    report.train_logprobs[0, 0] = -np.inf
    assert ParityReport.from_json(report.to_json()) == report
    empty = ParityReport(np.zeros((0, 0)), np.zeros((0, 0)), np.zeros((0, 0), bool), np.zeros((0, 0)),
                         np.zeros((0, 0)), [], {}, {}, {}, True, Tolerance(), [])
    assert ParityReport.from_json(empty.to_json()) == empty
    assert empty.worst_tokens() == []


def test_reports_with_different_bits_differ():
    report, other = make_report(), make_report()
    other.train_logprobs[0, 0] = np.nextafter(other.train_logprobs[0, 0], np.float32(1))
    assert report != other


def test_bad_json_and_shapes_raise_input_errors():
    with pytest.raises(InputError, match="not valid JSON"):
        ParityReport.from_json("{")
    with pytest.raises(InputError, match="format"):
        ParityReport.from_json(json.dumps({"format": "other"}))
    truncated = json.loads(make_report().to_json())
    del truncated["summary"]
    with pytest.raises(InputError, match="missing field 'summary'"):
        ParityReport.from_json(json.dumps(truncated))
    report = make_report()
    with pytest.raises(InputError, match="rollout_logprobs has shape"):
        ParityReport(**{**_fields(report), "rollout_logprobs": np.zeros((1, 1))})
    with pytest.raises(InputError, match="sequences has 1 entries"):
        ParityReport(**{**_fields(report), "sequences": [{}]})


def _fields(report: ParityReport) -> dict:
    return {k: getattr(report, k) for k in report.__dataclass_fields__}


def test_worst_tokens_sorted_by_absolute_logprob_difference():
    report = make_report(scale=0.2)
    worst = report.worst_tokens(5)
    diffs = [abs(w["logprob_diff"]) for w in worst]
    assert len(worst) == 5 and diffs == sorted(diffs, reverse=True)
    all_diffs = np.abs(report.train_logprobs.astype(np.float64) - report.rollout_logprobs)[report.mask]
    assert diffs[0] == all_diffs.max()
    top = worst[0]
    r, c = top["sequence"], top["position"]
    assert report.mask[r, c]
    assert top["token_id"] == report.token_ids[r, c]
    assert top["train_logprob"] == float(report.train_logprobs[r, c])
    assert top["rollout_logprob"] == float(report.rollout_logprobs[r, c])
    assert top["ratio"] == pytest.approx(math.exp(top["train_logprob"] - top["rollout_logprob"]))
    assert top["request_id"] == f"r{r}"
    assert len(report.worst_tokens(10_000)) == report.mask.sum()
    with pytest.raises(InputError):
        report.worst_tokens(-1)


def test_padding_is_never_a_worst_token():
    report = make_report()
    report.train_logprobs[~report.mask] = 99.0
    assert all(report.mask[w["sequence"], w["position"]] for w in report.worst_tokens(100))


def test_html_is_self_contained_and_shows_everything():
    report = make_report(scale=1.0)
    page = report_html(report)
    assert page.startswith("<!DOCTYPE html>")
    assert page.count('<img class="plot"') == 3 and page.count("data:image/svg+xml;base64,") == 3
    assert "<script" not in page and "http://" not in page.replace("http://www.w3.org", "")
    assert "https://" not in page
    assert "FAIL" in page and "max_abs_logprob_diff" in page and "rollout_corr/rollout_is_mean" in page
    assert f"{report.worst_tokens(1)[0]['token_id']}" in page
    assert report_html(make_report(scale=0.0)).count("PASS") >= 1


def test_format_worst_tokens_table():
    text = format_worst_tokens(make_report(scale=0.2).worst_tokens(5))
    lines = text.splitlines()
    assert len(lines) == 6
    assert lines[0].split() == ["sequence", "position", "token_id", "train_logprob", "rollout_logprob",
                                "ratio"]


def test_assert_is_ratio_close_passes_and_fails_with_table():
    ok = make_report(scale=1e-4)
    assert_is_ratio_close(ok)
    assert_parity(ok)
    bad = make_report(scale=1.0)
    with pytest.raises(AssertionError) as info:
        assert_is_ratio_close(bad)
    message = str(info.value)
    assert "mean_abs_logprob_diff = " in message and "> limit 0.07" in message
    assert "5 worst tokens" in message and "rollout_logprob" in message
    assert len(message.splitlines()) >= 2 + 6
    assert_is_ratio_close(bad, max_abs_logprob_diff=None, mean_abs_logprob_diff=None, k3_kl_max=None,
                          is_ratio_mean_tol=None, frac_tokens_ratio_gt_2_max=None)
    with pytest.raises(AssertionError, match="is_ratio_mean"):
        assert_is_ratio_close(ok, Tolerance.exact())
    with pytest.raises(ConfigError, match="unknown field"):
        assert_is_ratio_close(ok, bogus=1.0)
    assert failure_message(bad, bad.violations).startswith("parity check failed: backend 'fake'")


def test_tolerance_resolve_and_violations():
    assert Tolerance.resolve(None, "reference") == Tolerance.exact()
    assert Tolerance.resolve(None, "vllm") == Tolerance.for_backend("vllm")
    relaxed = Tolerance.resolve({"max_abs_logprob_diff": 2.0}, "vllm")
    assert relaxed.max_abs_logprob_diff == 2.0
    assert relaxed.k3_kl_max == Tolerance.for_backend("vllm").k3_kl_max
    with pytest.raises(ConfigError, match="tolerance must be"):
        Tolerance.resolve(0.5, "vllm")
    with pytest.raises(ConfigError, match=r"tolerance\.k3_kl_max"):
        Tolerance(k3_kl_max=-1.0)
    exact = Tolerance.exact()
    assert exact.violations({"max_abs_logprob_diff": 0.0, "is_ratio_mean": 1.0}) == []
    (v,) = exact.violations({"is_ratio_mean": 1.5})
    assert v == Violation("is_ratio_mean", 1.5, 0.0) and "|is_ratio_mean - 1| = 0.5" in v.describe()
    (nan,) = Tolerance().violations({"k3_kl": float("nan")})
    assert nan.metric == "k3_kl"
