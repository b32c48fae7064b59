"""One nightly row: what ran (`RowKey`), how it came out (`RowResult`) and the run's exit code.
Status, most severe first: error, regression, fail (tolerance), improved, pass.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from parity.core.errors import ConfigError
from parity.core.schema import BASELINE_RECOMMENDATION_KEY, RECOMMENDATION_KEY
from parity.nightly.regression import Verdict

Status = Literal["error", "regression", "fail", "improved", "pass"]
STATUSES: tuple[str, ...] = ("error", "regression", "fail", "improved", "pass")
#: statuses that make a row eligible as a later run's automatic baseline.
PASSING: tuple[str, ...] = ("pass", "improved")
#: provenance key of a row whose baseline row ran another configuration: why it has no verdict.
BASELINE_SKIPPED = "baseline_not_compared"
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def check_run_id(run_id: str, *, option: str = "--run-id") -> str:
    """`run_id` if it is usable as a directory name, else ConfigError."""
    if not RUN_ID_PATTERN.fullmatch(run_id):
        raise ConfigError(f"{option} {run_id!r}: use 1-100 letters, digits, '.', '_' or '-', "
                          "starting with a letter or digit")
    return run_id


@dataclass(frozen=True, order=True)
class RowKey:
    """Identifies a row across runs. `router_replay` is the row's variant: a router-replay mode, a
    prefix-cache setting of a trajectory case ("prefix-cache-on" / "prefix-cache-off"), or ""."""

    case: str
    backend: str
    dtype: str
    router_replay: str = ""

    def __str__(self) -> str:
        return "|".join((self.case, self.backend, self.dtype, self.router_replay))

    @property
    def label(self) -> str:
        """Short human-readable form, e.g. `moe / vllm / bfloat16 / R3`."""
        return " / ".join(p for p in (self.case, self.backend, self.dtype, self.router_replay) if p)

    @property
    def anchor(self) -> str:
        """An HTML id for this row's section."""
        return "row-" + re.sub(r"[^A-Za-z0-9_-]+", "-", str(self))


@dataclass(frozen=True)
class RowResult:
    """A finished row: summary ({} on error), violations, verdict (None: no baseline), provenance,
    timing ("start_s", "case_s"), abs_diff (per-token |Δlogp| for later baselines), report_json.
    """

    run_id: str
    key: RowKey
    status: Status
    summary: dict[str, Any] = field(default_factory=dict)
    violations: list[dict[str, Any]] = field(default_factory=list)
    verdict: Verdict | None = None
    provenance: dict[str, Any] = field(default_factory=dict)
    timing: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    abs_diff: np.ndarray = field(default_factory=lambda: np.zeros(0))
    report_json: str | None = None
    finished_at: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ConfigError(f"row status {self.status!r}; allowed: {list(STATUSES)}")


def correction_change(row: RowResult) -> tuple[str, str] | None:
    """(baseline's, this row's) recommended correction when the advisor's recommendation changed
    against the baseline row, else None (no baseline recommendation, or the same one)."""
    now, before = row.summary.get(RECOMMENDATION_KEY), row.summary.get(BASELINE_RECOMMENDATION_KEY)
    if now is None or before is None or now == before:
        return None
    return str(before), str(now)


def row_status(violations: list[Any], verdict: Verdict | None) -> Status:
    """The status of a row that ran: regression beats a tolerance failure beats improvement."""
    if verdict is not None and verdict.flagged:
        return "regression"
    if violations:
        return "fail"
    if verdict is not None and verdict.change == "improved":
        return "improved"
    return "pass"


def exit_code(rows: list[RowResult]) -> int:
    """0 when every row passed (or improved), 1 on a regression or tolerance failure, 2 on errors."""
    statuses = {r.status for r in rows}
    if "error" in statuses:
        return 2
    if statuses & {"regression", "fail"}:
        return 1
    return 0
