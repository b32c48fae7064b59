"""The `parity` command: help everywhere (instant: no torch before parsing), the shared frame every
command runs in, models, backends, the dispatch table, and the compare acceptance runs (reference
exact, HF bf16 drift; vLLM CPU within its default tolerance is in tests/test_backends_vllm.py, on the
session's MoE engine)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from parity.backends import route_capture_options
from parity.cli import COMMANDS, main
from parity.core.errors import ConfigError
from parity.report.document import ParityReport
from parity.runtime.frame import run_command

ROOT = Path(__file__).resolve().parent.parent
MOE = "tiny-qwen3-moe"

#: modules that must not load before a command's arguments are parsed (as tests/test_layers.py's HEAVY).
HEAVY = ("torch", "transformers", "vllm", "sglang", "tensorrt_llm", "triton")


@pytest.mark.parametrize("argv", [["--help"], *([name, "--help"] for name in COMMANDS)])
def test_help_everywhere(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    assert f"usage: parity {argv[0] if len(argv) > 1 else ''}".strip() in capsys.readouterr().out


def test_version_prints_the_package_version(capsys):
    from parity.core.schema import VERSION

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"parity {VERSION}\n"


def test_top_level_help_lists_every_subcommand(capsys):
    """One line per command: its name and its help line from the table."""
    with pytest.raises(SystemExit):
        main(["--help"])
    lines = capsys.readouterr().out.splitlines()
    for command, (_, text) in COMMANDS.items():
        assert any(line.split() == [command, *text.split()] for line in lines), (command, lines)


def help_probe(argv: list[str], before: str = "") -> tuple[str, list[str]]:
    """Run `parity ARGV` in a fresh interpreter (after the code `before`): its stdout and the HEAVY
    modules loaded by the time it exited."""
    code = (f"{before}\nimport sys\nfrom parity.cli import main\ntry:\n    main({argv!r})\n"
            f"except SystemExit as e:\n    assert e.code == 0, e.code\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    *out, loaded = result.stdout.strip().splitlines()
    return "\n".join(out), json.loads(loaded.replace("'", '"'))


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.slow
def test_help_of_every_command_loads_no_torch(command):
    """`parity X --help` parses before any heavy import: nothing of HEAVY is loaded, in a fresh
    interpreter; and the help is the frame's (it lists --verbose, which the frame adds)."""
    out, loaded = help_probe([command, "--help"])
    assert loaded == [] and f"usage: parity {command}" in out and "--verbose" in out


@pytest.mark.slow
def test_the_help_probe_sees_torch_when_it_is_loaded():
    """Negative control: the same probe reports torch when the interpreter loaded it (torch alone:
    a parity module that imports it also loaded transformers, 2x the child's time)."""
    assert "torch" in help_probe(["attribute", "--help"], before="import torch")[1]


def test_the_frame_turns_every_failure_into_an_exit_code(capsys):
    """ParityError: exit 2 with its message; anything else: one line and the --verbose hint (the
    traceback with --verbose); Ctrl-C: 130; the body's own code otherwise."""
    def failing(exc: BaseException):
        def body(args: argparse.Namespace) -> int:
            raise exc
        return body
    parser = argparse.ArgumentParser
    assert run_command("parity x", [], parser(prog="parity x"), lambda args: 7) == 7
    assert run_command("parity x", [], parser(), failing(ConfigError("--y: give 3"))) == 2
    assert capsys.readouterr().err == "parity x: error: --y: give 3\n"
    assert run_command("parity x", [], parser(), failing(RuntimeError("boom\nmore"))) == 2
    assert capsys.readouterr().err == ("parity x: error: RuntimeError: boom (run with --verbose for the "
                                       "traceback)\n")
    assert run_command("parity x", ["--verbose"], parser(), failing(RuntimeError("boom"))) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.endswith("parity x: error: RuntimeError: boom\n")
    assert run_command("parity x", [], parser(), failing(KeyboardInterrupt())) == 130
    assert capsys.readouterr().err == "parity x: interrupted\n"


#: arguments each command's parser accepts (the body is replaced: nothing runs).
PARSES = {"compare": ["--backend", "hf"], "score": ["s.jsonl"], "advise": ["r.json"], "nightly": [],
          "replay": ["r.jsonl", "--backend", "hf"], "attribute": [], "lifecycle": ["--backend", "hf"],
          "monitor": ["d"], "loop": ["--model", "m"], "audit": ["--backend", "hf"]}


@pytest.mark.parametrize("command", PARSES)
@pytest.mark.slow
def test_a_closed_pipe_ends_every_command_quietly(command):
    """`parity X ... | head`: the frame's quiet exit 141, no traceback, reached through the command's
    own `main` (its body replaced by one that writes more than a pipe buffers)."""
    module, func = COMMANDS[command][0].split(":")
    child = (f"import importlib, sys; m = importlib.import_module({module!r}); "
             f"m._run = lambda args: [print('x' * 99) for _ in range(10**5)]; "
             f"sys.exit(m.{func}({PARSES[command]!r}))")
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=ROOT)
    proc.stdout.close()  # the reader goes away
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141 and err == "", err[-3000:]


def test_models_lists_builtin_checkpoints(capsys):
    from parity.models import builtin_names

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in builtin_names():
        assert name in out


def test_models_says_where_each_checkpoint_lives(capsys, tmp_path, monkeypatch):
    """Every model's line is followed by its directory under $PARITY_CACHE; one not made yet says
    when it will be (nothing is generated by listing)."""
    from parity.models import (
        BUILTIN_MODELS,
        TRAINED_MODELS,
        builtin_path,
        cache_dir,
        resolve_model,
        trained_dir,
    )

    def made() -> dict[str, bool]:
        return {name: (builtin_path(name) / "config.json").is_file() for name in BUILTIN_MODELS}

    resolve_model("tiny-llama")  # one cached for sure; others may not be made yet in a fresh cache
    before = made()
    assert main(["models"]) == 0
    after = made()  # the other xdist worker may generate a model meanwhile: either line is then right
    lines = capsys.readouterr().out.splitlines()
    for name in BUILTIN_MODELS:
        at = lines[next(i for i, line in enumerate(lines) if line.startswith(name + " ")) + 1].strip()
        allowed = {f"at {builtin_path(name)}" + ("" if m else " (generated on first use)")
                   for m in (before[name], after[name])}
        assert at in allowed
    assert (builtin_path("tiny-llama") / "config.json").is_file()
    for name in TRAINED_MODELS:
        at = lines[next(i for i, line in enumerate(lines) if line.startswith(name + " ")) + 1].strip()
        assert at.startswith(f"at {trained_dir(name, cache_dir())}")
    monkeypatch.setenv("PARITY_CACHE", str(tmp_path))
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"checkpoints live in {tmp_path / 'models'} (set PARITY_CACHE to move them)"
    assert f"at {tmp_path / 'models' / 'tiny-llama-v'}" in out and "(generated on first use)" in out
    assert not (tmp_path / "models").exists()  # listing made nothing


def test_backends_lists_availability(capsys):
    from parity.backends import available_backends

    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    for name, reason in available_backends().items():
        line = next(line for line in out.splitlines() if line.startswith(name + " "))
        assert ("[available]" in line) == (reason is None)


def test_dispatch_hands_argv_to_the_command(monkeypatch, capsys):
    """The arguments after the name, unchanged; --verbose from anywhere on the line goes last."""
    module = type(sys)("fake_attribute_command")
    seen = []
    module.main = lambda argv: seen.append(argv) or 3
    monkeypatch.setitem(sys.modules, "parity.attribute.command", module)
    assert main(["attribute", "--help", "x"]) == 3
    assert main(["--verbose", "attribute", "x"]) == 3
    assert seen == [["--help", "x"], ["x", "--verbose"]]


def test_a_command_missing_from_the_build_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(COMMANDS, "replay", ("parity.no_such_module:main", "replay"))
    assert main(["replay", "r.jsonl"]) == 2
    assert "`parity replay` is not available" in capsys.readouterr().err


def test_bad_input_exits_2_without_traceback(capsys):
    assert main(["compare", "--model", "no-such-model", "--backend", "reference"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("parity: error: ") and "no-such-model" in err and "Traceback" not in err
    assert main(["compare", "--model", "tiny-llama", "--backend", "nope"]) == 2
    assert "unknown backend 'nope'" in capsys.readouterr().err


@pytest.mark.slow
def test_compare_reference_is_exact(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["compare", "--model", MOE, "--backend", "reference", "--json", str(out)]) == 0
    report = ParityReport.from_json(out.read_text())
    assert report.passed and report.summary["max_abs_logprob_diff"] == 0.0
    assert report.summary["num_tokens"] > 0
    out = capsys.readouterr().out
    assert "parity PASS" in out and f"all {report.num_tokens} tokens identical" in out


@pytest.mark.slow
def test_compare_a_case_file_takes_its_model(tmp_path):
    out = tmp_path / "s.json"
    assert main(["compare", "--case", str(ROOT / "cases" / "smoke.toml"), "--backend", "reference",
                 "--json", str(out)]) == 0
    report = ParityReport.from_json(out.read_text())
    assert report.provenance["case"] == "smoke" and report.provenance["model"] == "tiny-llama"


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_compare_hf_bf16_reports_drift(tmp_path, capsys):
    out = tmp_path / "h.json"
    code = main(["compare", "--model", MOE, "--backend", "hf", "--dtype", "bfloat16", "--json", str(out)])
    assert code == 0, capsys.readouterr().err  # drift (max ~0.79 nats, mean ~0.018) within the default limits
    report = ParityReport.from_json(out.read_text())
    assert report.passed and report.summary["max_abs_logprob_diff"] > 0.0
    assert report.provenance["dtype"] == "bfloat16" and report.provenance["backend"] == "hf"
