"""The README's library example runs, as written, as a script.

vLLM starts its engine core in a spawned process that imports the script again, so the example
needs its `if __name__ == "__main__":` guard; the negative control runs the same code without
the guard and sees the engine fail to start.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.vllm, pytest.mark.own_engines, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]


def library_example() -> str:
    """The Python block under the README's "Library example" heading."""
    section = (ROOT / "README.md").read_text().split("## Library example", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run_script(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900,
                          cwd=tmp_path, env=env, check=False)


def test_the_library_example_runs_as_a_script(tmp_path):
    result = run_script(library_example(), tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "rollout_corr" not in result.stdout  # the metric's value is printed, not its name
    assert (tmp_path / "report.html").read_text().startswith("<!DOCTYPE html>")


def test_without_the_main_guard_the_engine_does_not_start(tmp_path):
    code = library_example()
    head, body = code.split('if __name__ == "__main__":\n')
    result = run_script(head + textwrap.dedent(body), tmp_path)
    assert result.returncode != 0
    assert "bootstrapping phase" in result.stderr
    assert not (tmp_path / "report.html").exists()
