"""The `parity` command: help everywhere, models, backends, passthrough subcommands, and the
compare acceptance runs (reference exact, vLLM CPU within its default tolerance, HF bf16 drift)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from parity.backends import route_capture_options
from parity.cli import PASSTHROUGH, main
from parity.report import ParityReport

ROOT = Path(__file__).resolve().parent.parent
MOE = "tiny-qwen3-moe"



COMMANDS = ("compare", "score", "models", "backends", *PASSTHROUGH)


@pytest.mark.parametrize("argv", [["--help"], *([name, "--help"] for name in COMMANDS)])
def test_help_everywhere(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    assert f"usage: parity {argv[0] if len(argv) > 1 else ''}".strip() in capsys.readouterr().out


def test_top_level_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert command in out


def test_models_lists_builtin_checkpoints(capsys):
    from parity.models import builtin_names

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in builtin_names():
        assert name in out


def test_backends_lists_availability(capsys):
    from parity.backends import available_backends

    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    for name, reason in available_backends().items():
        line = next(line for line in out.splitlines() if line.startswith(name + " "))
        assert ("[available]" in line) == (reason is None)


def test_passthrough_hands_argv_to_the_module(monkeypatch, capsys):
    module = type(sys)("fake_attribute")
    seen = []
    module.main = lambda argv: seen.append(argv) or 3
    monkeypatch.setitem(sys.modules, "parity.attribute", module)
    assert main(["attribute", "--help", "x"]) == 3
    assert seen == [["--help", "x"]]


def test_passthrough_missing_module_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(PASSTHROUGH, "replay", ("parity.no_such_module", "replay_main", "replay"))
    assert main(["replay", "r.jsonl"]) == 2
    assert "`parity replay` is not available" in capsys.readouterr().err


def test_bad_input_exits_2_without_traceback(capsys):
    assert main(["compare", "--model", "no-such-model", "--backend", "reference"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("parity: error: ") and "no-such-model" in err and "Traceback" not in err
    assert main(["compare", "--model", "tiny-llama", "--backend", "nope"]) == 2
    assert "unknown backend 'nope'" in capsys.readouterr().err


def test_compare_reference_is_exact(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["compare", "--model", MOE, "--backend", "reference", "--json", str(out)]) == 0
    report = ParityReport.from_json(out.read_text())
    assert report.passed and report.summary["max_abs_logprob_diff"] == 0.0
    assert report.summary["num_tokens"] > 0
    out = capsys.readouterr().out
    assert "parity PASS" in out and f"all {report.num_tokens} tokens identical" in out


def test_compare_a_case_file_takes_its_model(tmp_path):
    out = tmp_path / "s.json"
    assert main(["compare", "--case", str(ROOT / "cases" / "smoke.toml"), "--backend", "reference",
                 "--json", str(out)]) == 0
    report = ParityReport.from_json(out.read_text())
    assert report.provenance["case"] == "smoke" and report.provenance["model"] == "tiny-llama"


def test_router_replay_turns_route_capture_on(tmp_path, capsys):
    """--router-replay starts the backend recording routes: no --option needed, router agreement reported."""
    out = tmp_path / "rr.json"
    argv = ["compare", "--model", MOE, "--backend", "reference", "--router-replay", "R3",
            "--option", "max_num_seqs=32", "--json", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    report = ParityReport.from_json(out.read_text())
    assert report.provenance["router_replay"] == "R3" and report.summary["max_abs_logprob_diff"] == 0.0
    assert report.provenance["backend_meta"]["kernels"] == "invariant"
    assert report.summary["router_agreement"] == 1.0 and report.extras["router"]["replay"] == "R3"


def test_router_replay_on_a_backend_that_cannot_capture(capsys):
    assert main(["compare", "--model", MOE, "--backend", "hf", "--router-replay", "R3"]) == 2
    err = capsys.readouterr().err
    assert "backend 'hf' cannot record MoE routes" in err and "reference, vllm, sglang" in err
    assert route_capture_options("hf", "R2") == {}  # R2 replays the trainer's own pass: runs anywhere
    assert route_capture_options("vllm", "R2") == {"capture_routes": True}
    assert route_capture_options("reference", None) == route_capture_options("reference", "none") == {}


def test_malformed_backend_option_exits_2(capsys):
    assert main(["compare", "--model", MOE, "--backend", "reference", "--option", "record_routes"]) == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["reference", "hf", "vllm"])
def test_unknown_backend_option_exits_2_naming_the_valid_ones(backend, capsys):
    """A typo in --option is a one-line error listing the backend's options, before any engine starts."""
    assert main(["compare", "--model", MOE, "--backend", backend, "--option", "batch_sise=4"]) == 2
    err = capsys.readouterr().err
    assert f"backend '{backend}' has no option 'batch_sise'; its options:" in err and "Traceback" not in err


def test_console_script_exit_code(tmp_path):
    """The installed `parity` entry point, in a fresh process (reference backend: no engine start)."""
    out = tmp_path / "r.json"
    argv = ["compare", "--model", "tiny-llama", "--backend", "reference", "--json", str(out),
            "--html", str(tmp_path / "r.html")]
    result = subprocess.run([str(Path(sys.executable).parent / "parity"), *argv], capture_output=True,
                            text=True, timeout=300, check=False, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(out.read_text())["summary"]["max_abs_logprob_diff"] == 0.0
    assert (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>")


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_compare_vllm_cpu_passes_default_tolerance_with_drift(tmp_path):
    out = tmp_path / "v.json"
    assert main(["compare", "--model", MOE, "--backend", "vllm", "--json", str(out)]) == 0
    report = ParityReport.from_json(out.read_text())
    assert report.passed and report.summary["max_abs_logprob_diff"] > 0.0


def test_compare_hf_bf16_reports_drift(tmp_path, capsys):
    out = tmp_path / "h.json"
    code = main(["compare", "--model", MOE, "--backend", "hf", "--dtype", "bfloat16", "--json", str(out)])
    assert code == 0, capsys.readouterr().err  # drift (max ~0.79 nats, mean ~0.018) within the default limits
    report = ParityReport.from_json(out.read_text())
    assert report.passed and report.summary["max_abs_logprob_diff"] > 0.0
    assert report.provenance["dtype"] == "bfloat16" and report.provenance["backend"] == "hf"
