"""Run a Triton test file again under Triton's interpreter, in a child pytest, and check that it ran.

The interpreter must be chosen before `triton` is first imported (its own `tl.*` helpers are
decorated at import), so a process that did not start with `TRITON_INTERPRET=1` runs the file in
a child process that does; the variable never touches this process or other test files. Exit
status 0 alone would also accept a child whose tests were all skipped, so its summary line must
count at least `min_passed` passed tests and no failure or error.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_interpreted(test_file: str, *, min_passed: int, timeout: float) -> None:
    """Run `test_file` under the interpreter; fail unless >= `min_passed` of its tests passed."""
    child = subprocess.run([sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider"],
                           env={**{k: v for k, v in os.environ.items()
                                  if not k.startswith(("PYTEST_XDIST", "PYTEST_ADDOPTS"))},
                                "TRITON_INTERPRET": "1"}, cwd=ROOT, capture_output=True,
                           text=True, timeout=timeout)
    log = child.stdout[-8000:] + child.stderr[-2000:]
    assert child.returncode == 0, log
    summary = child.stdout.strip().splitlines()[-1]
    outcomes = re.findall(r"(\d+) (passed|failed|errors?|xpassed|xfailed)", summary)
    counts = {word: int(n) for n, word in outcomes}
    assert counts.get("passed", 0) >= min_passed, f"expected >= {min_passed} passed: {summary}\n{log}"
    assert not counts.keys() - {"passed", "xfailed"}, summary
