"""The monitor's store: one SQLite file per run, one row per logged step, append-only.

Tables `run`, `steps(attempt, step, logged_at, record)`, `advice`, plus `monitor.lock`. A resumed
run's steps start a new attempt that supersedes earlier steps from its first on; `steps()` reads
the run as it stands. One transaction per step survives SIGKILL; journal "auto" is WAL locally,
rollback on network filesystems. One writer per directory (fcntl lock); foreign files are refused,
never altered; readers open read-only; triggers forbid UPDATE and DELETE. A non-finite float is
null there, named in its dict's "nonfinite" entry, or "nonfinite_items" for one inside a list or the
user's `meta` (`stored_form`; older stores have none, older readers see the null). The run table
names each parity version that appended steps. Standard library only.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import socket
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

from parity.core import tables
from parity.core.errors import ConfigError, InputError
from parity.core.schema import VERSION

#: the store's file name inside a monitor directory.
STORE_FILE = "monitor.sqlite"
#: the writer's lock file inside a monitor directory.
LOCK_FILE = "monitor.lock"
#: bumped when the tables change; version 1 (no attempts) is still read, never written.
SCHEMA_VERSION = 2
#: the run-table key: a JSON list of the parity versions that appended steps (older parity ignores it).
VERSIONS_KEY = "parity_versions"
#: a record's values that are the user's own (their keys never read as parity's marks).
OPAQUE_KEYS = frozenset({"meta"})
#: SQLite's `application_id` of a parity monitor store ("pary").
APPLICATION_ID = 0x70617279
#: the journal modes `journal=` takes; "auto" picks "delete" on a network filesystem, else "wal".
JOURNALS = ("auto", "wal", "delete")
#: filesystem types where WAL is unsafe (its shared-memory index needs one host's memory).
NETWORK_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb", "smb2", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "cephfs",
    "glusterfs", "fuse.glusterfs", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.juicefs", "9p",
    "afs", "ocfs2", "gfs2", "panfs", "wekafs", "pvfs2", "orangefs",
})
#: how long a connection waits for another's lock (ms): the page thread reads while the trainer writes.
_BUSY_MS = 10_000
_HEADER = b"SQLite format 3\x00"
#: lock files this process holds: fcntl locks are per process, so a second Monitor of this process
#: on the same directory is caught here
_HELD: set[str] = set()
_HELD_LOCK = threading.Lock()

_SCHEMA = """
CREATE TABLE IF NOT EXISTS run (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS steps (attempt INTEGER NOT NULL DEFAULT 0, step INTEGER NOT NULL,
                                  logged_at REAL NOT NULL, record TEXT NOT NULL, PRIMARY KEY (attempt, step));
CREATE TABLE IF NOT EXISTS advice (attempt INTEGER NOT NULL, step INTEGER NOT NULL,
                                   recommendation TEXT NOT NULL, PRIMARY KEY (attempt, step));
CREATE TRIGGER IF NOT EXISTS steps_no_update BEFORE UPDATE ON steps
  BEGIN SELECT RAISE(ABORT, 'monitor steps are append-only'); END;
CREATE TRIGGER IF NOT EXISTS steps_no_delete BEFORE DELETE ON steps
  BEGIN SELECT RAISE(ABORT, 'monitor steps are append-only'); END;
CREATE TRIGGER IF NOT EXISTS steps_increase BEFORE INSERT ON steps
  WHEN NEW.attempt < (SELECT MAX(attempt) FROM steps)
    OR NEW.step <= (SELECT MAX(step) FROM steps WHERE attempt = NEW.attempt)
  BEGIN SELECT RAISE(ABORT, 'monitor steps must increase within an attempt'); END;
"""


def store_path(out_dir: str | Path) -> Path:
    """The store file of monitor directory `out_dir`."""
    return Path(out_dir) / STORE_FILE


def json_ready(value: Any, *, keep_nonfinite: bool = False) -> Any:
    """`value` with every non-finite float as None (JSON has no NaN or infinity, and browsers and
    `jq` refuse them; kept with `keep_nonfinite`), tuples as lists, NumPy and torch scalars as Python
    numbers (`.item()`); anything else JSON cannot hold is an InputError."""
    if _is_scalar(value):
        value = value.item()
    if isinstance(value, float):
        return value if keep_nonfinite or math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_ready(v, keep_nonfinite=keep_nonfinite) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v, keep_nonfinite=keep_nonfinite) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    raise InputError(f"cannot store {type(value).__name__} {value!r:.60} in the monitor; give plain numbers, "
                     "strings, lists and dicts")


def stored_form(value: Any) -> Any:
    """`value` as `json_ready` gives it, each dict's non-finite floats null and named in its "nonfinite"
    entry (`parity.core.tables`, as the loop record), those in its lists or `OPAQUE_KEYS` values in its
    "nonfinite_items": an infinite k3_kl or a -inf top-k logprob is not stored as "not measured"."""
    return json_ready(_marked(value))


def _marked(value: Any) -> Any:
    if _is_scalar(value):
        value = value.item()
    if isinstance(value, dict):
        inner = {str(k): json_ready(v, keep_nonfinite=True) if k in OPAQUE_KEYS else _marked(v)
                 for k, v in value.items()}
        return tables.nonfinite_as_null(tables.nonfinite_items_as_null(inner, OPAQUE_KEYS))
    if isinstance(value, (list, tuple)):
        return [_marked(v) for v in value]
    return value


def _restored(value: Any, where: str) -> Any:
    """The inverse of `stored_form` (InputError naming `where` for a malformed "nonfinite" or
    "nonfinite_items" entry); an `OPAQUE_KEYS` value is never read for marks of its own."""
    if isinstance(value, dict):
        inner = {k: v if k in OPAQUE_KEYS else _restored(v, where) for k, v in value.items()}
        return tables.nonfinite_restored(tables.nonfinite_items_restored(inner, where), where)
    if isinstance(value, list):
        return [_restored(v, where) for v in value]
    return value


def restored_record(record: dict[str, Any], where: str) -> dict[str, Any]:
    """A stored record with its non-finite floats back (`stored_form`; `meta`'s own keys kept as given)."""
    return _restored(record, where)


def plain(text: Any) -> str:
    """`text` with control characters escaped: a run name or an alert never drives a terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def _is_scalar(value: Any) -> bool:
    """A NumPy scalar or a 0-d tensor/array (duck-typed: `.item()` and an empty shape)."""
    return callable(getattr(value, "item", None)) and tuple(getattr(value, "shape", (0,))) == ()


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem holding `path` (`/proc/self/mounts`' longest mount point above
    it), None where the mount table cannot be read."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    target, best, kind = str(path.resolve()), "", None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def pick_journal(journal: str, out_dir: Path) -> str:
    """"wal" or "delete": `journal` as given, or for "auto" by `out_dir`'s filesystem."""
    if journal not in JOURNALS:
        raise ConfigError(f"journal must be one of {', '.join(JOURNALS)}, got {journal!r}")
    if journal != "auto":
        return journal
    return "delete" if filesystem_type(out_dir) in NETWORK_FILESYSTEMS else "wal"


class MonitorStore:
    """One connection to a monitor's SQLite file (one thread): `create` (the writer, holding the lock
    until `close`) or `open` (read-only).
    """

    def __init__(self, path: Path, conn: sqlite3.Connection, *, lock_fd: int | None = None) -> None:
        self.path = path
        self._conn = conn
        self._lock_fd = lock_fd
        self._lock_key = str(path.parent.resolve() / LOCK_FILE) if lock_fd is not None else None
        #: rows `steps()` could not decode, one line each (also marked in the steps it returns).
        self.problems: list[str] = []
        self._version_noted = False  # this parity's version is in the run's VERSIONS_KEY

    @classmethod
    def create(cls, out_dir: str | Path, run_name: str | None, *, journal: str = "auto") -> MonitorStore:
        """The writer's store in `out_dir` (created if missing). An existing store continues its run:
        its steps stay; `run_name` must then be its name (None takes it). A new store is named
        `run_name`, else the directory's name. `journal`: "auto", "wal" or "delete" (module doc)."""
        out_dir = Path(out_dir)
        mode = pick_journal(journal, out_dir)
        path = store_path(out_dir)
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"out_dir {out_dir}: cannot create this directory ({exc.strerror})") from exc
        lock_fd = _writer_lock(out_dir / LOCK_FILE)
        try:
            version = _check_file(path, writing=True)
            conn = _connect(path, writer=True)
            store = cls(path, conn, lock_fd=lock_fd)
        except BaseException:
            _release(lock_fd, str(out_dir.resolve() / LOCK_FILE))
            raise
        try:
            store._prepare(mode, version)
            run = store.run_info()
            if run_name is not None and run.get("run_name", run_name) != run_name:
                raise ConfigError(f"run_name {run_name!r}: {path} holds run {run['run_name']!r}; a monitor "
                                  "directory holds one run (give its name, None, or another out_dir)")
            if not run.get("run_name"):
                name = run_name if run_name is not None else out_dir.resolve().name
                values = {"run_name": name, "created_at": repr(time.time()), "parity_version": VERSION,
                          "schema_version": str(SCHEMA_VERSION)}
                conn.execute("BEGIN IMMEDIATE")
                conn.executemany("INSERT OR IGNORE INTO run (key, value) VALUES (?, ?)", values.items())
                conn.execute("COMMIT")
        except BaseException:
            store.close()
            raise
        return store

    def _prepare(self, mode: str, version: int | None) -> None:
        conn = self._conn
        if version is not None:
            _quick_check(conn, self.path)
        if version == 1:
            raise InputError(f"{self.path}: a monitor store of schema 1 (written by parity "
                             f"{self.run_info().get('parity_version', '?')}) is read, not continued; "
                             "give this run a new out_dir")
        if version is None:  # before WAL: the mark goes into the file's header, which readers check
            conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
        conn.execute(f"PRAGMA journal_mode={mode.upper()}")
        conn.execute(f"PRAGMA synchronous={'NORMAL' if mode == 'wal' else 'FULL'}")
        conn.executescript(_SCHEMA)

    @classmethod
    def open(cls, out_dir: str | Path) -> MonitorStore:
        """A reader's store of an existing monitor directory (the run may still be going; the file
        may be on a read-only mount)."""
        path = store_path(out_dir)
        if not path.is_file():
            raise InputError(f"{out_dir}: no {STORE_FILE} here; give a directory a parity.Monitor wrote")
        version = _check_file(path, writing=False)
        if version is None:
            raise InputError(f"{path}: not a monitor store (an empty file)")
        store = cls(path, _connect(path, writer=False))
        try:
            _quick_check(store._conn, path)
            run = store.run_info()
            if not run:
                raise InputError(f"{path}: not a monitor store (no run record)")
            _check_version(path, run)
        except BaseException:
            store.close()
            raise
        return store

    def run_info(self) -> dict[str, str]:
        """The run record: run_name, created_at, parity_version, schema_version, VERSIONS_KEY ({} before)."""
        try:
            return dict(self._conn.execute("SELECT key, value FROM run").fetchall())
        except sqlite3.OperationalError:  # no run table: not (yet) a monitor store
            return {}

    def last_attempt(self) -> tuple[int, int | None]:
        """(the latest attempt, 0 before the first step; its highest step, None before its first)."""
        attempt = self._conn.execute("SELECT MAX(attempt) FROM steps").fetchone()[0] or 0
        step = self._conn.execute("SELECT MAX(step) FROM steps WHERE attempt = ?", (attempt,)).fetchone()[0]
        return attempt, step

    def last_step(self) -> int | None:
        """The highest step of the latest attempt, None before the first."""
        return self.last_attempt()[1]

    def latest_record(self) -> dict[str, Any] | None:
        """The stored record of the latest attempt's last step (None before the first, or where it
        does not decode)."""
        row = self._conn.execute("SELECT record FROM steps ORDER BY attempt DESC, step DESC LIMIT 1"
                                 ).fetchone()
        try:
            record = json.loads(row[0]) if row is not None else None
            return restored_record(record, "the latest step") if isinstance(record, dict) else None
        except (ValueError, TypeError):  # InputError too: a malformed mark
            return None

    def append(self, step: int, record: dict[str, Any], *, attempt: int = 0) -> float:
        """Store `record` as step `step` of `attempt` in one transaction (see the module doc);
        returns the time it was logged at (unix seconds)."""
        text = json.dumps(stored_form(record), allow_nan=False, separators=(",", ":"))
        conn = self._conn
        logged_at = time.time()
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute("INSERT INTO steps (attempt, step, logged_at, record) VALUES (?, ?, ?, ?)",
                         (attempt, step, logged_at, text))
            if not self._version_noted:  # this version among the run's
                conn.execute("INSERT OR REPLACE INTO run (key, value) VALUES (?, ?)",
                             (VERSIONS_KEY, json.dumps(appended_by(self.run_info(), VERSION))))
            conn.execute("COMMIT")
            self._version_noted = True
        except BaseException as exc:
            conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.IntegrityError):
                raise InputError(f"step {step}: {self.path} refused it ({exc}); steps must increase within "
                                 "an attempt (resume=True starts a new one)") from exc
            raise
        return logged_at

    def append_advice(self, attempt: int, step: int, recommendation: dict[str, Any]) -> None:
        """Store the advisor's recommendation of a stored step (computed off the training thread)."""
        text = json.dumps(stored_form(recommendation), allow_nan=False, separators=(",", ":"))
        self._conn.execute("INSERT OR IGNORE INTO advice (attempt, step, recommendation) VALUES (?, ?, ?)",
                           (attempt, step, text))

    def steps(self, since: int | None = None, *, every_attempt: bool = False) -> list[dict[str, Any]]:
        """The run's steps as it stands (after `since`), in step order, `{"step", "logged_at", "attempt",
        **record}`; a later attempt's first step has `"restart"`. `every_attempt`: every stored row.
        A row that does not decode is kept as `{..., "undecodable": reason}` and named in `problems`.
        """
        self.problems = []
        columns = {row[1] for row in self._conn.execute("PRAGMA table_info(steps)")}
        attempt = "attempt" if "attempt" in columns else "0"
        rows = self._conn.execute(f"SELECT {attempt}, step, logged_at, record FROM steps "
                                  f"ORDER BY {attempt}, step").fetchall()
        tables = {r[0] for r in self._conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        advice = dict(((a, s), r) for a, s, r in self._conn.execute(
            "SELECT attempt, step, recommendation FROM advice")) if "advice" in tables else {}
        if every_attempt:
            kept = [(a, s, t, r, None) for a, s, t, r in rows]
        else:
            kept = _latest_view(rows)
        out = []
        for a, s, t, text, restart in kept:
            if since is not None and s <= since:
                continue
            item: dict[str, Any] = {"step": s, "logged_at": t, "attempt": a}
            try:
                record = json.loads(text)
                if not isinstance(record, dict):
                    raise ValueError(f"a JSON {type(record).__name__}, not an object")
                item = {**restored_record(record, f"step {s} (attempt {a})"), **item}
                if (a, s) in advice:
                    item["recommendation"] = _restored(json.loads(advice[(a, s)]), f"advice of step {s}")
            except (ValueError, TypeError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
                item["undecodable"] = reason
                self.problems.append(f"{self.path}: step {s} (attempt {a}) does not decode ({reason}); "
                                     "the other steps are read")
            if restart is not None:
                item["restart"] = restart
            out.append(item)
        return out

    def close(self) -> None:
        self._conn.close()
        if self._lock_fd is not None and self._lock_key is not None:
            _release(self._lock_fd, self._lock_key)
            self._lock_fd = None


def appended_by(run: dict[str, str], *also: str) -> list[str]:
    """The parity versions that appended the run's steps, first use first, then `also` (a store from
    before `VERSIONS_KEY` names only its creator's)."""
    try:
        noted = json.loads(run.get(VERSIONS_KEY) or "[]")
    except ValueError:
        noted = []
    noted = [v for v in noted if isinstance(v, str)] if isinstance(noted, list) else []
    return list(dict.fromkeys([run.get("parity_version", "?"), *noted, *also]))


def _latest_view(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The run as it stands: each attempt supersedes earlier ones' steps from its first step on."""
    by_step: dict[int, tuple[Any, ...]] = {}
    current = None
    for a, s, t, r in rows:
        restart = None
        if a != current:
            current = a
            if by_step:
                superseded = sorted(k for k in by_step if k >= s)
                for k in superseded:
                    del by_step[k]
                restart = {"attempt": a, "superseded": len(superseded)}
        by_step[s] = (a, s, t, r, restart)
    return [by_step[k] for k in sorted(by_step)]


def _writer_lock(path: Path) -> int:
    """Take the writer lock (fcntl, NFS too) with host and PID; ConfigError naming another holder."""
    key = str(path.parent.resolve() / path.name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot create the monitor's writer lock ({exc.strerror}); the out_dir "
                          "must be writable") from exc
    with _HELD_LOCK:
        try:
            if key in _HELD:
                raise OSError("held in this process")
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 400, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise ConfigError(f"{path.parent}: another Monitor writes this directory ({holder}); one writer "
                              "per directory: give each process (each rank) its own out_dir") from None
        _HELD.add(key)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()} since {time.strftime('%Y-%m-%dT%H:%M:%S')}"
              .encode(), 0)
    return fd


def _release(fd: int, key: str) -> None:
    """Give the writer lock back (closing the file releases the fcntl lock)."""
    with _HELD_LOCK:
        _HELD.discard(key)
        os.close(fd)


def _check_file(path: Path, *, writing: bool) -> int | None:
    """The store's schema version (None: no or empty file); InputError for a non-parity file."""
    try:
        with path.open("rb") as f:
            header = f.read(100)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InputError(f"{path}: cannot read it ({exc.strerror})") from exc
    if not header:
        return None
    foreign = (f"{path} is not a parity monitor store ({{what}}); parity never alters another program's "
               "file: give the Monitor its own out_dir")
    if len(header) < 100 or not header.startswith(_HEADER):
        raise InputError(foreign.format(what="not an SQLite file"))
    app_id = int.from_bytes(header[68:72], "big")
    if app_id == APPLICATION_ID:
        return SCHEMA_VERSION
    if app_id != 0:
        raise InputError(foreign.format(what=f"SQLite application_id {app_id:#x}"))
    # application_id 0: parity's schema-1 stores had none; anything else is foreign
    conn = _connect(path, writer=False)
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        version = dict(conn.execute("SELECT key, value FROM run").fetchall()).get("schema_version") \
            if tables == {"run", "steps"} else None
    except sqlite3.DatabaseError as exc:
        raise InputError(foreign.format(what=str(exc))) from exc
    finally:
        conn.close()
    if not tables and writing:
        return None
    if version != "1":
        raise InputError(foreign.format(what=f"an SQLite file with tables {sorted(tables)}"))
    return 1


def _connect(path: Path, *, writer: bool) -> sqlite3.Connection:
    """An autocommit connection: read-write for the writer, read-only for readers."""
    uri = "file:" + quote(str(path.resolve()), safe="/")
    try:
        if writer:
            conn = sqlite3.connect(uri + "?mode=rwc", uri=True, isolation_level=None,
                                   timeout=_BUSY_MS / 1000)
        else:
            conn = _read_only(uri)
        conn.execute(f"PRAGMA busy_timeout={_BUSY_MS}")
    except sqlite3.Error as exc:
        raise ConfigError(f"{path}: cannot open the monitor store ({exc})") from exc
    return conn


def _read_only(uri: str) -> sqlite3.Connection:
    """A read-only connection, immutable where reading would need a write (WAL on a read-only mount)."""
    conn = sqlite3.connect(uri + "?mode=ro", uri=True, isolation_level=None, timeout=_BUSY_MS / 1000)
    try:
        conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
    except sqlite3.OperationalError:
        conn.close()
        conn = sqlite3.connect(uri + "?mode=ro&immutable=1", uri=True, isolation_level=None)
    return conn


def _quick_check(conn: sqlite3.Connection, path: Path) -> None:
    try:
        result = [r[0] for r in conn.execute("PRAGMA quick_check").fetchall()]
    except sqlite3.DatabaseError as exc:
        raise InputError(f"{path}: the monitor store is damaged ({exc})") from exc
    if result != ["ok"]:
        raise InputError(f"{path}: the monitor store is damaged (quick_check: {'; '.join(result[:3])})")


def _check_version(path: Path, run: dict[str, str]) -> None:
    if run.get("schema_version") not in ("1", str(SCHEMA_VERSION)):
        raise InputError(f"{path}: monitor store schema {run.get('schema_version')!r}, this parity reads "
                         f"1 and {SCHEMA_VERSION}; read it with the parity version that wrote it "
                         f"({run.get('parity_version', '?')})")
