"""The SQLite history: one transaction per row, no duplicates, baselines and trends."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from parity.core.errors import ConfigError, InputError
from parity.nightly.history import History
from parity.nightly.rows import RowKey, RowResult, exit_code

KEY = RowKey("smoke", "hf", "bfloat16")


def row(run_id: str, status: str = "pass", key: RowKey = KEY, drift: float = 0.01) -> RowResult:
    return RowResult(run_id=run_id, key=key, status=status,
                     summary={} if status == "error" else {"max_abs_logprob_diff": drift},
                     error="boom" if status == "error" else None, abs_diff=np.full(5, drift),
                     report_json=None if status == "error" else '{"x": 1}')


def test_rows_round_trip_and_a_row_is_never_duplicated(tmp_path):
    with History(tmp_path / "h.sqlite") as h:
        h.start_run("r1", {"cases": "x"}, {"git": None})
        h.add_row(row("r1"))
        h.add_row(row("r1", drift=0.5))  # same key again: ignored, the finished row stays
        h.start_run("r1", {"cases": "changed"}, {})  # restarting a run keeps its header
        stored = h.rows("r1", with_report=True)
        assert len(stored) == 1 and stored[0].summary == {"max_abs_logprob_diff": 0.01}
        assert stored[0].abs_diff.dtype == np.float64 and np.all(stored[0].abs_diff == 0.01)
        assert stored[0].report_json == '{"x": 1}' and h.rows("r1")[0].report_json is None
        assert h.run("r1").config == {"cases": "x"}
    count = sqlite3.connect(tmp_path / "h.sqlite").execute("SELECT COUNT(*) FROM rows").fetchone()[0]
    assert count == 1


def test_an_error_row_is_replaced_when_the_row_is_retried(tmp_path):
    with History(tmp_path / "h.sqlite") as h:
        h.start_run("r1", {}, {})
        h.add_row(row("r1", status="error"))
        h.add_row(row("r1"))
        assert [r.status for r in h.rows("r1")] == ["pass"]


def test_last_passing_skips_failures_and_later_runs(tmp_path):
    with History(tmp_path / "h.sqlite") as h:
        statuses = (("r1", "pass"), ("r2", "improved"), ("r3", "fail"), ("r4", "pass"), ("r5", "pass"))
        for run_id, status in statuses:
            h.start_run(run_id, {}, {})
            h.add_row(row(run_id, status))
        assert h.last_passing(KEY, before_run="r4").run_id == "r2"
        assert h.last_passing(KEY, before_run="r1") is None
        assert h.last_passing(RowKey("moe", "hf", "bfloat16"), before_run="r5") is None
        assert [r.run_id for r in h.runs()] == ["r1", "r2", "r3", "r4", "r5"]
        assert [run for run, _, _ in h.trend([KEY], up_to_run="r4")] == ["r1", "r2", "r3", "r4"]


def test_require_run_lists_recent_runs_and_a_foreign_file_is_refused(tmp_path):
    with History(tmp_path / "h.sqlite") as h:
        h.start_run("r1", {}, {})
        with pytest.raises(ConfigError, match=r"--baseline 'nope'.*r1"):
            h.require_run("nope", option="--baseline")
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(InputError, match=r"junk\.sqlite"):
        History(junk)


def test_exit_code_ranks_errors_over_failures():
    assert exit_code([row("r", "pass"), row("r", "improved")]) == 0
    assert exit_code([row("r", "pass"), row("r", "fail")]) == 1
    assert exit_code([row("r", "regression")]) == 1
    assert exit_code([row("r", "fail"), row("r", "error")]) == 2
