"""What `benchmarks.gpu_backends` finished on this machine, so a run cut by a call's time limit
resumes where it stopped: the next run skips every section marked done and, inside a section,
every row already kept.

State: under a directory that lives as long as the machine (default /tmp/parity-gpu-state), per
section `SECTION.rows.json` (its rows so far, by key) and `SECTION.done.json` (its result, the
marker). JSON only: reading the state imports nothing heavy.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class DeadlineReached(Exception):
    """The run's `--deadline` passed: the section stops before its next row and stays pending."""


@dataclass(frozen=True)
class Deadline:
    """A wall-clock budget for one run: `check` before each row or section (seconds from `start`,
    `time.monotonic`); None = no limit."""

    seconds: float | None
    start: float

    def left(self) -> float:
        """Seconds left (inf without a limit)."""
        return float("inf") if self.seconds is None else self.seconds - (time.monotonic() - self.start)

    def check(self, what: str) -> None:
        """Raise `DeadlineReached` naming `what` when the budget is spent."""
        if self.left() <= 0:
            raise DeadlineReached(f"deadline of {self.seconds:.0f} s reached before {what}")


#: where the state lives by default: /tmp goes with the machine, as "done on this machine" should.
DEFAULT_STATE = Path("/tmp/parity-gpu-state")


@dataclass(frozen=True)
class Ledger:
    """Done sections and kept rows under `root` (created on first use)."""

    root: Path = DEFAULT_STATE

    def _file(self, section: str, kind: str) -> Path:
        return self.root / f"{section}.{kind}.json"

    def _write(self, path: Path, value: Any) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(value, indent=1, default=str))
        tmp.replace(path)  # a run killed mid-write leaves the previous state, never half a file

    def done(self, section: str) -> bool:
        """Whether `section` finished on this machine."""
        return self._file(section, "done").exists()

    def rows(self, section: str) -> dict[str, Any]:
        """The rows `section` kept so far, by key ({} when none)."""
        path = self._file(section, "rows")
        return json.loads(path.read_text()) if path.exists() else {}

    def keep(self, section: str, key: str, row: Any) -> None:
        """Keep one finished row of `section` (a later run skips its key)."""
        self._write(self._file(section, "rows"), {**self.rows(section), key: row})

    def finish(self, section: str, result: Any) -> None:
        """Mark `section` done with its result."""
        self._write(self._file(section, "done"), result)

    def result(self, section: str) -> Any:
        """A done section's result, else its rows so far (a list), else None."""
        if self.done(section):
            return json.loads(self._file(section, "done").read_text())
        rows = self.rows(section)
        return list(rows.values()) if rows else None

    def forget(self, sections: Sequence[str]) -> None:
        """Drop the state of `sections` (`--redo`): they run again from their first row."""
        for section in sections:
            for kind in ("done", "rows"):
                self._file(section, kind).unlink(missing_ok=True)


def pending(sections: Sequence[str], ledger: Ledger) -> list[str]:
    """The sections of `sections` still to run, in their order."""
    return [s for s in sections if not ledger.done(s)]


def to_run(sections: Sequence[str], ledger: Ledger) -> list[str]:
    """`pending`, plus every done section that keeps rows: a later run may ask it for rows it has
    not run (`--audit-rows` naming a new key), and its runner skips the kept ones."""
    return [s for s in sections if not ledger.done(s) or ledger.rows(s)]
