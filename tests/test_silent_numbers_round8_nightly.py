"""Nightly numbers a user would read wrong without a word (round 8): one run id holding rows of two
matrices, two case versions or two installs; a row counted twice; a named baseline that was never
compared; verdicts that depended on which row a parallel executor finished first; a run of no row
that passed; `latest` moved back to an older run. Engines are the fakes of `test_nightly_runner`.
"""

from __future__ import annotations

import importlib
import json
import os
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest
from test_nightly_runner import (
    AUDIT_CASE,
    audited_engine,
    fake_audit,
    install,
    leave_figures_undrawn,
    shifted_compare,
    write_cases,
)

from parity.core.errors import ConfigError
from parity.nightly import execute, main, runner
from parity.nightly.history import History
from parity.nightly.markdown_report import render_summary
from parity.nightly.rows import BASELINE_SKIPPED, RowKey, RowResult
from parity.nightly.runner import NightlyConfig, judge_row


@pytest.fixture
def ws(tmp_path, monkeypatch):
    install(runner, patch=monkeypatch.setattr)
    leave_figures_undrawn(monkeypatch.setattr)
    cases = write_cases(tmp_path)
    out = tmp_path / "reports"

    def nightly(*args: str, case: str = "alpha.toml") -> int:
        return main(["--cases", str(cases / case), "--out", str(out), "--no-progress", *args])

    def resume(run_id: str) -> int:
        return main(["--resume", run_id, "--out", str(out), "--no-progress"])

    def rows(run_id: str) -> dict[str, dict]:
        return {r["key"]: r for r in json.loads((out / run_id / "results.json").read_text())["rows"]}

    def interrupt_on(backend: str) -> None:
        """The next run stops (Ctrl-C) when it reaches a `backend` row."""
        real = execute.compare

        def compare(model, engine, **kw):
            if engine.name == backend:
                monkeypatch.setattr(execute, "compare", real)
                raise KeyboardInterrupt
            return real(model, engine, **kw)
        monkeypatch.setattr(execute, "compare", compare)

    return types.SimpleNamespace(cases=cases, out=out, nightly=nightly, resume=resume, rows=rows,
                                 interrupt_on=interrupt_on)


def test_a_stored_run_id_is_not_continued_with_other_options(ws, capsys):
    assert ws.nightly("--backends", "hf", "--run-id", "n1") == 0
    assert ws.nightly("--backends", "hf", "--run-id", "n1") == 0  # the same options continue it
    # was: exit 0, a vllm row with native kernels inside a run whose stored options say hf / invariant
    assert ws.nightly("--backends", "hf,vllm", "--reference", "native", "--run-id", "n1") == 2
    err = capsys.readouterr().err
    assert "reference 'invariant' → 'native'" in err and "--resume n1" in err
    assert list(ws.rows("n1")) == ["alpha|hf|bfloat16|"]


def test_a_resume_after_the_case_was_edited_is_refused(ws, capsys):
    ws.interrupt_on("vllm")
    assert ws.nightly("--backends", "hf,vllm", "--run-id", "n1") == 130
    alpha = ws.cases / "alpha.toml"
    alpha.write_text(alpha.read_text().replace("max_tokens = 40", "max_tokens = 400"))
    # was: exit 0, the hf row of 160 tokens and the vllm row of 1600 under one run and one case name
    assert ws.resume("n1") == 2
    assert "case 'alpha' changed since its row alpha / hf / bfloat16 ran" in capsys.readouterr().err
    alpha.write_text(alpha.read_text().replace("max_tokens = 400", "max_tokens = 40"))
    assert ws.resume("n1") == 0 and len(ws.rows("n1")) == 2  # the case restored: it finishes


def test_a_resume_after_a_package_upgrade_is_refused(ws, capsys, monkeypatch):
    env = {"versions": {"vllm": "0.6.0", "torch": "2.4.0"}}
    monkeypatch.setattr(runner, "collect_environment", lambda: json.loads(json.dumps(env)))
    ws.interrupt_on("vllm")
    assert ws.nightly("--backends", "hf,vllm", "--run-id", "n1") == 130
    env["versions"]["vllm"] = "0.7.0"
    # was: exit 0, rows of both vLLM versions in one run whose page names 0.6.0
    assert ws.resume("n1") == 2
    assert "vllm 0.6.0 → 0.7.0" in capsys.readouterr().err


@pytest.mark.parametrize(("backends", "dtypes", "message"), [
    (("hf", "hf"), (), "--backends has 'hf' twice"),
    (("hf",), ("float32", "float32"), "--dtypes has 'float32' twice"),
])
def test_a_backend_or_dtype_given_twice_is_refused(tmp_path, backends, dtypes, message):
    # was: every row run 2-4 times, the page counting "4 pass" for one stored row
    with pytest.raises(ConfigError, match=message):
        NightlyConfig(cases="x", backends=backends, dtypes=dtypes, out=tmp_path, device="cpu")


def test_a_named_baseline_without_the_row_says_so(tmp_path):
    key, other = RowKey("smoke", "hf", "float32"), RowKey("smoke", "hf", "bfloat16")
    prov = {"case_hash": "a", "model": "m", "model_hash": "h"}
    with History(tmp_path / "h.sqlite") as h:
        h.start_run("r1", {}, {})
        h.add_row(RowResult("r1", other, "pass", provenance=prov, abs_diff=np.ones(5)))
        h.add_row(RowResult("r1", RowKey("smoke", "vllm", "float32"), "error", provenance=prov))
        h.start_run("r2", {}, {})
        config = NightlyConfig(cases="x", backends=("hf",), out=tmp_path, device="cpu", baseline="r1")
        compare = types.SimpleNamespace(kind="compare")
        judged = judge_row(RowResult("r2", key, "pass", provenance=prov, abs_diff=np.ones(5)), compare,
                           config, h)
        # was: no note; the page said "No baseline row yet: this run becomes the baseline if it passes"
        assert judged.verdict is None
        note = judged.provenance[BASELINE_SKIPPED]
        assert note == "not compared with r1: it has no row smoke / hf / float32"
        assert "not compared with r1" in render_summary(h.run("r2"), [judged])
        errored = judge_row(RowResult("r2", RowKey("smoke", "vllm", "float32"), "pass", provenance=prov,
                                      abs_diff=np.ones(5)), compare, config, h)
        assert errored.provenance[BASELINE_SKIPPED] == "not compared with r1: its row is an error"
        # with no baseline named, a first row stays the quiet "no baseline yet"
        auto = NightlyConfig(cases="x", backends=("hf",), out=tmp_path, device="cpu")
        assert BASELINE_SKIPPED not in judge_row(RowResult("r2", key, "pass", provenance=prov,
                                                           abs_diff=np.ones(5)), compare, auto, h).provenance


def test_rows_back_before_their_audit_are_judged_against_its_noise(ws, monkeypatch):
    (ws.cases / "noise.toml").write_text(textwrap.dedent(AUDIT_CASE))
    monkeypatch.setattr(execute, "shared_backend", audited_engine)
    monkeypatch.setattr(importlib.import_module("parity.audit"), "audit", fake_audit({"hf": 1}))
    local = runner.executor_rows
    # a parallel executor (Ray) may finish the audit rows last: here they come back last
    monkeypatch.setattr(runner, "executor_rows", lambda *a: iter(reversed(list(local(*a)))))
    spec = f"{ws.cases}/alpha.toml,{ws.cases}/noise.toml"
    for run_id, shift in (("n1", {}), ("n2", {"hf": 0.01, "reference": 1e-6})):
        monkeypatch.setattr(execute, "compare", shifted_compare(shift))
        code = main(["--cases", spec, "--backends", "reference,hf", "--out", str(ws.out), "--run-id", run_id,
                     "--no-progress"])
    rows = ws.rows("n2")
    hf, ref = rows["alpha|hf|bfloat16|"], rows["alpha|reference|bfloat16|"]
    # was: hf "regression" (its 0.01 nats lie within its 0.05 of repeat noise) and the deterministic
    # reference's move "unchanged": the verdicts the in-order run gives the other way round
    assert hf["verdict"]["change"] == "noise" and hf["status"] == "pass"
    assert ref["verdict"]["change"] == "changed" and ref["status"] == "regression" and code == 1
    assert hf["summary"]["noise_mean_abs_logprob_diff"] == 0.05


def test_a_matrix_of_no_row_is_refused(ws, capsys):
    # beta runs on reference and hf only: was exit 0, "no rows", a green nightly that checked nothing
    assert ws.nightly("--backends", "vllm", case="beta.toml") == 2
    err = capsys.readouterr().err
    assert "no row to run" in err and "'beta': ['reference', 'hf']" in err
    assert not (ws.out / "latest").exists()


def test_resuming_an_older_run_leaves_latest_on_the_newer_one(ws):
    ws.interrupt_on("vllm")
    assert ws.nightly("--backends", "hf,vllm", "--run-id", "mon") == 130
    assert ws.nightly("--backends", "hf,vllm", "--run-id", "tue") == 0
    assert ws.resume("mon") == 0 and (ws.out / "mon" / "results.json").is_file()
    # was: latest -> mon, Monday's numbers shown as the newest
    assert os.readlink(ws.out / "latest") == "tue"
    assert Path(ws.out / "latest" / "results.json").is_file()
