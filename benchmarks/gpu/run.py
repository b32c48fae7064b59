"""One run of the script: its arguments, a scratch directory, the typed results so far and their JSON.

Sections that need a process set up differently (cuBLASLt's environment, a fresh probe cache) run
`python3 -m benchmarks.gpu` again as a child (`module_command`, from the repository root) and
read back what it printed or saved.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.gpu.records import plain
from benchmarks.gpu.results import Failure

#: The repository root: child processes run `python3 -m benchmarks.gpu` from here.
ROOT = Path(__file__).resolve().parents[2]
#: the file every run writes in its --out directory.
RESULTS_FILE = "gpu_results.json"


@dataclass
class Run:
    """What every section gets: the arguments, a scratch directory for checkpoints, and the results
    so far: typed (`results`, which the table and the roofline read) and as the JSON that `save`
    writes to $OUT/gpu_results.json (`record`: the header, then each section's results with its
    seconds; a failed section keeps the rows it checkpointed, plus its error)."""

    args: argparse.Namespace
    tmp: Path
    record: dict[str, Any]
    results: dict[str, Any] = field(default_factory=dict)

    def save(self) -> None:
        (self.args.out / RESULTS_FILE).write_text(json.dumps(self.record, indent=1, default=str))

    def checkpoint(self, section: str, partial: Any) -> None:
        """Save a long section's results so far (a crash or timeout keeps them)."""
        self.record[section] = plain(partial)
        self.save()

    def finish(self, section: str, result: Any, seconds: float) -> None:
        """Keep a section's result (or its Failure) and save it with the seconds it took."""
        self.results[section] = result
        if isinstance(result, Failure):
            self.record[section] = {**(self.record.get(section) or {}), "error": result.error}
        else:
            self.record[section] = plain(result)
        self.record[section]["section_seconds"] = seconds
        self.save()


def module_command(*args: str) -> list[str]:
    """This script run as a module, as a child-process command (started in ROOT)."""
    return [sys.executable, "-m", "benchmarks.gpu", *args]


def last_json_line(stdout: str) -> Any:
    """The JSON a child printed last (its result), or None when it printed none."""
    try:
        return json.loads(stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return None


def saved_results(out: Path) -> dict[str, Any]:
    """What a child run saved in its --out directory `out` ({} when it saved nothing)."""
    path = out / RESULTS_FILE
    return json.loads(path.read_text()) if path.exists() else {}
