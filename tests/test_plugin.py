"""The pytest plugin, run on example test files through pytester.

The wiring tests replace the plugin's `compare` with a function returning reports built from
arrays and run in-process; the end-to-end tests run the real reference and HF backends in a
subprocess.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_report import make_report

# An in-process pytester run drops every module first imported during it from sys.modules;
# torch imported there and again later loads its C extension twice and crashes. So what the
# plugin imports lazily (backends -> torch, metrics, the gold forward -> transformers' models, the report
# page -> matplotlib) is imported here.
import parity.backends
import parity.correction
import parity.drift.metrics
import parity.engine.gold
import parity.pytest_plugin
import parity.render.report_page
from parity.drift.tolerance import Tolerance

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def _keep_the_sessions_engines(monkeypatch):
    """An in-process pytester session ends with the plugin's `close_shared_backends`, which would
    also close the engines this session's other modules share (each one a ~25 s restart)."""
    monkeypatch.setattr(parity.pytest_plugin, "close_shared_backends", lambda: None)

TABLE_HEADER = "sequence  position  token_id  train_logprob  rollout_logprob     ratio"
#: a real comparison of a built-in model runs the gold forward by default: its column joins the table.
GOLD_TABLE_HEADER = "sequence  position  token_id  train_logprob  rollout_logprob  gold_logprob     ratio"

EXAMPLES = '''
import pytest
from parity.testing import assert_is_ratio_close

@pytest.mark.parity(model="tiny-llama", backend="reference")
def test_reference_is_exact(parity_report):
    assert parity_report.summary["max_abs_logprob_diff"] == 0.0

@pytest.mark.parity(model="tiny-llama", backend="hf", tolerance={"max_abs_logprob_diff": 0.0})
def test_hf_is_not_bitwise():
    pass

@pytest.mark.parity(model="tiny-llama", backend="sglang")
def test_sglang():
    pass
'''


@pytest.fixture
def fake_compare(monkeypatch):
    """The plugin's compare -> a report from arrays: exact for `reference`, drifting otherwise."""
    calls = []

    def fake(model, backend, **kwargs):
        calls.append((model, backend, kwargs))
        tolerance = Tolerance.resolve(kwargs.get("tolerance"), backend)
        return make_report(scale=0.0 if backend == "reference" else 1.0, tolerance=tolerance)

    monkeypatch.setattr(parity.pytest_plugin, "compare", fake)
    return calls


def test_options_and_marker_are_registered(pytester):
    help_text = pytester.runpytest("--help").stdout.str()
    for option in ("--parity-backend", "--parity-model", "--parity-report-dir", "--parity-verbose"):
        assert option in help_text
    assert "@pytest.mark.parity(model=None, backend=None" in pytester.runpytest("--markers").stdout.str()


def test_marker_passes_fails_with_worst_tokens_and_skips_missing_backend(pytester, fake_compare, tmp_path):
    pytester.makepyfile(test_examples=EXAMPLES)
    result = pytester.runpytest("-rs", f"--parity-report-dir={tmp_path / 'html'}")
    result.assert_outcomes(passed=1, failed=1, skipped=1)
    out = result.stdout.str()
    assert "parity check failed: backend 'fake'" in out
    assert "max_abs_logprob_diff = " in out and "> limit 0" in out
    assert "5 worst tokens" in out and TABLE_HEADER in out
    assert "backend 'sglang' needs the 'sglang' package" in out
    assert "Traceback" not in out
    pages = sorted(p.name for p in (tmp_path / "html").iterdir())
    assert len(pages) == 2 and all(p.startswith("test_examples.py_test_") for p in pages)
    assert [c[1] for c in fake_compare] == ["reference", "hf"]


def test_command_line_defaults_and_compare_fixture(pytester, fake_compare):
    pytester.makepyfile(test_defaults='''
import pytest
from parity.testing import assert_is_ratio_close

@pytest.mark.parity
def test_marker_defaults():
    pass

def test_fixture(parity_compare):
    report = parity_compare(tolerance={"k3_kl_max": None})
    with pytest.raises(AssertionError, match="worst tokens"):
        assert_is_ratio_close(report)
''')
    result = pytester.runpytest("--parity-backend=hf", "--parity-model=tiny-qwen3")
    result.assert_outcomes(passed=1, failed=1)
    assert [(c[0], c[1]) for c in fake_compare] == [("tiny-qwen3", "hf"), ("tiny-qwen3", "hf")]
    assert fake_compare[1][2] == {"tolerance": {"k3_kl_max": None}}


@pytest.mark.slow
def test_parity_verbose_shows_the_engines_lines(pytester, monkeypatch):
    """Quiet needs no call (the engine adapters default to it); --parity-verbose chooses INFO."""
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.delenv("PARITY_ENGINE_LOGS", raising=False)
    pytester.makepyfile(test_env="""
import os

def test_level():
    assert os.environ.get("VLLM_LOGGING_LEVEL", "unset") == os.environ["EXPECTED"]
""")
    monkeypatch.setenv("EXPECTED", "INFO")
    pytester.runpytest_subprocess("--parity-verbose").assert_outcomes(passed=1)
    monkeypatch.setenv("EXPECTED", "unset")  # without the flag, a project's own tests see no change
    pytester.runpytest_subprocess().assert_outcomes(passed=1)


def test_parity_report_without_marker_is_a_usage_error(pytester):
    pytester.makepyfile(test_misuse="def test_x(parity_report):\n    pass\n")
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    assert "parity_report needs @pytest.mark.parity" in result.stdout.str()


SESSION_EXAMPLE = '''
from parity.testing import assert_is_ratio_close

def test_one(parity_backend, parity_compare):
    report = parity_compare(backend=parity_backend, prompts=[[5, 6, 7]], sampling={"max_tokens": 4})
    assert report.provenance["backend"] == "hf"
    assert_is_ratio_close(report)

def test_two(parity_backend):
    from parity.backends import shared_backend
    assert shared_backend("hf", "tiny-llama", dtype="bfloat16") is parity_backend
'''


@pytest.mark.slow
def test_end_to_end_with_real_backends(pytester):
    """Markers on reference/HF/SGLang, and the session backend, in one in-process pytest session
    (a subprocess proved nothing more and imported torch and loaded the models again)."""
    small = ', prompts=[[5, 6, 7, 8, 9], [10, 11, 12]], sampling={"max_tokens": 8, "n": 2}'
    source = EXAMPLES.replace('backend="reference")', f'backend="reference"{small})')
    pytester.makepyfile(test_real=source.replace('0.0})', "0.0}" + small + ")"), test_session=SESSION_EXAMPLE)
    result = pytester.runpytest("-rs", "--parity-backend=hf")
    result.assert_outcomes(passed=3, failed=1, skipped=1)
    out = result.stdout.str()
    assert "parity check failed: backend 'hf'" in out and GOLD_TABLE_HEADER in out


def test_plugin_import_stays_light():
    """Every pytest run of a project with parity installed imports the plugin: no torch there."""
    code = ("import sys, parity.pytest_plugin; "
            "print(sorted(m for m in ('torch', 'matplotlib', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.slow
def test_the_readme_s_pytest_example_runs(pytester, tmp_path):
    """The README's `parity_report` example, as written, passes under plain pytest (the default
    session backend, the reference engine) and keeps its page with --parity-report-dir. In-process,
    as the end-to-end test: the plugin is the installed entry point either way; a child only
    imported torch and loaded the model again."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("the\n  `parity_report` fixture hands the body the report", 1)[1]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    pytester.makepyfile(test_readme_example="\n".join(line[2:] for line in example.splitlines()))
    result = pytester.runpytest(f"--parity-report-dir={tmp_path}")
    result.assert_outcomes(passed=1)
    assert [p.suffix for p in tmp_path.iterdir()] == [".html"]
