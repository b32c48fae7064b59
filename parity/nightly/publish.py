"""Writes a run's report directory (`index.html`, `summary.md`, `results.json`, `<out>/latest`),
each file renamed into place so no reader sees half of it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from parity.core.outputs import write_atomic
from parity.core.schema import json_safe
from parity.nightly.history import RunInfo
from parity.nightly.html_report import render_page
from parity.nightly.markdown_report import render_summary
from parity.nightly.rows import RowKey, RowResult, exit_code

RESULTS_FORMAT = "parity-nightly-results"
RESULTS_VERSION = 1


def publish(out: Path, run: RunInfo, rows: list[RowResult],
            trend_points: list[tuple[str, RowKey, dict[str, Any]]]) -> Path:
    """Write `<out>/<run_id>/` and update `<out>/latest`; returns the run directory."""
    run_dir = out / run.run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / "index.html", render_page(run, rows, trend_points))
    write_atomic(run_dir / "summary.md", render_summary(run, rows))
    write_atomic(run_dir / "results.json", json.dumps(results(run, rows), indent=2, sort_keys=True,
                                                      allow_nan=False) + "\n")
    point_latest(out, run.run_id)
    return run_dir


def results(run: RunInfo, rows: list[RowResult]) -> dict[str, Any]:
    """The machine-readable run: header, environment and every row without its token arrays.
    Non-finite numbers are spelled "-inf", "inf", "nan" (`parity.core.schema.json_safe`), so strict JSON
    parsers (jq, JavaScript) read the file and nothing is lost."""
    return json_safe({
        "format": RESULTS_FORMAT, "version": RESULTS_VERSION, "run_id": run.run_id,
        "created_at": run.created_at, "finished_at": run.finished_at, "exit_code": exit_code(rows),
        "config": run.config, "environment": run.environment,
        "rows": [{
            "key": str(r.key), "case": r.key.case, "backend": r.key.backend, "dtype": r.key.dtype,
            "router_replay": r.key.router_replay, "status": r.status, "summary": r.summary,
            "violations": r.violations, "verdict": None if r.verdict is None else r.verdict.to_dict(),
            "error": r.error, "timing": r.timing, "provenance": r.provenance, "finished_at": r.finished_at,
        } for r in rows],
    })


def point_latest(out: Path, run_id: str) -> None:
    """Make `<out>/latest` a relative symlink to the run directory; where symlinks are not
    allowed (some Windows and network filesystems), a small text file holding the run id."""
    latest = out / "latest"
    tmp = out / f".latest.tmp{os.getpid()}"
    tmp.unlink(missing_ok=True)
    try:
        os.symlink(run_id, tmp, target_is_directory=True)
    except OSError:
        write_atomic(latest, run_id + "\n")
        return
    os.replace(tmp, latest)
