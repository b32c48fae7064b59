"""Quiet by default: parity's commands print no vLLM INFO/WARNING lines unless asked (--verbose),
and a logging setup the user chose is left alone."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from parity.runtime import quiet

ROOT = Path(__file__).resolve().parent.parent
#: a vLLM log line: "(EngineCore pid=1) INFO 11-30 17:16:03 [core.py:133] ..." or its raw form
VLLM_LINE = re.compile(r"\b(INFO|WARNING) \d\d-\d\d |Triton is installed|Loading (safetensors|weights)")


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING", "TORCH_CPP_LOG_LEVEL",
                 "HF_HUB_DISABLE_PROGRESS_BARS", quiet.MARK):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "warnoptions", list(sys.warnoptions))
    level = logging.getLogger("vllm").level
    yield monkeypatch
    logging.getLogger("vllm").setLevel(level)


def test_quiet_unless_asked_and_the_users_choice_wins(clean_env):
    assert quiet.engine_logging() == "quiet"
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR" and os.environ["TORCH_CPP_LOG_LEVEL"] == "ERROR"
    assert logging.getLogger("vllm").level == logging.ERROR and quiet.CHILD_WARNING in sys.warnoptions
    assert quiet.engine_logging(verbose=True) == "verbose" and os.environ["VLLM_LOGGING_LEVEL"] == "INFO"
    assert quiet.engine_logging() == "verbose"  # None keeps the process's choice (an adapter's call)
    clean_env.delenv(quiet.MARK)
    clean_env.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # the user's own level
    assert quiet.engine_logging() == quiet.engine_logging(verbose=True) == "user"
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG" and quiet.MARK not in os.environ
    clean_env.delenv("VLLM_LOGGING_LEVEL")
    clean_env.setenv("VLLM_CONFIGURE_LOGGING", "0")  # the user configures logging
    assert quiet.engine_logging() == "user" and "VLLM_LOGGING_LEVEL" not in os.environ


def test_a_users_torch_log_level_is_kept(clean_env):
    clean_env.setenv("TORCH_CPP_LOG_LEVEL", "INFO")
    assert quiet.engine_logging() == "quiet" and os.environ["TORCH_CPP_LOG_LEVEL"] == "INFO"


def test_transformers_imported_before_the_choice_draws_no_loading_bar(clean_env):
    from transformers.utils import logging as hf_logging

    try:
        hf_logging.enable_progress_bar()  # as imported before HF_HUB_DISABLE_PROGRESS_BARS was set
        assert quiet.engine_logging() == "quiet" and not hf_logging.is_progress_bar_enabled()
        hf_logging.enable_progress_bar()
        for name in (quiet.MARK, "VLLM_LOGGING_LEVEL"):  # a fresh process
            clean_env.delenv(name)
        clean_env.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")  # the user's own choice is kept
        assert quiet.engine_logging() == "quiet" and hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()


PARITY = str(Path(sys.executable).parent / "parity")


def fresh_env() -> dict[str, str]:
    """This environment without any logging choice: a user's fresh shell."""
    chosen = {"VLLM_CONFIGURE_LOGGING", quiet.MARK, *quiet.ENVIRONMENT["quiet"]}
    return {k: v for k, v in os.environ.items() if k not in chosen}


def run_parity(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PARITY, *argv], capture_output=True, text=True, timeout=600, check=False,
                          cwd=ROOT, env=fresh_env())


def vllm_lines_until_the_core_speaks(*argv: str) -> list[str]:
    """The vLLM lines `parity *argv` prints until its engine core process has printed one and
    more than 10 are seen; then its process group (parity, the engine core) is killed: finishing
    the comparison proves nothing more about what reaches the terminal."""
    run = subprocess.Popen([PARITY, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           cwd=ROOT, env=fresh_env(), start_new_session=True)
    watchdog = threading.Timer(600, run.kill)
    watchdog.start()
    lines: list[str] = []
    try:
        for line in run.stdout:
            lines += [line] if VLLM_LINE.search(line) else []
            if len(lines) > 10 and any(seen.startswith("(EngineCore") for seen in lines):
                break
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
        run.communicate()
        watchdog.cancel()
    return lines


@pytest.mark.vllm
@pytest.mark.own_engines
@pytest.mark.own_engine(reason="the whole output of a fresh process and of its engine core process")
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_parity_compare_with_vllm_is_quiet_and_verbose_shows_the_lines():
    """The whole terminal output of a vLLM comparison, from a fresh process with no logging set."""
    argv = ("compare", "--model", "tiny-llama", "--backend", "vllm")
    quiet_run = run_parity(*argv)
    assert quiet_run.returncode == 0, quiet_run.stderr[-3000:]
    noise = [line for line in (quiet_run.stdout + quiet_run.stderr).splitlines() if VLLM_LINE.search(line)]
    assert noise == [] and "parity PASS" in quiet_run.stdout
    assert quiet_run.stderr.strip() == "", quiet_run.stderr[-3000:]
    loud = vllm_lines_until_the_core_speaks(*argv, "--verbose")  # the negative control: the lines shown
    assert len(loud) > 10 and any(line.startswith("(EngineCore") for line in loud), loud
