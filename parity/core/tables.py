"""Rows of JSONL and Parquet files (dumps, records, prompt datasets), each with the location an
error message should name.

The format follows the suffix (`.parquet` is Parquet, anything else JSONL); a row's location is
`"<file>:<line>"` (editor line numbers) or `"<file> row <n>"` (1-based). Standard library, plus
pyarrow for Parquet.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

from parity.core.errors import ConfigError, InputError
from parity.core.outputs import write_atomic
from parity.core.schema import NONFINITE_JSON, json_safe

PARQUET_SUFFIX = ".parquet"
#: the key of a JSON row that holds null for a non-finite float (what readers that predate the key see:
#: no value) and names what each was in `NONFINITE_JSON` spelling, e.g. {"k3_kl": "inf"}.
NONFINITE_KEY = "nonfinite"
#: the key of a JSON row naming the non-finite floats inside its lists (and opaque values) that are
#: null there (`nonfinite_items_as_null`).
NONFINITE_ITEMS_KEY = "nonfinite_items"


def read_rows(path: str | Path, *, id_columns: Collection[str] = (),
              float_columns: Collection[str] = ()) -> Iterator[tuple[str, dict[str, Any]]]:
    """(location, row) for every row of a JSONL or Parquet file, in file order. A Parquet column named
    in `id_columns` (token ids) must store integers of 32 bits or more, one in `float_columns`
    (logprobs, temperatures) floats of 32 bits or more: an InputError names the column otherwise
    (see `check_parquet_types`)."""
    path = Path(path)
    if path.suffix == PARQUET_SUFFIX:
        return _parquet_rows(_existing(path), id_columns, float_columns)
    return read_jsonl(path)


def read_jsonl(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(location, object) for every non-blank line of a JSONL file, whatever its suffix."""
    return _jsonl_rows(_existing(Path(path)))


def _existing(path: Path) -> Path:
    if path.is_dir():
        raise InputError(f"{path}: is a directory; give a JSONL or Parquet file")
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    return path


def write_rows(path: str | Path, rows: Sequence[dict[str, Any]]) -> Path:
    """Write rows as JSONL, or as Parquet for a `.parquet` path, atomically; returns the path. A
    Parquet file has the columns of every row (a key only some rows have is null in the others)."""
    path = Path(path)
    if path.suffix != PARQUET_SUFFIX:
        return write_jsonl(path, rows)
    pa, pq = pyarrow()
    # pyarrow takes the columns from the first row alone: a later row's response_mask would be lost
    columns = list(dict.fromkeys(key for row in rows for key in row))
    table = pa.Table.from_pylist([{key: row.get(key) for key in columns} for row in rows])
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:  # as `write_atomic`: a run killed mid-write leaves the old file, never half of a new one
        pq.write_table(table, str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_jsonl(path: str | Path, rows: Sequence[dict[str, Any]]) -> Path:
    """Write rows as strict JSONL whatever the suffix, atomically; non-finite floats (a -inf
    logprob) are spelled as `parity.core.schema.NONFINITE_JSON` strings, which the readers turn back."""
    return write_atomic(path, "".join(json.dumps(json_safe(row), allow_nan=False) + "\n" for row in rows))


def nonfinite_as_null(row: dict[str, Any]) -> dict[str, Any]:
    """`row` with each non-finite float as null and, if there is one, `NONFINITE_KEY` naming what each
    was, so that +inf, -inf and NaN read back as themselves and not as "not measured"."""
    marks = {k: json_safe(float(v)) for k, v in row.items()
             if isinstance(v, numbers.Real) and not isinstance(v, numbers.Integral) and not math.isfinite(v)}
    if not marks:
        return dict(row)
    return {**{k: None if k in marks else v for k, v in row.items()}, NONFINITE_KEY: marks}


def nonfinite_restored(row: dict[str, Any], where: str) -> dict[str, Any]:
    """The inverse of `nonfinite_as_null` (a row without the key, as older files hold, is returned as
    is); InputError naming `where` for a key that is malformed or contradicts its row."""
    if NONFINITE_KEY not in row:
        return row
    marks = row[NONFINITE_KEY]
    bad = None if not isinstance(marks, dict) else next(
        (k for k, v in marks.items() if not isinstance(v, str) or v not in NONFINITE_JSON
         or row.get(k, 0) is not None), None)
    if not isinstance(marks, dict) or bad is not None:
        raise InputError(f"{where}: {NONFINITE_KEY!r} must map fields that are null to one of "
                         f"{list(NONFINITE_JSON)}, got {marks!r}" + (f" (field {bad!r})" if bad else "")
                         + "; was it edited? Write the file with parity again")
    out = {k: v for k, v in row.items() if k != NONFINITE_KEY}
    return {**out, **{k: NONFINITE_JSON[v] for k, v in marks.items()}}


def nonfinite_items_as_null(row: dict[str, Any], opaque: Collection[str] = ()) -> dict[str, Any]:
    """`row` with each non-finite float that `NONFINITE_KEY` cannot name as null: those inside its list
    values (through lists only; a dict inside is marked by its own keys) and, for a key in `opaque` (a
    user's dict, whose own keys parity never reads as marks), anywhere inside its value. If there is one,
    `NONFINITE_ITEMS_KEY` names each as `[[key, index or key, ...], "inf" | "-inf" | "nan"]`; readers that
    predate it see the null and an extra key."""
    marks: list[list[Any]] = []
    out = {k: _items_nulled(v, [k], marks, k in opaque) for k, v in row.items()}
    return {**out, NONFINITE_ITEMS_KEY: marks} if marks else out


def _items_nulled(value: Any, path: list[Any], marks: list[list[Any]], deep: bool) -> Any:
    if len(path) > 1 and isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral) \
            and not math.isfinite(value):
        marks.append([path, json_safe(float(value))])
        return None
    if isinstance(value, (list, tuple)):
        return [_items_nulled(v, [*path, i], marks, deep) for i, v in enumerate(value)]
    if deep and isinstance(value, dict):
        return {k: _items_nulled(v, [*path, k], marks, deep) for k, v in value.items()}
    return value


def nonfinite_items_restored(row: dict[str, Any], where: str) -> dict[str, Any]:
    """The inverse of `nonfinite_items_as_null` (a row without the key, as older files hold, is returned
    as is); InputError naming `where` for a key that is malformed or names no null of its row."""
    if NONFINITE_ITEMS_KEY not in row:
        return row
    out = {k: v for k, v in row.items() if k != NONFINITE_ITEMS_KEY}
    marks = row[NONFINITE_ITEMS_KEY]
    for mark in marks if isinstance(marks, list) else [marks]:
        path = mark[0] if isinstance(mark, list) and len(mark) == 2 and isinstance(mark[0], list) else None
        if not path or not isinstance(path[0], str) or not isinstance(mark[1], str) \
                or mark[1] not in NONFINITE_JSON or not _set_null(out, path, NONFINITE_JSON[mark[1]]):
            raise InputError(f"{where}: {NONFINITE_ITEMS_KEY!r} must list [path, one of "
                             f"{list(NONFINITE_JSON)}] of values that are null, got {mark!r}; was it edited? "
                             "Write the file with parity again")
    return out


def _set_null(row: dict[str, Any], path: list[Any], value: float) -> bool:
    """Put `value` at `path` of `row` (copying the containers on the way), where a null is; False when
    the path leads to no null."""
    holder: Any = row
    for i, step in enumerate(path):
        fits = (isinstance(holder, dict) and isinstance(step, str) and step in holder) or (
            isinstance(holder, list) and type(step) is int and 0 <= step < len(holder))
        if not fits:
            return False
        if i == len(path) - 1:
            if holder[step] is not None:
                return False
            holder[step] = value
            return True
        inner = holder[step]
        holder[step] = dict(inner) if isinstance(inner, dict) else list(inner) if isinstance(inner, list) \
            else inner
        holder = holder[step]
    return False


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    with path.open(encoding="utf-8-sig") as f:  # -sig: a BOM that Windows editors write first is no data
        for lineno, line in _lines(f, path):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line, object_pairs_hook=_unique_keys)
            except json.JSONDecodeError as e:
                raise InputError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from e
            except _RepeatedKey as e:
                raise InputError(f"{where}: key {e.args[0]!r} appears twice in one object; JSON keeps only "
                                 "the last one, so which value is meant cannot be told: give each key "
                                 "once") from e
            if not isinstance(obj, dict):
                raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            yield where, obj


class _RepeatedKey(Exception):
    """A key twice in one JSON object (`json.loads` would keep the last silently)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _RepeatedKey(key)
        obj[key] = value
    return obj


def _lines(f: Any, path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of a text file; non-UTF-8 text is an InputError naming the line."""
    lineno = 0
    try:
        for lineno, line in enumerate(f, 1):
            yield lineno, line
    except UnicodeDecodeError as e:
        raise InputError(f"{path}:{lineno + 1}: not UTF-8 text ({e.reason} at byte {e.start}); give a JSONL "
                         "file, or a Parquet file named *.parquet") from e


def _parquet_rows(path: Path, id_columns: Collection[str] = (),
                  float_columns: Collection[str] = ()) -> Iterator[tuple[str, dict[str, Any]]]:
    _, pq = pyarrow()
    try:
        reader = pq.ParquetFile(str(path))
    except Exception as e:  # pyarrow raises several unrelated types for a file that is not Parquet
        raise InputError(f"{path}: not a readable Parquet file ({e})") from e
    names = reader.schema_arrow.names
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise InputError(f"{path}: column {repeated[0]!r} appears more than once; a row would keep only the "
                         "last one, so which is meant cannot be told: give each column once")
    check_parquet_types(path, reader.schema_arrow, id_columns, float_columns)
    row = 0
    # batch by batch: a dataset read with a `limit` never materializes the whole file
    for batch in reader.iter_batches(batch_size=1024):
        for obj in batch.to_pylist():
            row += 1
            yield f"{path} row {row}", obj


def check_parquet_types(path: Path, schema: Any, id_columns: Collection[str],
                        float_columns: Collection[str]) -> None:
    """InputError for a token-id column stored in an integer type under 32 bits, or a float column
    (logprobs) in a float type under 32 bits (lists of them included). Rows read as plain Python
    numbers, so the type is seen here or never: an id of 300 stored as uint8 reads as a valid-looking
    44, and a float16 logprob is rounded by up to ~4e-3 nats at -8, which would be reported as drift.
    A field of a struct column is named `column.field` (a `sampling` struct's float16 temperature
    would read 0.7 as 0.7002)."""
    pa, _ = pyarrow()
    fields = [(field.name, field.type) for field in schema]
    while fields:
        name, kind = fields.pop(0)
        kind = _leaf_type(pa, kind)
        if pa.types.is_struct(kind):
            fields += [(f"{name}.{kind.field(i).name}", kind.field(i).type) for i in range(kind.num_fields)]
            continue
        if name in id_columns and pa.types.is_integer(kind) and kind.bit_width < 32:
            top = 2 ** (kind.bit_width - pa.types.is_signed_integer(kind)) - 1
            raise InputError(f"{path}: column {name!r} stores token ids as {kind}, which wraps every "
                             f"id past {top} into another (valid-looking) id; write the ids as int32 or "
                             "int64")
        if name in float_columns and pa.types.is_floating(kind) and kind.bit_width < 32:
            raise InputError(f"{path}: column {name!r} stores its values as {kind}, rounded to about 3 "
                             "digits (a logprob of -8 by ~4e-3 nats, read as drift); write it as float32 or "
                             "float64, as the engine gave it")


def _leaf_type(pa: Any, kind: Any) -> Any:
    """The element type of a (nested) list type, or `kind` itself."""
    while pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind) \
            or getattr(pa.types, "is_list_view", lambda _: False)(kind) \
            or getattr(pa.types, "is_large_list_view", lambda _: False)(kind):
        kind = kind.value_type
    return kind


def pyarrow() -> tuple[Any, Any]:
    """(pyarrow, pyarrow.parquet), or ConfigError naming the install when pyarrow is missing."""
    try:
        # pyarrow only for Parquet: an optional dependency that JSONL files never need
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ConfigError("Parquet needs pyarrow: pip install pyarrow (or use a .jsonl file)") from e
    return pa, pq
