"""No silent wrong numbers, round 8: how reports, pages and assertions show numbers (`parity.report`,
`parity.render`, `parity.testing`).

A worst token's ratio never prints as 0 or 1 when it is neither, nor its two logprobs alike on the
page; a violation never reads "0.07 > limit 0.07"; a report's verdict agrees with its violations; a
stored report's tolerance and arrays read back as stored or not at all; an assertion on a report that
measured nothing, or lacks a metric it checks, is refused; the loop page says which steps its summary
leaves out. No engine starts here.
"""

from __future__ import annotations

import numpy as np
import pytest

from parity.core.errors import InputError
from parity.drift.tolerance import Tolerance, Violation
from parity.report.document import ParityReport, format_worst_tokens


def _report(train: list[list[float]], rollout: list[list[float]], *, summary: dict | None = None,
            violations: list[Violation] | None = None, passed: bool | None = None) -> ParityReport:
    """A report of the given `[rows, width]` logprobs, every token real, request ids r0, r1, ..."""
    t = np.asarray(train, np.float32)
    rows, width = t.shape
    return ParityReport(
        t, np.asarray(rollout, np.float32), np.ones((rows, width), bool),
        np.tile(np.arange(width) + 5, (rows, 1)), np.tile(np.arange(width) + 100, (rows, 1)),
        [{"request_id": f"r{i}"} for i in range(rows)], summary if summary is not None else {}, {}, {},
        not violations if passed is None else passed, Tolerance(), violations or [])


_NEAR = float(np.nextafter(np.float32(-0.5), np.float32(-1)))  # one float32 step below -0.5: Δ 6e-8 nats

_FULL = {"max_abs_logprob_diff": 0.0, "mean_abs_logprob_diff": 0.0, "is_ratio_mean": 1.0, "k3_kl": 0.0,
         "frac_tokens_ratio_gt_2": 0.0, "frac_tokens_outside_support": 0.0}


# -- worst tokens ------------------------------------------------------------------------------


def test_a_worst_tokens_ratio_prints_as_neither_0_nor_1_when_it_is_neither():
    report = _report([[-30.0, -0.5, -1.0]], [[-1.0, _NEAR, -2.0]])
    rows = report.worst_tokens(5)
    ratios = [line.split()[-1] for line in format_worst_tokens(rows, report.num_tokens).splitlines()[1:]]
    # were 0.000000 (read as a -inf train logprob) and 1.000000 (read as exact)
    assert ratios[0] != "0.000000" and float(ratios[0]) == pytest.approx(np.exp(-29.0), rel=1e-5)
    assert ratios[2] != "1.000000" and float(ratios[2]) > 1.0
    assert ratios[1] == "2.718282"  # a ratio 6 decimals show keeps them


def test_the_page_keeps_a_worst_tokens_logprobs_and_ratio_apart():
    from parity.render.report_page import worst_tokens_table

    report = _report([[-0.5, -30.0]], [[_NEAR, -1.0]])
    table = worst_tokens_table(report.worst_tokens(5), report.num_tokens)
    assert "<td>-0.500000</td><td>-0.500000</td>" not in table  # the two sides printed alike
    assert "<td>-0.5</td><td>-0.50000006</td>" in table
    assert "<td>1.000000</td>" not in table and "<td>0.000000</td>" not in table
    assert "<td>-1.000000</td>" in table  # a difference 6 decimals show keeps the 6-decimal cells


# -- the verdict and its violations ----------------------------------------------------------------


def test_a_violation_never_reads_as_its_limit_or_as_an_is_mean_of_1():
    assert Violation("mean_abs_logprob_diff", 0.0700000012, 0.07).describe() != \
        "mean_abs_logprob_diff = 0.07 > limit 0.07"
    text = Violation("mean_abs_logprob_diff", 0.0700000012, 0.07).describe()
    value, limit = text.split(" = ")[1].split(" > limit ")
    assert float(value) > float(limit) == 0.07
    mean = Violation("is_ratio_mean", 1.0000000298, 0.0).describe()
    assert "(is_ratio_mean = 1)" not in mean and float(mean.rsplit("= ", 1)[1].rstrip(")")) > 1.0
    assert Violation("max_abs_logprob_diff", 0.73, 0.5).describe() == \
        "max_abs_logprob_diff = 0.73 > limit 0.5"
    assert Violation("is_ratio_mean", 1.2, 0.06).describe() == \
        "|is_ratio_mean - 1| = 0.2 > limit 0.06 (is_ratio_mean = 1.2)"


def test_a_report_whose_verdict_contradicts_its_violations_is_refused():
    violation = Violation("max_abs_logprob_diff", 1.0, 0.5)
    with pytest.raises(InputError, match="passed is True with 1 violation"):  # was a PASS page listing it
        _report([[-1.0]], [[-2.0]], violations=[violation], passed=True)
    with pytest.raises(InputError, match="passed is False with 0 violation"):
        _report([[-1.0]], [[-2.0]], passed=False)
    assert not _report([[-1.0]], [[-2.0]], violations=[violation]).passed


# -- stored reports ---------------------------------------------------------------------------


def test_a_stored_tolerance_missing_a_limit_is_refused_not_defaulted():
    d = _report([[-1.0]], [[-1.0]]).to_dict()
    d["tolerance"] = {**Tolerance.exact().to_dict()}
    del d["tolerance"]["k3_kl_max"]
    with pytest.raises(InputError, match="tolerance is missing limit 'k3_kl_max'"):  # was read as 0.02
        ParityReport.from_dict(d)
    d["tolerance"]["k3_kl_max"] = None  # a check that was off reads back off
    assert ParityReport.from_dict(d).tolerance.k3_kl_max is None


def test_stored_lists_of_another_shape_than_the_stored_one_are_refused():
    d = _report([[-1.0, -2.0, -3.0, -4.0]], [[-1.0, -2.0, -3.0, -4.0]]).to_dict()
    d["arrays"]["train_logprobs"]["data"] = [[-1.0, -2.0], [-3.0, -4.0]]  # was reflowed to [1, 4]
    with pytest.raises(InputError, match="lists of shape \\[2, 2\\] but says shape \\[1, 4\\]"):
        ParityReport.from_dict(d)
    empty = ParityReport(np.zeros((0, 3)), np.zeros((0, 3)), np.zeros((0, 3), bool), np.zeros((0, 3)),
                         np.zeros((0, 3)), [], {}, {}, {}, True, Tolerance(), [])
    assert ParityReport.from_json(empty.to_json()) == empty  # [] of shape [0, 3] still reads back


# -- assertions -------------------------------------------------------------------------------


def test_assertions_refuse_a_report_that_measured_nothing():
    from parity.testing import assert_is_ratio_close, assert_parity

    empty = ParityReport(np.zeros((1, 2)), np.zeros((1, 2)), np.zeros((1, 2), bool), np.zeros((1, 2)),
                         np.zeros((1, 2)), [{}], dict(_FULL), {}, {}, True, Tolerance(), [])
    with pytest.raises(InputError, match="assert_parity: the report holds no tokens"):  # was a pass
        assert_parity(empty)
    with pytest.raises(InputError, match="assert_is_ratio_close: the report holds no tokens"):
        assert_is_ratio_close(empty)


def test_assert_is_ratio_close_refuses_a_limit_whose_metric_the_summary_lacks():
    from parity.testing import assert_is_ratio_close

    bare = _report([[-1.0, -0.5]], [[-3.0, -0.5]])  # drifting tokens, no summary: was a pass
    with pytest.raises(InputError, match=r"no 'max_abs_logprob_diff' to check.*max_abs_logprob_diff=None"):
        assert_is_ratio_close(bare)
    partial = _report([[-1.0]], [[-1.0]], summary={k: v for k, v in _FULL.items() if k != "k3_kl"})
    with pytest.raises(InputError, match=r"no 'k3_kl'.*k3_kl_max=None"):
        assert_is_ratio_close(partial)
    assert_is_ratio_close(partial, k3_kl_max=None)  # skipping it is the user's choice
    assert_is_ratio_close(_report([[-1.0]], [[-1.0]], summary=dict(_FULL)), Tolerance.exact())


# -- the loop page ----------------------------------------------------------------------------


def test_the_loop_summary_says_which_steps_it_leaves_out():
    from parity.render.loop import backend_summary, loop_page

    rows = [{"step": 0, "backend": "vllm", "max_abs_logprob_diff": 0.01, "mean_abs_logprob_diff": 0.001,
             "k3_kl": 1e-5, "reward_mean": 0.5, "weights_in_sync": True, "bitwise": False},
            {"step": 1, "backend": "vllm", "max_abs_logprob_diff": None, "mean_abs_logprob_diff": None,
             "k3_kl": None, "reward_mean": 0.5, "weights_in_sync": True, "bitwise": False}]
    summary = backend_summary(rows)
    assert summary["unmeasured"] == {"max_abs_logprob_diff": 1, "mean_abs_logprob_diff": 1, "k3_kl": 1}
    page = loop_page({"model": "m", "backends": ["vllm"], "steps": rows, "train_on": "vllm"})
    # was a bare 0.01 under "max |Δlogp| (all steps)", the infinite step (stored as null) left out
    assert '<td class="bad">0.01 (1 of 2 steps with no finite value)</td>' in page
    clean = loop_page({"model": "m", "backends": ["vllm"], "steps": rows[:1], "train_on": "vllm"})
    assert '<td class="">0.01</td>' in clean and "no finite value" not in clean


# -- the audit page and the distribution section ----------------------------------------------------


def _audit(seed_identical: bool) -> dict:
    check = {"identical": True, "requests": 3, "differing_requests": 0, "first_difference": None,
             "max_abs_logprob_diff": 0.0, "mean_abs_logprob_diff": 0.0, "skipped": None}
    checks = {name: dict(check) for name in ("repeat", "batch", "order", "prefill_decode", "prefix_cache")}
    checks["seed"] = {**check, "identical": seed_identical, "differing_requests": 0 if seed_identical else 3}
    return {"backend": "fake", "model": "m", "dtype": "float32", "provenance": {}, "checks": checks,
            "deterministic": True, "batch_invariant": True}


def test_a_failed_seed_control_is_red_in_its_row_not_green():
    from parity.render.audit import audit_html

    failed = audit_html(_audit(True)).split("<td>seed</td>")[0].rsplit("<tr", 1)[1]
    assert 'class="identical"' not in failed and 'class="differs"' in failed  # was the green pass colour
    row = audit_html(_audit(True)).split("<td>seed</td>")[1].split("</tr>")[0]
    assert "control failed" in row
    held = audit_html(_audit(False)).split("<td>seed</td>")[0].rsplit("<tr", 1)[1]
    assert 'class="expected"' in held


def test_a_near_certain_top_k_logprob_does_not_print_as_0():
    from parity.render.distribution import _entries

    text = _entries({"ids": [7, 8, 9], "logprobs": [-0.0004, 0.0, -1.25]}, {})
    # -0.0004 was "-0.000", a certainty
    assert [cell.rsplit(" ", 1)[1] for cell in text.split("<br>")] == ["-0.0004", "0.000", "-1.250"]
