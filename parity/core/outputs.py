"""Output paths checked before any work, so a run never loses its sampling to an unwritable path.
Missing directories are created up front; a path that can never be written is a `ConfigError`
naming the option.
"""

from __future__ import annotations

import os
from pathlib import Path

from parity.core.errors import ConfigError


def output_dir(path: str | os.PathLike[str], option: str) -> Path:
    """`path` as a directory that exists and can be written, created if missing."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError as exc:
        raise ConfigError(f"{option} {path}: a file is in the way of this directory; give a directory path") \
            from exc
    except OSError as exc:
        raise ConfigError(f"{option} {path}: cannot create this directory ({exc.strerror})") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{option} {path}: this directory is not writable")
    return path


def output_file(path: str | os.PathLike[str], option: str) -> Path:
    """`path` as a file that can be written: its directory exists (created if missing) and is
    writable, and the path is not a directory or a read-only file."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{option} {path}: is a directory; give a file path")
    output_dir(path.parent, option)
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(f"{option} {path}: the file exists and is not writable")
    return path


def write_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write `text` to `path` through a temporary file in the same directory and a rename: a reader
    (or a run killed mid-write) sees the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
