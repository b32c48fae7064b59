"""The monitor's store: one SQLite file per run, one row per logged step, append-only.

    out_dir/monitor.sqlite
      run(key TEXT PRIMARY KEY, value TEXT)          run_name, created_at, parity_version, schema_version
      steps(step INTEGER PRIMARY KEY, logged_at REAL, record TEXT)     record: the step's JSON summary

Each step is written in one transaction (`BEGIN IMMEDIATE ... COMMIT`), so a reader sees a step
whole or not at all. The journal is SQLite's write-ahead log: a committed step is in the WAL file
before `append` returns, so it survives the training process being killed (SIGKILL included) at any
point, mid-step too; the next reader (or writer) recovers the file and sees every committed step.
`synchronous=NORMAL` means a power loss may drop the last steps (never corrupt the file); a process
crash drops none. Readers never block the writer: a run still going can be read at any time.

Append-only is enforced by the file itself, not only by this module: triggers abort any UPDATE or
DELETE of a step, and an INSERT whose step is not above every stored one.

Light: the standard library only.
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from pathlib import Path
from typing import Any

from parity.core.errors import ConfigError, InputError
from parity.core.schema import VERSION

#: the store's file name inside a monitor directory.
STORE_FILE = "monitor.sqlite"
#: bumped when the tables change; a store of another version is refused, not misread.
SCHEMA_VERSION = 1
#: how long a connection waits for another's lock (ms): the page thread reads while the trainer writes.
_BUSY_MS = 10_000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS run (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS steps (step INTEGER PRIMARY KEY, logged_at REAL NOT NULL, record TEXT NOT NULL);
CREATE TRIGGER IF NOT EXISTS steps_no_update BEFORE UPDATE ON steps
  BEGIN SELECT RAISE(ABORT, 'monitor steps are append-only'); END;
CREATE TRIGGER IF NOT EXISTS steps_no_delete BEFORE DELETE ON steps
  BEGIN SELECT RAISE(ABORT, 'monitor steps are append-only'); END;
CREATE TRIGGER IF NOT EXISTS steps_increase BEFORE INSERT ON steps
  WHEN NEW.step <= (SELECT MAX(step) FROM steps)
  BEGIN SELECT RAISE(ABORT, 'monitor steps must increase'); END;
"""


def store_path(out_dir: str | Path) -> Path:
    """The store file of monitor directory `out_dir`."""
    return Path(out_dir) / STORE_FILE


def json_ready(value: Any) -> Any:
    """`value` with every non-finite float as None (JSON has no NaN or infinity, and browsers and
    `jq` refuse them), tuples as lists; anything else JSON cannot hold is an InputError."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    raise InputError(f"cannot store {type(value).__name__} {value!r:.60} in the monitor; give plain numbers, "
                     "strings, lists and dicts")


class MonitorStore:
    """One connection to a monitor's SQLite file (one thread; the page thread opens its own).

    Use `create` (the training process: makes the file or continues the run in it) or `open`
    (anyone reading: the file must exist, nothing is changed).
    """

    def __init__(self, path: Path, conn: sqlite3.Connection) -> None:
        self.path = path
        self._conn = conn

    @classmethod
    def create(cls, out_dir: str | Path, run_name: str | None) -> MonitorStore:
        """The writer's store in `out_dir` (created if missing). An existing store continues its run:
        its steps stay and new ones must come after them; `run_name` must then be its name (None
        takes it). A new store is named `run_name`, else the directory's name."""
        path = store_path(out_dir)
        store = cls(path, _connect(path, create=True))
        conn = store._conn
        conn.executescript(_SCHEMA)
        run = store.run_info()
        if not run:
            name = run_name if run_name is not None else Path(out_dir).resolve().name
            values = {"run_name": name, "created_at": repr(time.time()), "parity_version": VERSION,
                      "schema_version": str(SCHEMA_VERSION)}
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany("INSERT OR IGNORE INTO run (key, value) VALUES (?, ?)", values.items())
            conn.execute("COMMIT")
            run = store.run_info()
        _check_version(path, run)
        if run_name is not None and run["run_name"] != run_name:
            store.close()
            raise ConfigError(f"run_name {run_name!r}: {path} holds run {run['run_name']!r}; a monitor "
                              "directory holds one run (give its name, None, or another out_dir)")
        return store

    @classmethod
    def open(cls, out_dir: str | Path) -> MonitorStore:
        """A reader's store of an existing monitor directory (the run may still be going)."""
        path = store_path(out_dir)
        if not path.is_file():
            raise InputError(f"{out_dir}: no {STORE_FILE} here; give a directory a parity.Monitor wrote")
        store = cls(path, _connect(path, create=False))
        try:
            run = store.run_info()
        except sqlite3.DatabaseError as exc:
            store.close()
            raise InputError(f"{path}: not a monitor store ({exc})") from exc
        if not run:
            store.close()
            raise InputError(f"{path}: not a monitor store (no run record)")
        _check_version(path, run)
        return store

    def run_info(self) -> dict[str, str]:
        """The run's record: run_name, created_at, parity_version, schema_version ({} before creation)."""
        try:
            return dict(self._conn.execute("SELECT key, value FROM run").fetchall())
        except sqlite3.OperationalError:  # no run table: not (yet) a monitor store
            return {}

    def last_step(self) -> int | None:
        """The highest stored step, None before the first."""
        return self._conn.execute("SELECT MAX(step) FROM steps").fetchone()[0]

    def append(self, step: int, record: dict[str, Any]) -> float:
        """Store `record` as step `step` in one transaction (see the module doc); returns the
        time it was logged at (unix seconds)."""
        text = json.dumps(json_ready(record), allow_nan=False, separators=(",", ":"))
        conn = self._conn
        logged_at = time.time()
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute("INSERT INTO steps (step, logged_at, record) VALUES (?, ?, ?)",
                         (step, logged_at, text))
            conn.execute("COMMIT")
        except BaseException as exc:
            conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.IntegrityError):  # another writer stored this step or a later one
                raise InputError(f"step {step}: {self.path} refused it ({exc}); steps must increase, and "
                                 "a monitor directory has one writer (give each rank its own)") from exc
            raise
        return logged_at

    def steps(self, since: int | None = None) -> list[dict[str, Any]]:
        """Every stored step (after step `since`, when given), in step order: `{"step": int,
        "logged_at": unix seconds, **record}`."""
        query = "SELECT step, logged_at, record FROM steps"
        rows = self._conn.execute(query + (" WHERE step > ? ORDER BY step" if since is not None else
                                           " ORDER BY step"), (() if since is None else (since,))).fetchall()
        return [{"step": step, "logged_at": logged_at, **json.loads(record)}
                for step, logged_at, record in rows]

    def close(self) -> None:
        self._conn.close()


def _connect(path: Path, *, create: bool) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit) with the WAL journal."""
    if create:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"out_dir {path.parent}: cannot create this directory ({exc.strerror})") \
                from exc
    try:
        conn = sqlite3.connect(path if create else f"file:{path}?mode=rw", uri=not create,
                               isolation_level=None, timeout=_BUSY_MS / 1000, check_same_thread=True)
        conn.execute(f"PRAGMA busy_timeout={_BUSY_MS}")
        if create:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
    except sqlite3.Error as exc:
        raise ConfigError(f"{path}: cannot open the monitor store ({exc})") from exc
    return conn


def _check_version(path: Path, run: dict[str, str]) -> None:
    if run.get("schema_version") != str(SCHEMA_VERSION):
        raise InputError(f"{path}: monitor store schema {run.get('schema_version')!r}, this parity reads "
                         f"{SCHEMA_VERSION}; read it with the parity version that wrote it "
                         f"({run.get('parity_version', '?')})")
