"""No silent wrong numbers, round 6: stored reports and their pages (`parity.report`, `parity.render`).

A stored report reads back only when every value survives exactly and its verdict agrees with its
violations; a page never prints a differing token, a near-1 agreement or a nonzero share as exact, never
draws an undefined KL as agreement, and names the GPU each side ran on. No engine starts here.
"""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

from parity.core.errors import InputError
from parity.drift.tolerance import Tolerance, Violation
from parity.report.document import ParityReport, format_summary, format_worst_tokens


def _report(train: list[list[float]], rollout: list[list[float]], *,
            violations: list[Violation] | None = None, summary: dict | None = None) -> ParityReport:
    """A report of the given `[rows, width]` logprobs, every token real, request ids r0, r1, ..."""
    t = np.asarray(train, np.float32)
    rows, width = t.shape
    return ParityReport(
        t, np.asarray(rollout, np.float32), np.ones((rows, width), bool),
        np.tile(np.arange(width) + 5, (rows, 1)), np.tile(np.arange(width) + 100, (rows, 1)),
        [{"request_id": f"r{i}"} for i in range(rows)], summary or {}, {}, {}, not violations, Tolerance(),
        violations or [])


# -- the stored document ------------------------------------------------------------------------


def test_a_worst_token_differing_below_six_decimals_does_not_print_as_identical():
    rollout = np.float32(-0.67993188)
    train = np.nextafter(rollout, np.float32(0))  # one float32 step: a 6e-8 nats difference
    report = _report([[float(train), -1.0]], [[float(rollout), -1.0]])
    rows = report.worst_tokens(3)
    assert len(rows) == 1 and rows[0]["logprob_diff"] != 0
    cells = format_worst_tokens(rows, report.num_tokens).splitlines()[1].split()
    assert cells[3] != cells[4]  # was -0.679932 and -0.679932
    assert float(cells[3]) == pytest.approx(float(train), abs=1e-9)
    # a difference 6 decimals show keeps the 6-decimal table
    wide = _report([[-0.5, -1.0]], [[-0.25, -1.0]])
    cells = format_worst_tokens(wide.worst_tokens(3)).splitlines()[1].split()
    assert cells[3:5] == ["-0.500000", "-0.250000"]


def test_a_token_both_sides_put_outside_support_is_no_worst_token():
    report = _report([[-np.inf, -1.0]], [[-np.inf, -1.0]])
    assert report.worst_tokens(5) == []  # was the -inf/-inf token, ratio nan, listed as the worst
    assert format_worst_tokens(report.worst_tokens(5), report.num_tokens) == "all 2 tokens identical"
    one_side = _report([[-np.inf, -1.0]], [[-2.0, -1.0]])
    assert [r["position"] for r in one_side.worst_tokens(5)] == [0]


def test_a_request_with_every_token_outside_support_shows_no_drift_number():
    from parity.render.report_page import request_drift_table

    report = _report([[-1.0, -2.0], [-np.inf, -np.inf]], [[-1.0, -2.5], [-1.0, -3.0]])
    drift = report.request_drift()
    assert drift[1]["tokens"] == 0 and drift[1]["outside_support"] == 2
    # were 0.0: a drift nobody measured
    assert np.isnan(drift[1]["max_abs_logprob_diff"]) and np.isnan(drift[1]["mean_abs_logprob_diff"])
    assert drift[0]["max_abs_logprob_diff"] == 0.5
    table = request_drift_table(drift)
    second = table.split("<tr>")[-1]
    assert "no token inside both sides" in second and "0.000e+00" not in second and "nan" not in second


def _stored(report: ParityReport) -> dict:
    return json.loads(report.to_json())


def test_a_stored_verdict_must_be_a_bool_that_agrees_with_its_violations():
    failing = _report([[-1.0]], [[-2.0]], violations=[Violation("max_abs_logprob_diff", 1.0, 0.5)])
    assert ParityReport.from_dict(_stored(failing)) == failing
    d = _stored(failing)
    d["passed"] = "false"  # bool("false") is True: the report read as a PASS
    with pytest.raises(InputError, match="'passed' is 'false'"):
        ParityReport.from_dict(d)
    d["passed"] = True
    with pytest.raises(InputError, match="contradicts its violations"):
        ParityReport.from_dict(d)
    d = _stored(_report([[-1.0]], [[-1.0]]))
    d["passed"] = False
    with pytest.raises(InputError, match="contradicts"):
        ParityReport.from_dict(d)


def test_a_stored_version_of_true_is_no_version_one():
    d = _stored(_report([[-1.0]], [[-1.0]]))
    d["version"] = True  # True == 1 in Python
    with pytest.raises(InputError, match="version True is not supported"):
        ParityReport.from_dict(d)


@pytest.mark.parametrize(("name", "value"), [
    ("train_logprobs", -1.0000000001),  # a float64 logprob: float32 would round it to -1.0
    ("train_logprobs", -1e300),  # beyond float32: would become -inf
    ("positions", 7.5),  # would be cut to 7
    ("mask", 2),  # would become True
    ("token_ids", "7"),  # a string
])
def test_a_stored_array_value_its_dtype_cannot_hold_is_refused(name, value):
    d = _stored(_report([[-1.0, -2.0]], [[-1.0, -2.0]]))
    d["arrays"][name]["data"][0][0] = value
    with pytest.raises(InputError, match=f"array '{name}'"):
        ParityReport.from_dict(d)


def test_a_stored_array_whose_shape_does_not_fit_is_an_input_error():
    d = _stored(_report([[-1.0, -2.0]], [[-1.0, -2.0]]))
    d["arrays"]["mask"]["shape"] = [3, 5]
    with pytest.raises(InputError, match="array 'mask' does not read as bool of shape"):  # was a ValueError
        ParityReport.from_dict(d)


def test_stored_reports_with_non_finite_and_empty_arrays_still_read_back():
    report = _report([[-np.inf, np.nan, -1.0]], [[-1.0, -1.0, -1.0]], violations=[Violation("k", 1.0, 0.5)])
    assert ParityReport.from_json(report.to_json()) == report
    empty = ParityReport(np.zeros((0, 0)), np.zeros((0, 0)), np.zeros((0, 0), bool), np.zeros((0, 0)),
                         np.zeros((0, 0)), [], {}, {}, {}, True, Tolerance(), [])
    assert ParityReport.from_json(empty.to_json()) == empty


# -- numbers on pages ---------------------------------------------------------------------------


def test_a_near_one_agreement_does_not_print_as_exactly_one():
    from parity.render.report_page import key_value_table

    summary = {"router_agreement": 0.9999997, "is_ratio_mean": 1.0000003, "exact": 1.0, "k3_kl": 1.5e-9}
    table = key_value_table(summary)
    assert "<td>0.9999997</td>" in table and "<td>1.0000003</td>" in table  # were both "1"
    assert "<td>1</td>" in table and "<td>1.5e-09</td>" in table
    text = format_summary(_report([[-1.0]], [[-1.0]], summary=summary))
    assert "0.9999997" in text and "1.0000003" in text


def test_near_one_distribution_and_gold_figures_keep_their_difference():
    from parity.render.distribution import _value as distribution_value
    from parity.render.gold import _value as gold_value

    assert distribution_value(0.99996) == "0.99996"  # was "1": one argmax of 25,000 disagreeing
    assert distribution_value(0.5) == "0.5" and distribution_value(1.0) == "1"
    assert gold_value([1.00002, 0.25]) == "[1.00002, 0.25]"


def test_an_undefined_kl_is_a_gap_and_an_infinite_one_is_counted():
    from parity.render.distribution import KL_CEILING, KL_FLOOR, kl_position_figure

    fig = kl_position_figure([0.1, float("nan"), float("inf")], [0.0, float("nan"), 0.2])
    ax = fig.axes[0]
    forward, backward = (np.asarray(line.get_ydata(), float) for line in ax.get_lines())
    assert np.isnan(forward[1]) and np.isnan(backward[1])  # were drawn at the floor, as agreement
    assert forward[2] == KL_CEILING and backward[0] == KL_FLOOR
    assert "1 infinite" in ax.get_title() and "2 undefined" in ax.get_title()
    assert "infinite" not in kl_position_figure([0.1], [0.2]).axes[0].get_title()


def test_a_nonzero_share_differing_is_not_printed_as_zero():
    from parity.render.attribution import _ENGINE_COLUMNS, _OPS_COLUMNS, percent

    share = dict(_ENGINE_COLUMNS)["share differing"]
    assert share({"share": 3 / 10_000_000}) == "<0.01%"  # was "0.00%" beside a nonzero max|Δ|
    assert share({"share": 0.0}) == "0.00%" and share({"share": 1.0}) == "100.00%"
    assert share({"share": 0.25}) == "25.00%" and share({"share": 1 - 1e-9}) == ">99.99%"
    assert dict(_OPS_COLUMNS)["share"]({"share": 1e-4}) == "<0.1%"
    assert percent(0.004, 0) == "<1%"


def test_the_audit_page_keeps_the_gpu_and_isa_names_as_written():
    from parity.render.audit import audit_html

    result = {"backend": "vllm", "model": "m", "dtype": "bfloat16", "deterministic": True,
              "batch_invariant": True,
              "checks": {name: {"skipped": "not asked", "identical": True, "first_difference": None}
                         for name in ("repeat", "batch", "order", "seed")},
              "provenance": {"cpu_isa": "AVX-512", "gpu": "NVIDIA H100 80GB HBM3"}}
    page = audit_html(result)
    assert "(CPU AVX-512, NVIDIA H100 80GB HBM3)" in page  # was "(cpu avx-512, nvidia h100 80gb hbm3)"
    assert "<p>A property of this engine" in page


# -- provenance ---------------------------------------------------------------------------------


def test_provenance_names_the_gpu_each_side_ran_on(monkeypatch):
    from parity.report.provenance import gpu_model

    names = {"cuda:0": "NVIDIA A100", "cuda:1": "NVIDIA H100", "cuda": "NVIDIA A100"}

    def get_device_name(device: str) -> str:
        if device not in names:
            raise AssertionError("Invalid device id")
        return names[device]

    cuda = types.SimpleNamespace(is_available=lambda: True, get_device_name=get_device_name)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    assert gpu_model("cuda:1", None) == "NVIDIA H100"  # was GPU 0's name, the A100
    assert gpu_model("cuda:0", "cuda:1") == "NVIDIA A100 + NVIDIA H100"
    assert gpu_model("cuda:1", "cuda:1") == "NVIDIA H100"
    assert gpu_model("cuda", None) == "NVIDIA A100"
    assert gpu_model("cpu", None) is None
    assert gpu_model("cuda:0", "cuda:7") == "NVIDIA A100"  # a device this process does not see is left out


def test_the_histogram_does_not_call_tokens_outside_a_support_identical():
    from parity.render.figures import log_ratio_histogram

    title = log_ratio_histogram(np.array([0.0, 0.0, np.inf])).axes[0].get_title()
    assert "1 non-finite" in title and "all identical" not in title  # was "..., all identical"
    assert "the finite ones identical" in title
    assert "all identical" in log_ratio_histogram(np.zeros(3)).axes[0].get_title()
