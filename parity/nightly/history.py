"""The nightly history: an embedded SQLite database of runs and their finished rows, one
transaction per row (`UNIQUE(run_id, row_key)` lets `--resume` finish without duplicates),
per-token |Δlogp| zlib-compressed and the report JSON kept.
"""

from __future__ import annotations

import datetime as _dt
import json
import sqlite3
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parity.core.errors import ConfigError, InputError
from parity.nightly.regression import Verdict
from parity.nightly.rows import PASSING, RowKey, RowResult

SCHEMA_VERSION = 1

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', '{SCHEMA_VERSION}');
CREATE TABLE IF NOT EXISTS runs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL UNIQUE,
    created_at TEXT NOT NULL,
    finished_at TEXT,
    config TEXT NOT NULL,
    environment TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS rows (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL REFERENCES runs (run_id),
    row_key TEXT NOT NULL,
    case_name TEXT NOT NULL,
    backend TEXT NOT NULL,
    dtype TEXT NOT NULL,
    router_replay TEXT NOT NULL,
    status TEXT NOT NULL,
    summary TEXT NOT NULL,
    violations TEXT NOT NULL,
    verdict TEXT,
    provenance TEXT NOT NULL,
    timing TEXT NOT NULL,
    error TEXT,
    abs_diff BLOB NOT NULL,
    report BLOB,
    finished_at TEXT NOT NULL,
    UNIQUE (run_id, row_key)
);
CREATE INDEX IF NOT EXISTS rows_by_key ON rows (row_key, status);
"""

_ROW_COLUMNS = ("run_id", "row_key", "case_name", "backend", "dtype", "router_replay", "status", "summary",
                "violations", "verdict", "provenance", "timing", "error", "abs_diff", "report", "finished_at")


@dataclass(frozen=True)
class RunInfo:
    """A run's header: id, order of creation, times, the options it ran with, its machine."""

    run_id: str
    seq: int
    created_at: str
    finished_at: str | None
    config: dict[str, Any]
    environment: dict[str, Any]


def now() -> str:
    """UTC time as ISO 8601, seconds precision."""
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


class History:
    """Runs and rows in one SQLite file (created on first use). Use as a context manager."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--history {self.path}: cannot create its directory ({exc.strerror})") from exc
        try:
            self._db = sqlite3.connect(self.path, timeout=30.0)
            with self._db:
                self._db.executescript(_SCHEMA)
            version = self._db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]
        except sqlite3.DatabaseError as exc:
            raise InputError(f"--history {self.path}: not a usable parity history database ({exc})") from exc
        if int(version) != SCHEMA_VERSION:
            raise InputError(f"--history {self.path}: schema version {version}, this parity reads "
                             f"{SCHEMA_VERSION}; point --history at a new file")

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> History:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- runs ------------------------------------------------------------------------------

    def create_run(self, run_id: str, config: dict[str, Any], environment: dict[str, Any]) -> bool:
        """Record a new run; False (and nothing written) when the id is taken. One INSERT under
        the UNIQUE run_id, so of two processes creating one id at the same moment exactly one wins."""
        try:
            with self._db as db:
                db.execute("INSERT INTO runs (run_id, created_at, config, environment) VALUES (?, ?, ?, ?)",
                           (run_id, now(), _dumps(config), _dumps(environment)))
        except sqlite3.IntegrityError:
            return False
        return True

    def start_run(self, run_id: str, config: dict[str, Any], environment: dict[str, Any]) -> RunInfo:
        """Record a new run, or return the existing one with this id (a resumed run)."""
        with self._db as db:
            db.execute("INSERT OR IGNORE INTO runs (run_id, created_at, config, environment) "
                       "VALUES (?, ?, ?, ?)", (run_id, now(), _dumps(config), _dumps(environment)))
        return self.require_run(run_id, option="--run-id")

    def finish_run(self, run_id: str) -> None:
        with self._db as db:
            db.execute("UPDATE runs SET finished_at = ? WHERE run_id = ?", (now(), run_id))

    def run(self, run_id: str) -> RunInfo | None:
        row = self._db.execute(
            "SELECT run_id, seq, created_at, finished_at, config, environment FROM runs WHERE run_id = ?",
            (run_id,)).fetchone()
        return None if row is None else _run_info(row)

    def require_run(self, run_id: str, *, option: str) -> RunInfo:
        """The run with this id, or ConfigError listing the newest ones."""
        run = self.run(run_id)
        if run is None:
            recent = [r.run_id for r in self.runs()[-5:]]
            raise ConfigError(f"{option} {run_id!r}: no such run in {self.path}; "
                              f"recent runs: {recent or 'none'}")
        return run

    def runs(self) -> list[RunInfo]:
        """Every run, oldest first."""
        rows = self._db.execute("SELECT run_id, seq, created_at, finished_at, config, environment "
                                "FROM runs ORDER BY seq").fetchall()
        return [_run_info(r) for r in rows]

    # -- rows ------------------------------------------------------------------------------

    def add_row(self, row: RowResult) -> None:
        """Write one finished row in its own transaction. A row already stored under the same
        (run, key) is replaced only if it was an error (a retried row); otherwise nothing changes."""
        values = (
            row.run_id, str(row.key), row.key.case, row.key.backend, row.key.dtype, row.key.router_replay,
            row.status, _dumps(row.summary), _dumps(row.violations),
            None if row.verdict is None else _dumps(row.verdict.to_dict()),
            _dumps(row.provenance), _dumps(row.timing), row.error, _pack_array(row.abs_diff),
            None if row.report_json is None else zlib.compress(row.report_json.encode()),
            row.finished_at or now(),
        )
        updates = ", ".join(f"{c} = excluded.{c}" for c in _ROW_COLUMNS[2:])
        with self._db as db:  # one transaction: committed on success, rolled back on any error
            db.execute(
                f"INSERT INTO rows ({', '.join(_ROW_COLUMNS)}) VALUES ({', '.join('?' * len(_ROW_COLUMNS))}) "
                f"ON CONFLICT (run_id, row_key) DO UPDATE SET {updates} WHERE rows.status = 'error'",
                values)

    def rows(self, run_id: str, *, with_report: bool = False) -> list[RowResult]:
        """The finished rows of a run, in the order they finished."""
        return [self._row(r, with_report) for r in self._select("WHERE run_id = ? ORDER BY id", (run_id,),
                                                                with_report)]

    def row(self, run_id: str, key: RowKey, *, with_report: bool = False) -> RowResult | None:
        found = self._select("WHERE run_id = ? AND row_key = ?", (run_id, str(key)), with_report)
        return self._row(found[0], with_report) if found else None

    def last_passing(self, key: RowKey, *, before_run: str, with_report: bool = False,
                     accept: Callable[[RowResult], bool] | None = None) -> RowResult | None:
        """The newest row with this key that passed (and that `accept` takes, e.g. one of the same
        configuration), from a run created before `before_run` (with its report JSON when `with_report`)."""
        columns = [c if c != "report" or with_report else "NULL" for c in _ROW_COLUMNS]
        found = self._db.execute(  # a cursor: rows are read (and decompressed) until one is taken
            f"SELECT {', '.join(columns)} FROM rows "
            f"WHERE row_key = ? AND status IN ({', '.join('?' * len(PASSING))}) "
            "AND run_id IN (SELECT run_id FROM runs WHERE seq < (SELECT seq FROM runs WHERE run_id = ?)) "
            "ORDER BY (SELECT seq FROM runs WHERE runs.run_id = rows.run_id) DESC",
            (str(key), *PASSING, before_run))
        try:
            rows = (self._row(r, with_report) for r in found)
            return next((r for r in rows if accept is None or accept(r)), None)
        finally:
            found.close()

    def trend(self, keys: list[RowKey], *, up_to_run: str,
              same_series: Callable[[RowResult, RowResult], bool] | None = None,
              ) -> list[tuple[str, RowKey, dict[str, Any]]]:
        """(run_id, key, summary) of every non-error row with one of `keys`, from runs up to and
        including `up_to_run`, oldest run first (the data of the trend charts). With `same_series`
        (newest row, older row -> whether they measure one workload), a key's series starts at its
        newest change: the rows before the newest one `same_series` refuses are left out, so a case
        edited under its name is not drawn as one line through both workloads."""
        if not keys:
            return []
        rows = self._db.execute(
            f"SELECT rows.run_id, case_name, backend, dtype, router_replay, status, summary, provenance "
            f"FROM rows JOIN runs ON runs.run_id = rows.run_id "
            f"WHERE row_key IN ({', '.join('?' * len(keys))}) AND status != 'error' "
            f"AND runs.seq <= (SELECT seq FROM runs WHERE run_id = ?) ORDER BY runs.seq, rows.id",
            (*map(str, keys), up_to_run)).fetchall()
        points = [RowResult(run_id=r[0], key=RowKey(r[1], r[2], r[3], r[4]), status=r[5],
                            summary=json.loads(r[6]), provenance=json.loads(r[7])) for r in rows]
        if same_series is not None:
            newest = {p.key: p for p in points}  # oldest run first: the last row of a key is its newest
            start: dict[RowKey, int] = {}
            for i, p in enumerate(points):
                if not same_series(newest[p.key], p):
                    start[p.key] = i + 1  # the series starts after the newest row of another workload
            points = [p for i, p in enumerate(points) if i >= start.get(p.key, 0)]
        return [(p.run_id, p.key, p.summary) for p in points]

    def _select(self, where: str, params: tuple[Any, ...], with_report: bool) -> list[tuple[Any, ...]]:
        columns = [c if c != "report" or with_report else "NULL" for c in _ROW_COLUMNS]
        return self._db.execute(f"SELECT {', '.join(columns)} FROM rows {where}", params).fetchall()

    @staticmethod
    def _row(r: tuple[Any, ...], with_report: bool) -> RowResult:
        d = dict(zip(_ROW_COLUMNS, r))
        return RowResult(
            run_id=d["run_id"], key=RowKey(d["case_name"], d["backend"], d["dtype"], d["router_replay"]),
            status=d["status"], summary=json.loads(d["summary"]), violations=json.loads(d["violations"]),
            verdict=None if d["verdict"] is None else Verdict.from_dict(json.loads(d["verdict"])),
            provenance=json.loads(d["provenance"]), timing=json.loads(d["timing"]), error=d["error"],
            abs_diff=_unpack_array(d["abs_diff"]),
            report_json=zlib.decompress(d["report"]).decode() if with_report and d["report"] else None,
            finished_at=d["finished_at"],
        )


def _run_info(r: tuple[Any, ...]) -> RunInfo:
    return RunInfo(run_id=r[0], seq=r[1], created_at=r[2], finished_at=r[3], config=json.loads(r[4]),
                   environment=json.loads(r[5]))


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _pack_array(values: np.ndarray) -> bytes:
    """zlib-compressed little-endian float64 bytes (float64 keeps tiny drifts distinguishable)."""
    return zlib.compress(np.ascontiguousarray(values, dtype="<f8").tobytes())


def _unpack_array(blob: bytes) -> np.ndarray:
    return np.frombuffer(zlib.decompress(blob), dtype="<f8").copy()
