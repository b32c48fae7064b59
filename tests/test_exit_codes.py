"""Exit codes mean what the docs say, and outputs are checked before any work.

Exit 1 is "a tolerance or regression failed" and nothing else: every error (a bad option, a bad
checkpoint, a device that does not exist, an id the model cannot take, an exception from a
backend) is exit 2 with one line on stderr, the traceback only with --verbose, and it comes
before sampling wherever the input alone shows it. Ctrl-C prints one line (for nightly: the
command that finishes the run) and exits 130.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_nightly_runner import fake_compare, install, write_cases

from parity.backends import Backend
from parity.cli import main
from parity.core.errors import ConfigError
from parity.core.types import Request
from parity.models import resolve_model
from parity.nightly import execute, runner
from parity.nightly import main as nightly_main
from parity.rollouts.command import main as replay_main
from parity.rollouts.record import write_record

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


@pytest.fixture
def no_engine(monkeypatch):
    """Any engine start fails the test: the error must come before sampling."""
    def started(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("an engine was started before the input was checked")
    monkeypatch.setattr(sys.modules["parity.compare"], "shared_backend", started)
    monkeypatch.setattr(sys.modules["parity.rollouts.command"], "get_backend", started)


def one_line_error(capsys, prog: str = "parity") -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"{prog}: error: "), err
    return err


def checkpoint(tmp_path: Path, name: str, *, config: str | None = None, weights: bool = True) -> Path:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(config or (resolve_model("tiny-llama") / "config.json").read_text())
    if weights:
        weights_file = resolve_model("tiny-llama") / "model.safetensors"
        (path / "model.safetensors").write_bytes(weights_file.read_bytes())
    return path


def bad_compare_args(tmp_path: Path) -> list[tuple[list[str], str]]:
    oov = tmp_path / "oov.toml"
    oov.write_text('model = "tiny-llama"\n[prompts]\ntoken_ids = [[3, 4, 600]]\n')
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    tiny = ["--model", "tiny-llama", "--backend", "hf"]
    return [
        (["--model", str(checkpoint(tmp_path, "broken", config="{not json")), "--backend", "hf"],
         "not valid JSON"),
        (["--model", str(checkpoint(tmp_path, "no-weights", weights=False)), "--backend", "hf"],
         "no weights"),
        ([*tiny, "--device", "bogus"], "device 'bogus' is not a torch device"),
        ([*tiny, "--device", "cuda:99"], "device 'cuda:99': this machine has"),
        ([*tiny, "--attribute", "nope"], "attribute: unknown axes ['nope']"),
        (["--case", str(oov), "--backend", "hf"], "token id 600, outside the vocabulary"),
        ([*tiny, "--json", str(a_file / "r.json")], "--json"),
        ([*tiny, "--html", str(tmp_path)], "--html"),
    ]


def test_every_error_exits_2_in_one_line_before_sampling(tmp_path, no_engine, capsys):
    for argv, message in bad_compare_args(tmp_path):
        assert main(["compare", *argv]) == 2, argv
        assert message in one_line_error(capsys), argv


def test_a_negative_worst_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as info:
        main(["compare", "--model", "tiny-llama", "--backend", "hf", "--worst", "-1"])
    assert info.value.code == 2 and "--worst" in capsys.readouterr().err


class Exploding(Backend):
    """A backend whose engine fails with a non-parity exception (a bug, a crash in its library)."""

    name = "exploding"

    def generate(self, requests):
        raise RuntimeError("engine exploded\nsecond line of the message")

    def _score(self, pairs, sampling):
        raise AssertionError

    def close(self) -> None:
        pass


def test_an_unexpected_exception_exits_2_and_verbose_shows_the_traceback(monkeypatch, capsys):
    monkeypatch.setattr(sys.modules["parity.compare"], "shared_backend",
                        lambda name, model, **kw: Exploding(model, dtype=kw["dtype"]))
    argv = ["compare", "--model", "tiny-llama", "--backend", "hf"]
    assert main(argv) == 2
    err = one_line_error(capsys)
    assert "RuntimeError: engine exploded" in err and "--verbose" in err
    assert main([*argv, "--verbose"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "in generate" in err
    assert err.strip().splitlines()[-1].startswith("parity: error: RuntimeError: engine exploded")


def test_missing_output_directories_are_created_up_front(tmp_path, monkeypatch):
    made = []

    def records_the_directory(*args: Any, **kwargs: Any) -> None:
        made.append((tmp_path / "new" / "a").is_dir() and (tmp_path / "new" / "b").is_dir())
        raise ConfigError("stop here")
    monkeypatch.setattr(sys.modules["parity.compare"], "shared_backend", records_the_directory)
    argv = ["compare", "--model", "tiny-llama", "--backend", "hf", "--json", str(tmp_path / "new/a/r.json"),
            "--html", str(tmp_path / "new/b/r.html")]
    assert main(argv) == 2
    assert made == [True]


def test_sigint_during_compare_is_one_line_and_exit_130(monkeypatch, capsys):
    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt
    monkeypatch.setattr(sys.modules["parity.compare"], "shared_backend", interrupted)
    assert main(["compare", "--model", "tiny-llama", "--backend", "hf"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "parity: interrupted"


# -- replay ----------------------------------------------------------------------------------------


def test_replay_checks_out_before_starting_a_backend(tmp_path, no_engine, capsys):
    record = write_record(tmp_path / "r.jsonl", [Request((3, 4), request_id="a")], model="tiny-llama")
    (tmp_path / "a-file").write_text("")
    assert replay_main([str(record), "--backend", "hf", "--out", str(tmp_path / "a-file" / "x.jsonl")]) == 2
    assert "--out" in one_line_error(capsys, "parity replay")


def test_replay_exits_2_on_an_unexpected_exception(tmp_path, monkeypatch, capsys):
    record = write_record(tmp_path / "r.jsonl", [Request((3, 4), request_id="a")], model="tiny-llama")
    monkeypatch.setattr(sys.modules["parity.rollouts.command"], "get_backend",
                        lambda name, model, **kw: Exploding(model, dtype=kw["dtype"]))
    assert replay_main([str(record), "--backend", "hf"]) == 2
    assert "RuntimeError: engine exploded" in one_line_error(capsys, "parity replay")


# -- nightly ---------------------------------------------------------------------------------------


@pytest.fixture
def ws(tmp_path, monkeypatch):
    install(runner, patch=monkeypatch.setattr)
    return tmp_path, write_cases(tmp_path)


def test_nightly_checks_out_and_history_before_any_row(ws, monkeypatch, capsys):
    root, cases = ws
    monkeypatch.setattr(execute, "compare", lambda *a, **k: pytest.fail("a row ran"))
    (root / "a-file").write_text("")
    base = ["--cases", str(cases / "alpha.toml"), "--no-progress"]
    assert nightly_main([*base, "--out", str(root / "a-file")]) == 2
    assert "--out" in one_line_error(capsys, "parity nightly")
    history = root / "a-file" / "h.sqlite"
    assert nightly_main([*base, "--out", str(root / "out"), "--history", str(history)]) == 2
    assert "--history" in one_line_error(capsys, "parity nightly")


def test_resume_of_an_unknown_run_creates_nothing(ws, capsys):
    root, cases = ws
    assert nightly_main(["--resume", "ghost", "--out", str(root / "reports")]) == 2
    assert "--resume 'ghost'" in one_line_error(capsys, "parity nightly")
    assert not (root / "reports").exists()
    assert nightly_main(["--cases", str(cases), "--baseline", "ghost", "--out", str(root / "reports")]) == 2
    assert "--baseline 'ghost': no history at" in one_line_error(capsys, "parity nightly")
    assert not (root / "reports").exists()
    history = root / "h.sqlite"
    assert nightly_main(["--resume", "ghost", "--out", str(root / "o"), "--history", str(history)]) == 2
    assert not (root / "o").exists() and not (root / "h.sqlite").exists()


def test_nightly_exits_2_on_an_unexpected_exception(ws, monkeypatch, capsys):
    root, cases = ws

    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(runner, "publish", disk_full)
    argv = ["--cases", str(cases / "alpha.toml"), "--out", str(root / "r"), "--no-progress",
            "--backends", "hf"]
    assert nightly_main(argv) == 2
    assert "No space left on device" in one_line_error(capsys, "parity nightly")


@pytest.mark.slow
def test_an_interrupted_nightly_prints_the_resume_command_and_it_finishes_the_run(ws, monkeypatch, capsys):
    root, cases = ws
    calls: list[str] = []

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[1].name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return fake_compare(*args, **kwargs)
    monkeypatch.setattr(execute, "compare", interrupted)
    out, history = root / "reports dir", root / "h.sqlite"
    argv = ["--cases", str(cases / "alpha.toml"), "--backends", "reference,hf,vllm", "--out", str(out),
            "--history", str(history), "--run-id", "k1", "--no-progress"]
    assert nightly_main(argv) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "1 finished row of run k1 is stored" in err
    command = shlex.split(err.split("finish it with: ")[1])
    assert command[:2] == ["parity", "nightly"]
    monkeypatch.setattr(execute, "compare", fake_compare)
    assert nightly_main(command[2:]) == 0
    assert calls == ["reference", "hf"]


SIGINT_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import test_nightly_runner as fakes
from parity.nightly import main, runner

calls = []
def interrupted_on_the_second_row(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGINT)
    return fakes.fake_compare(*args, **kwargs)

fakes.install(runner, compare=interrupted_on_the_second_row)
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.own_engine(reason="sends a real SIGINT to a nightly process mid-row")
@pytest.mark.slow
def test_a_real_sigint_of_nightly_is_one_line_not_a_traceback(ws):
    root, cases = ws
    script = root / "sigint.py"
    script.write_text(SIGINT_SCRIPT.format(tests=str(TESTS)))
    args = ["--cases", str(cases / "alpha.toml"), "--backends", "reference,hf,vllm", "--out", str(root / "r"),
            "--run-id", "s1", "--no-progress"]
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"parity nightly: interrupted; 1 finished row of run s1 is stored; finish it with: "
        f"parity nightly --resume s1 --out {root / 'r'}"]
