"""Typed results to JSON and back: `gpu_results.json`, and what a child process prints or saves.

`plain` turns dataclasses into dicts; `decode` rebuilds the typed results from that JSON (int
keys written as strings come back as ints, `X | Failure` fields as a `Failure` where the JSON
holds an error), so the summary table reads the sections a child process ran as typed results too.
"""

from __future__ import annotations

import dataclasses
import traceback
import types
import typing
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

from benchmarks.gpu.results import Failure

T = TypeVar("T")


def plain(value: Any) -> Any:
    """Results as JSON-ready values: dataclasses become dicts, recursively."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def failure() -> Failure:
    """The record of the measurement that just raised (call in an `except` block)."""
    return Failure(error=traceback.format_exc()[-3000:])


def decode(kind: Any, data: Any) -> Any:
    """`data` (JSON) as a value of type `kind`: a dataclass, a union with `Failure` or None, a dict,
    list or tuple of those, or a plain value. Keys the dataclass does not have (a section's
    "section_seconds") are ignored; a missing one raises TypeError."""
    origin = get_origin(kind)
    if kind is Any:
        return data
    if origin in (typing.Union, types.UnionType):
        options = get_args(kind)
        if data is None and type(None) in options:
            return None
        if Failure in options and isinstance(data, dict) and "error" in data:
            return Failure(error=str(data["error"]))
        (value_kind,) = [o for o in options if o not in (Failure, type(None))]
        return decode(value_kind, data)
    if dataclasses.is_dataclass(kind):
        hints = get_type_hints(kind)
        return kind(**{f.name: decode(hints[f.name], data[f.name])
                       for f in dataclasses.fields(kind) if f.name in data})
    if origin is dict:
        key_kind, value_kind = get_args(kind)
        return {decode(key_kind, k): decode(value_kind, v) for k, v in data.items()}
    if origin is list:
        (item_kind,) = get_args(kind)
        return [decode(item_kind, v) for v in data]
    if origin is tuple:
        return tuple(decode(k, v) for k, v in zip(get_args(kind), data, strict=True))
    return kind(data)


def decoded(kind: type[T], data: Any) -> T | Failure:
    """`decode(kind, data)`, or a Failure saying why `data` is not a `kind` (what a child wrote)."""
    try:
        return decode(kind | Failure, data)
    except (KeyError, TypeError, ValueError) as exc:
        return Failure(error=f"unreadable {kind.__name__}: {exc!r}")
