"""The resume logic of `python3 -m benchmarks.gpu_backends` (on CPU: no section runs for real).

A section is marked done only when it returns; one that raises (or a run killed at the call's
limit) stays pending with the rows it kept, and the next run starts at its next row."""

import argparse
import json
import time

import pytest

from benchmarks.gpu_backends import SECTIONS, markdown, parse_args, run_sections
from benchmarks.gpu_checks import AUDIT_ROWS, junit_outcomes
from benchmarks.gpu_ledger import Deadline, DeadlineReached, Ledger, pending


def _args(tmp_path, sections):
    return argparse.Namespace(out=tmp_path / "out", sections=sections)


def test_a_done_section_is_skipped_and_a_failed_one_resumes(tmp_path):
    ledger = Ledger(tmp_path / "state")
    calls = []

    def ok():
        calls.append("install")
        return {"vllm": "0.23.0"}

    def flaky():
        calls.append("tests")
        if calls.count("tests") == 1:
            raise RuntimeError("killed at the call limit")
        return [{"file": "tests/test_vllm_gpu.py", "summary": "9 passed", "seconds": 1.0}]

    runners = {"install": ok, "tests": flaky}
    first = run_sections(_args(tmp_path, ["install", "tests"]), ledger, runners, {"device": "cpu"})
    assert first["pending"] == ["tests"] and calls == ["install", "tests"]
    second = run_sections(_args(tmp_path, ["install", "tests"]), ledger, runners, {"device": "cpu"})
    assert second["pending"] == [] and calls == ["install", "tests", "tests"]  # install not run again
    saved = json.loads((tmp_path / "out" / "gpu_backends.json").read_text())
    assert saved["sections"]["install"] == {"vllm": "0.23.0"}
    assert "9 passed" in (tmp_path / "out" / "gpu_backends.md").read_text()
    # the control: a fresh ledger (another machine) runs everything again
    run_sections(_args(tmp_path, ["install", "tests"]), Ledger(tmp_path / "other"), runners, {})
    assert calls.count("install") == 2


def test_rows_kept_before_a_kill_are_not_run_again(tmp_path):
    ledger = Ledger(tmp_path / "state")
    measured = []

    def section(limit):
        for key in ("order 1: parity", "order 1: vllm", "order 2: vllm", "order 2: parity"):
            if key in ledger.rows("throughput"):
                continue
            if len(measured) == limit:
                raise TimeoutError("call limit")
            measured.append(key)
            ledger.keep("throughput", key, {"run": key, "side": key.split(": ")[1], "output_tok_s": 1e4,
                                            "seconds": 6.0})
        return list(ledger.rows("throughput").values())

    args = _args(tmp_path, ["throughput"])
    assert run_sections(args, ledger, {"throughput": lambda: section(2)}, {})["pending"] == ["throughput"]
    assert len(ledger.result("throughput")) == 2  # the partial rows are in the results
    done = run_sections(args, ledger, {"throughput": lambda: section(99)}, {})
    assert done["pending"] == [] and len(measured) == 4 and len(set(measured)) == 4
    assert "| order 2: vllm | 10,000 |  |  |  | 1.00 |" in markdown(done["sections"])
    ledger.forget(["throughput"])  # --redo
    assert pending(["throughput"], ledger) == ["throughput"] and ledger.rows("throughput") == {}


def test_a_done_section_runs_the_rows_a_later_call_adds(tmp_path):
    # a call asked the audit for one row and finished; the next asks for another on the same machine
    ledger = Ledger(tmp_path / "state")
    ran = []

    def audit(keys):
        for key in keys:
            if key not in ledger.rows("audit"):
                ran.append(key)
                ledger.keep("audit", key, {"row": key})
        return [ledger.rows("audit")[k] for k in keys]

    run_sections(_args(tmp_path, ["audit"]), ledger, {"audit": lambda: audit(["tiny-qwen3 on"])}, {})
    later = run_sections(_args(tmp_path, ["audit"]), ledger, {"audit": lambda: audit(["q28 on"])}, {})
    assert ran == ["tiny-qwen3 on", "q28 on"] and later["sections"]["audit"] == [{"row": "q28 on"}]
    assert later["pending"] == []


def test_sections_and_audit_rows_render():
    args = parse_args([])
    assert args.sections == list(SECTIONS) and args.order == ["parity", "vllm", "vllm-bi"]
    row = {"row": "q28 on", "deterministic": False, "batch_invariant": False, "attention_backend": "auto",
           "cudagraph_mode": "FULL_AND_PIECEWISE",
           "checks": {"repeat": {"differing": 1, "requests": 8, "max_abs_logprob_diff": 9.54e-07,
                                 "skipped": None},
                      "prefix_cache": {"differing": 0, "requests": 8, "max_abs_logprob_diff": 0.0,
                                       "skipped": None}}}
    table = markdown({"audit": [row, {"row": "q28 on, attention FLASHINFER", "error": ["not valid"]}]})
    assert "| q28 on | False | False | auto | FULL_AND_PIECEWISE | 1/8, 9.5e-07 |" in table
    assert "identical" in table and "error: not valid" in table
    with pytest.raises(SystemExit):
        parse_args(["--sections", "nope"])


def test_junit_outcomes_name_each_test(tmp_path):
    report = tmp_path / "r.xml"
    report.write_text('<testsuites><testsuite><testcase name="a"/><testcase name="b"><failure/></testcase>'
                      '<testcase name="c"><skipped/></testcase></testsuite></testsuites>')
    assert junit_outcomes(report) == {"a": "passed", "b": "failed", "c": "skipped"}
    assert all(key in AUDIT_ROWS for key in ("q28 on", "q28 off", "tiny-qwen3 on", "q28 on, enforce_eager"))


def test_a_passed_deadline_starts_no_section_and_leaves_it_pending(tmp_path):
    ledger = Ledger(tmp_path / "state")
    ran = []
    runners = {"install": lambda: ran.append("install") or {"vllm": "0.23.0"},
               "drift": lambda: ran.append("drift") or []}
    args = _args(tmp_path, ["install", "drift"])
    args.clock = Deadline(0.0, time.monotonic())  # spent before the first section
    assert run_sections(args, ledger, runners, {})["pending"] == ["install", "drift"] and ran == []
    # the control: the same run with time left runs both, and a later one skips them
    args.clock = Deadline(None, time.monotonic())
    assert run_sections(args, ledger, runners, {})["pending"] == [] and ran == ["install", "drift"]
    assert Deadline(None, 0.0).left() == float("inf")


def test_a_deadline_inside_a_section_keeps_its_rows(tmp_path):
    ledger = Ledger(tmp_path / "state")
    clock = {"left": 2}

    def section():
        for key in ("a", "b", "c"):
            if key in ledger.rows("drift"):
                continue
            if clock["left"] == 0:
                raise DeadlineReached(f"deadline reached before drift row {key}")
            clock["left"] -= 1
            ledger.keep("drift", key, {"model": key, "setting": "bf16", "error": "not run on CPU"})
        return list(ledger.rows("drift").values())

    args = _args(tmp_path, ["drift"])
    assert run_sections(args, ledger, {"drift": section}, {})["pending"] == ["drift"]
    assert list(ledger.rows("drift")) == ["a", "b"]
    clock["left"] = 5
    assert run_sections(args, ledger, {"drift": section}, {})["pending"] == [] and clock["left"] == 4


def test_throughput_rows_render_their_runs_spread_and_setup():
    row = {"run": "order 1: parity", "side": "parity", "output_tok_s": 20000.0,
           "runs_tok_s": [19800, 20000, 20400], "spread": 0.03, "setup_s": 41.5, "seconds": 6.5}
    table = markdown({"throughput": [row]})
    assert "| order 1: parity | 20,000 | 19,800, 20,000, 20,400 | 3.0% | 41.5 | 1.00 |" in table
    args = parse_args(["--deadline", "300", "--repeats", "2", "--settings", "bf16,bf16 R3"])
    assert args.repeats == 2 and args.settings == ["bf16", "bf16 R3"] and 299 < args.clock.left() <= 300
    with pytest.raises(SystemExit):
        parse_args(["--repeats", "0"])


def test_each_drift_row_runs_in_its_own_process_and_a_failed_row_runs_again(tmp_path, monkeypatch):
    import benchmarks.gpu_backends as gb

    monkeypatch.setattr(gb, "_shaped", lambda state, shape, layers: f"/models/{shape}-{layers}")
    args = parse_args(["--state", str(tmp_path / "state"), "--models", "qwen3-1.7b x28,qwen3-30b-a3b x4",
                       "--settings", "bf16,bf16 R3"])
    keys = [plan.key for plan in gb.drift_plan(args)]
    assert keys == ["qwen3-1.7b x28 | bf16", "qwen3-30b-a3b x4 | bf16", "qwen3-30b-a3b x4 | bf16 R3"]
    children = []

    def child(cmd, fallback):
        key = cmd[cmd.index("--drift-row") + 1]
        children.append(key)
        if key.endswith("R3") and children.count(key) == 1:  # the first try finds no GPU memory
            return {**fallback, "error": "BackendError: vLLM would take gpu_memory_utilization=0.5"}
        return {**fallback, "max_abs_logprob_diff": 0.1, "mean_abs_logprob_diff": 0.02, "k3_kl": 5e-4,
                "tokens": 1536, "router_agreement": 1.0 if "R3" in key else None, "seconds": 60.0}

    monkeypatch.setattr(gb, "_child_row", child)
    ledger = Ledger(args.state)
    gb.drift_section(args, ledger)
    assert children == keys and "error" in ledger.rows("drift")[keys[2]]
    gb.drift_section(args, ledger)  # the resume: only the failed row runs again
    assert children == [*keys, keys[2]] and "error" not in ledger.rows("drift")[keys[2]]
    assert "| qwen3-30b-a3b x4 | bf16 R3 | 0.1000 | 0.02000 | 5.00e-04 | 1536 | 1.0000 | 60 |" in \
        markdown({"drift": gb.drift_section(args, ledger)})
    assert children == [*keys, keys[2]]  # the control: nothing left to run


def test_a_child_that_fails_gives_its_last_line_as_the_error():
    from benchmarks.gpu_backends import _child_row

    row = _child_row(["--repeats", "0"], {"side": "parity"})
    assert row["side"] == "parity" and "--repeats must be at least 1" in row["error"]


def test_a_failed_row_keeps_the_engine_cores_root_cause():
    from benchmarks.gpu_checks import failure

    output = ("INFO engine starting\n(EngineCore_DP0 pid=7) ValueError: Free memory on device "
              "(40.1/139.8 GiB) is less than desired\nTraceback (most recent call last):\n"
              "parity.core.errors.BackendError: vLLM engine failed to start: See root cause above.")
    assert failure(output).startswith("(EngineCore_DP0 pid=7) ValueError: Free memory on device")
    assert failure(output).endswith("See root cause above.")
    assert failure("only one line") == "only one line"
    assert failure("") == "(no output)"


def test_probe_rows_resume_and_are_tabled(tmp_path, monkeypatch):
    """The probe section keeps each row as it finishes, skips kept rows without an error, runs a
    row kept with an error again, and tables an engine diff per phase (no engine: rows stubbed)."""
    import benchmarks.gpu_probe as gp

    engine = {"side_a": "a", "side_b": "b", "parted": 0, "sequences": [0, 1], "positions": {"prefill": 4},
              "phases": [{"phase": "prefill", "first_differing": "layer.0.attn", "growth": 2.0,
                          "stages": [{"stage": "layer.0", "rel_error": 0.01, "share": 0.5, "max_abs": 0.1},
                                     {"stage": "layer.1", "rel_error": 0.02, "share": 0.6, "max_abs": 0.2},
                                     {"stage": "logits", "rel_error": 0.03, "share": 0.7, "max_abs": 0.3}]}]}
    ran = []

    def attribute_row(model, extra, json_path, html_path):
        ran.append(model)
        return {"seconds": 1.0, **gp.summary(engine)} if model != "tiny-qwen3" else {"error": ["boom"]}

    monkeypatch.setattr(gp, "_attribute_row", attribute_row)
    args = argparse.Namespace(probe_rows=["all"], state=tmp_path, moe_layers=4,
                              clock=Deadline(None, time.monotonic()))
    ledger = Ledger(tmp_path / "state")
    keys = list(gp.PROBE_ROWS)
    for key in gp.LOGITS_ROWS:  # kept already: not run again
        ledger.keep("probe", key, {"row": key, "seconds": 2.0, "differing": 0, "requests": 8,
                                   "max_abs_logit_diff": 0.0, "attention_backend": ["FLASH_ATTN"]})
    rows = gp.probe_section(args, ledger, lambda state, shape, layers: f"{shape}-{layers}")
    assert ran == ["qwen3-1.7b-28"] * 2 + ["qwen3-30b-a3b-4"] * 2 + ["tiny-qwen3"] * 4
    assert len(rows) == len(keys) + len(gp.LOGITS_ROWS)
    ran.clear()
    gp.probe_section(args, ledger, lambda state, shape, layers: f"{shape}-{layers}")
    assert ran == ["tiny-qwen3"] * 4  # only the rows kept with an error run again
    table = "\n".join(gp.probe_markdown(list(ledger.rows("probe").values())))
    assert "| prefill | layer.0.attn | x2.0 | 2.00e-02 | 3.00e-02 | 1 |" in table
    assert "error: boom" in table and "0/8 requests differ, max 0 (raw logit; FLASH_ATTN)" in table


def test_the_raw_audit_row_runs_the_built_in_case_in_raw_mode(tmp_path, monkeypatch):
    import types

    import benchmarks.gpu_checks as gc
    from parity.workload.cases import load_case

    seen = []

    def fake(cmd, json_path):
        seen.append(cmd)
        return {}, None, types.SimpleNamespace(stderr="stopped", stdout="")

    monkeypatch.setattr(gc, "run_json_command", fake)
    model, options = AUDIT_ROWS["tiny-qwen3 on, raw logprobs"]
    gc._audit_row(model, options, tmp_path / "audit.json")
    gc._audit_row(*AUDIT_ROWS["tiny-qwen3 on"], tmp_path / "on.json")
    raw, on = seen
    case = load_case(raw[raw.index("--case") + 1])
    assert {r.sampling.logprobs_mode for r in case.requests} == {"raw"} and "logprobs_mode=raw" in raw
    assert "--case" not in on  # the other rows keep the audit's built-in (processed) case
