"""Verdicts and the words around them, round 9: a KL verdict dropped without a note, advice figures and
page cells that print a near-1 value as exact, a stored report whose PASS/FAIL its own numbers
contradict, an interrupted run that kept quiet about finished rows it must run again, and an audit row
failed for a check that never ran. Rows are built by hand; no engine starts.
"""

from __future__ import annotations

import importlib
import json
import textwrap
import types

import numpy as np
import pytest
from test_nightly_runner import AUDIT_CASE, install, leave_figures_undrawn, write_cases

from parity.advisor.evaluate import Tokens, evaluate
from parity.advisor.grid import default_grid
from parity.core.errors import InputError
from parity.core.schema import ADVICE_COLUMNS, GOLD_RATIO_KEY, advice_cell
from parity.drift.tolerance import Tolerance, Violation
from parity.nightly import main, runner
from parity.nightly.history import RunInfo
from parity.nightly.html_report import _row_section, _rows_table
from parity.nightly.markdown_report import render_summary
from parity.nightly.noise import audit_row
from parity.nightly.regression import (
    DISTRIBUTION_CHANGE_KEY,
    DISTRIBUTION_VERDICT_KEY,
    RegressionPolicy,
    distribution_verdict,
)
from parity.nightly.rows import RowKey, RowResult
from parity.report.document import ParityReport

POLICY = RegressionPolicy()
KEY = RowKey("alpha", "hf", "bfloat16")


def _run() -> RunInfo:
    return RunInfo(run_id="r2", seq=2, created_at="", finished_at=None, config={}, environment={})


# -- the KL verdict --------------------------------------------------------------------------------


def test_a_kl_verdict_against_a_baseline_without_top_k_says_it_was_not_judged():
    current = json.dumps({"extras": {"distribution": {"top_k": 5, "kl_train_engine": [0.1] * 50}}})
    for baseline in (json.dumps({"extras": {}}), None):
        out = distribution_verdict(current, baseline, baseline_run="r1", policy=POLICY)
        # was {}: the row's KL figures stood beside its Δlogp verdict as if the KL had been tested too
        assert DISTRIBUTION_CHANGE_KEY not in out
        assert out[DISTRIBUTION_VERDICT_KEY].startswith("not compared with r1: its row has no full-distrib")
    # a row without a section of its own has no KL to judge: nothing to say
    assert distribution_verdict(json.dumps({"extras": {}}), current, baseline_run="r1", policy=POLICY) == {}
    row = RowResult("r2", KEY, "pass", summary={DISTRIBUTION_VERDICT_KEY: out[DISTRIBUTION_VERDICT_KEY]})
    assert "KL bounds: not compared with r1" in render_summary(_run(), [row])
    assert "KL bounds: not compared with r1" in _row_section(row)
    unchanged = RowResult("r2", KEY, "pass", summary={DISTRIBUTION_CHANGE_KEY: "unchanged",
                                                      DISTRIBUTION_VERDICT_KEY: "unchanged vs r1: ..."})
    assert "KL bounds" not in render_summary(_run(), [unchanged])  # the CI comment stays short


# -- advice figures --------------------------------------------------------------------------------


def test_advice_figures_near_one_print_with_the_digits_that_tell_them_from_one():
    fmt = {key: f for _, _, key, f in ADVICE_COLUMNS}
    # was "1.000": an ESS loss read as none at all; a max weight above 1 read as exactly 1
    assert advice_cell({"ess": 0.99996}, "ess", fmt["ess"]) == "0.99996"
    assert advice_cell({"max_weight": 1.0000001}, "max_weight", fmt["max_weight"]) == "1.0000001"
    assert advice_cell({"ess": 0.000004}, "ess", fmt["ess"]) == "0.000004"
    assert advice_cell({"bias": -3e-300}, "bias", fmt["bias"]) == "-3.00e-300"
    # exact values and ordinary ones keep their short form
    assert advice_cell({"ess": 1.0}, "ess", fmt["ess"]) == "1.000"
    assert advice_cell({"ess": 0.5}, "ess", fmt["ess"]) == "0.500"
    assert advice_cell({"max_weight": 2.0}, "max_weight", fmt["max_weight"]) == "2"


def test_equal_weights_give_an_ess_of_at_most_one_and_no_negative_variance():
    train = np.full((3, 7), -1.0)
    ev = evaluate(Tokens.from_arrays(train, train - 0.1, np.ones((3, 7))), default_grid(), bootstrap=0)
    # were 1.0000000000000002 and -1.8e-15 (printed "-1.78e-15"): the per-sequence sums' rounding
    assert ev.figures["ess"].max() <= 1.0 and ev.figures["weight_var"].min() >= 0.0


# -- a stored report's verdict ---------------------------------------------------------------------


def _report(summary: dict, tolerance: Tolerance) -> ParityReport:
    violations = tolerance.violations(summary)
    return ParityReport(np.full((1, 2), -1.0, np.float32), np.full((1, 2), -1.5, np.float32),
                        np.ones((1, 2), bool), np.array([[5, 6]]), np.array([[7, 8]]), [{"request_id": "r0"}],
                        summary, {}, {}, not violations, tolerance, violations)


def test_a_stored_report_whose_verdict_its_own_numbers_contradict_is_refused():
    summary = {"max_abs_logprob_diff": 0.5, "mean_abs_logprob_diff": 0.5, "is_ratio_mean": 0.61}
    passing = _report(summary, Tolerance(is_ratio_mean_tol=0.5, mean_abs_logprob_diff=1.0))
    assert ParityReport.from_json(passing.to_json()) == passing
    stricter = json.loads(passing.to_json())
    stricter["tolerance"]["max_abs_logprob_diff"] = 0.1  # a limit the stored PASS was not judged by
    # was: read back as PASS with max_abs_logprob_diff 0.5 beside its limit 0.1
    with pytest.raises(InputError, match=r"holds 0, but its tolerance finds 1.*max_abs_logprob_diff = 0.5 > "
                                         r"limit 0.1"):
        ParityReport.from_dict(stricter)
    failing = _report(summary, Tolerance(is_ratio_mean_tol=0.5, mean_abs_logprob_diff=0.1))
    invented = json.loads(failing.to_json())
    invented["violations"][0]["value"] = 0.9  # a violation value that is not the summary's
    with pytest.raises(InputError, match="contradicts its own numbers"):
        ParityReport.from_dict(invented)
    swapped = json.loads(failing.to_json())
    swapped["violations"] = [Violation("k3_kl", 1.0, 0.02)._asdict()]  # FAIL for a check its summary lacks
    swapped["summary"]["k3_kl"] = 0.001
    with pytest.raises(InputError, match="contradicts its own numbers"):
        ParityReport.from_dict(swapped)
    assert ParityReport.from_json(failing.to_json()) == failing


# -- page cells --------------------------------------------------------------------------------------


def test_page_cells_print_an_is_ratio_mean_near_one_with_its_digits():
    row = RowResult("r2", RowKey("alpha", "reference", "float32"), "fail",
                    summary={"is_ratio_mean": 0.99996, "max_abs_logprob_diff": 1.0, "num_tokens": 60})
    table = _rows_table([row])
    # was "1": a FAILing exact-tolerance row whose IS mean read as exactly 1
    assert '<span class="num">0.99996</span>' in table and '<span class="num">1</span>' in table
    gold = RowResult("r2", KEY, "pass", summary={GOLD_RATIO_KEY: 1.00004})
    assert "1.00004" in render_summary(_run(), [gold])


# -- an interrupted run -----------------------------------------------------------------------------


def test_an_interrupt_names_the_finished_rows_that_waited_for_their_audit(tmp_path, monkeypatch, capsys):
    install(runner, patch=monkeypatch.setattr)
    leave_figures_undrawn(monkeypatch.setattr)
    cases = write_cases(tmp_path)
    (cases / "noise.toml").write_text(textwrap.dedent(AUDIT_CASE))

    def ray_like(run_id, todo, config):  # a parallel executor: a compare row back before its audit
        key = next(k for k, case in todo if case.kind != "audit" and k.backend == "hf")
        yield RowResult(run_id, key, "pass", provenance={"model": "tiny-llama", "engine_options": {}},
                        abs_diff=np.full(4, 0.01))
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "executor_rows", ray_like)
    code = main(["--cases", f"{cases}/alpha.toml,{cases}/noise.toml", "--backends", "hf", "--out",
                 str(tmp_path / "out"), "--run-id", "n1", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 130 and "0 finished rows of run n1 are stored" in err
    # was silent: the row finished, was dropped, and the resume ran it again unannounced
    assert "1 more finished but waited for their backend's audit: not stored" in err


# -- audit rows ---------------------------------------------------------------------------------------


def test_an_audit_check_that_did_not_run_is_no_batch_invariance_failure(monkeypatch):
    from parity.audit import CHECKS, AuditResult, CheckResult

    same = CheckResult(identical=True, requests=1, differing_requests=0, first_difference=None,
                       max_abs_logprob_diff=0.0, mean_abs_logprob_diff=0.0)
    differs = CheckResult(identical=False, requests=1, differing_requests=1, first_difference={"what": "x"},
                          max_abs_logprob_diff=0.1, mean_abs_logprob_diff=0.1)

    def audit_of(order: CheckResult):
        def audit(model, engine, *, case, dtype, device):
            checks = {**{n: same for n in CHECKS}, "seed": differs, "order": order}
            return AuditResult(backend=engine.name, model="m", dtype=dtype, provenance={}, checks=checks)
        return audit

    engine = types.SimpleNamespace(name="reference", meta={"batch_invariant": True})
    key, case = RowKey("noise", "reference", "float32"), types.SimpleNamespace(model="m")
    audit_module = importlib.import_module("parity.audit")
    skipped = CheckResult.skip("one request: there is no other order")
    monkeypatch.setattr(audit_module, "audit", audit_of(skipped))
    row = audit_row("r1", key, case, engine, {}, {})
    # was "fail": "requests that differ although the backend is batch-invariant = 0 > limit 0"
    assert row.status == "pass" and row.violations == []
    monkeypatch.setattr(audit_module, "audit", audit_of(differs))  # one that ran and differed still fails
    failed = audit_row("r1", key, case, engine, {}, {})
    assert failed.status == "fail" and failed.violations[0]["value"] == 1.0
