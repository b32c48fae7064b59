"""`python3 -m benchmarks.gpu_sglang` on CPU: its arguments, the audit's raw case file, the time
budget (no server starts here)."""

import argparse

import pytest

import benchmarks.gpu_sglang as gs


def test_unknown_sections_and_sides_are_refused():
    with pytest.raises(SystemExit):
        gs.parse_args(["--sections", "compare,nope"])
    with pytest.raises(SystemExit):
        gs.parse_args(["--order", "sglang,vllm"])
    args = gs.parse_args(["--workload", "8,16,32", "--budget-s", "400"])
    assert args.workload == (8, 16, 32) and args.budget_s == 400 and args.sections == list(gs.SECTIONS)


def test_the_audit_case_file_is_the_built_in_case_in_raw_mode(tmp_path):
    from parity.workload.cases import default_case, load_case

    raw = load_case(gs.write_audit_case("tiny-llama", tmp_path / "audit.toml"))
    built_in = default_case("tiny-llama")
    assert raw.kind == "audit" and raw.logprobs_mode == "raw"
    assert [r.prompt_ids for r in raw.requests] == [r.prompt_ids for r in built_in.requests]
    assert [r.sampling.replace(logprobs_mode="processed") for r in raw.requests] == \
        [r.sampling for r in built_in.requests]
    assert {r.sampling.logprobs_mode for r in raw.requests} == {"raw"}
    assert {r.sampling.logprobs_mode for r in built_in.requests} == {"processed"}


def test_no_row_starts_once_the_budget_is_spent(monkeypatch):
    gs.check_budget(argparse.Namespace(budget_s=None))
    gs.check_budget(argparse.Namespace(budget_s=3600))
    monkeypatch.setattr(gs, "STARTED", gs.time.monotonic() - 10)
    with pytest.raises(gs.OutOfTime, match="run the same command again"):
        gs.check_budget(argparse.Namespace(budget_s=5))
