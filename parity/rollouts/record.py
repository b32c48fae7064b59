"""Recorded runs: the requests of a run and the rollouts of every backend that served them, in
one file that replays through any backend and scores with `parity score`.

JSONL lines by `kind`: a "header" (format "parity-record", version 1, model, meta), "request"s
with every sampling field and seed, and "rollout"s from any backends, matched by (request_id,
sample_index). A rollout without `sampling` takes its request's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parity.backends import Backend
from parity.backends.turns import generate
from parity.core.errors import InputError, ParityError
from parity.core.tables import read_jsonl, write_jsonl
from parity.core.types import Request, Rollout
from parity.models import model_limits
from parity.rollouts.matching import check_answer, check_sampled_as_asked

RECORD_FORMAT = "parity-record"
RECORD_VERSION = 1


@dataclass(frozen=True)
class Record:
    """A recorded run: the requests, and the rollouts of each backend that served them."""

    requests: tuple[Request, ...]
    rollouts: dict[str, tuple[Rollout, ...]] = field(default_factory=dict)
    model: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def write_record(path: str | Path, requests: Sequence[Request], rollouts: Sequence[Rollout] = (), *,
                 model: str | None = None, meta: dict[str, Any] | None = None) -> Path:
    """Write a record file; `rollouts` may mix backends (each rollout names its own). What
    `read_record` would refuse is refused here, and nothing is written."""
    _unique_ids(requests)
    _check_model_meta(model, meta or {})
    by_id = {r.request_id: r for r in requests}
    seen: set[tuple[str, str, int]] = set()
    for rollout in rollouts:  # what read_record refuses is refused here, before any file is written
        _checked_rollout(rollout, by_id, seen)
    lines = [{"kind": "header", "format": RECORD_FORMAT, "version": RECORD_VERSION, "model": model,
              "meta": meta or {}}]
    lines += [{"kind": "request", **r.to_dict()} for r in requests]
    lines += [{"kind": "rollout", **r.to_dict()} for r in rollouts]
    return write_jsonl(path, lines)


def read_record(path: str | Path) -> Record:
    """Parse a record file; errors name the file and line. Rollouts without sampling take their
    request's."""
    requests: list[Request] = []
    by_id: dict[str, Request] = {}
    rollouts: dict[str, list[Rollout]] = {}
    seen: set[tuple[str, str, int]] = set()
    header: dict[str, Any] | None = None
    for where, obj in read_jsonl(path):
        kind = obj.pop("kind", None)
        try:
            if kind == "header":
                version = obj.get("version")
                if (obj.get("format") != RECORD_FORMAT or not isinstance(version, int)
                        or isinstance(version, bool) or version != RECORD_VERSION):  # not true, not 1.0
                    raise InputError(f"not a {RECORD_FORMAT} v{RECORD_VERSION} header: format="
                                     f"{obj.get('format')!r} version={obj.get('version')!r}")
                if header is not None:
                    raise InputError("a second header line; a record has one header, first (two files "
                                     "concatenated?)")
                _check_model_meta(obj.get("model"), obj.get("meta", {}))
                header = obj
            elif header is None:
                raise InputError(f"the first line must be the header ({{'kind': 'header', 'format': "
                                 f"{RECORD_FORMAT!r}, ...}})")
            elif kind == "request":
                request = Request.from_dict(obj)
                if request.request_id in by_id:
                    raise InputError(f"request_id {request.request_id!r} appears more than once; replay "
                                     "sends each request once and matches rollouts by id")
                requests.append(request)
                by_id[request.request_id] = request
            elif kind == "rollout":
                rollout = _checked_rollout(Rollout.from_dict(obj), by_id, seen)
                rollouts.setdefault(rollout.backend, []).append(rollout)
            else:
                raise InputError(f"unknown kind {kind!r}; expected 'header', 'request' or 'rollout'")
        except KeyError as e:
            raise InputError(f"{where}: missing field {e.args[0]!r}") from e
        except ParityError as e:
            raise type(e)(f"{where}: {e}") from e
    if header is None:
        raise InputError(f"{path}: empty record (no header line)")
    return Record(tuple(requests), {k: tuple(v) for k, v in rollouts.items()}, header.get("model"),
                  header.get("meta", {}))


def replay(record: Record, backend: Backend) -> list[Rollout]:
    """Send the record's requests, unchanged, through `backend` (checked first against its model's
    vocabulary and context: a bad id kills some engines)."""
    if not record.requests:
        raise InputError("the record has no requests to replay")
    model_limits(backend.model_path).check(record.requests)
    return generate(backend, record.requests)  # trajectories run turn by turn where needed


def _check_model_meta(model: Any, meta: Any) -> None:
    """The header's model (a string or None) and meta (a dict), as `read_record` requires them."""
    if model is not None and not isinstance(model, str):
        raise InputError(f"header model must be a string (a model name or path) or null, got {model!r}")
    if not isinstance(meta, dict):
        raise InputError(f"header meta must be an object, got {meta!r:.80}")


def _checked_rollout(rollout: Rollout, by_id: dict[str, Request], seen: set[tuple[str, str, int]]) -> Rollout:
    """`rollout` checked against its request in `by_id` and the rollouts in `seen` (added to it), with
    its request's sampling where it has none; the one check of both `write_record` and `read_record`."""
    if (rollout.backend, *rollout.key) in seen:
        raise InputError(f"rollout {rollout.key} of backend {rollout.backend!r} appears more than once")
    seen.add((rollout.backend, *rollout.key))
    request = by_id.get(rollout.request_id)
    if request is None:
        raise InputError(f"rollout {rollout.key} answers request_id {rollout.request_id!r}, which no "
                         "request line of the record names (requests come before rollouts)")
    if rollout.sample_index >= request.sampling.n:  # a sample its request never asked for
        raise InputError(f"rollout {rollout.key} of backend {rollout.backend!r} has sample_index "
                         f"{rollout.sample_index} but its request asks for n={request.sampling.n} samples "
                         f"(indices 0 to {request.sampling.n - 1}); fix the rollout's sample_index or the "
                         "request's n")
    check_answer(rollout, request, error=InputError)
    check_sampled_as_asked(rollout, request)
    if rollout.sampling is None:
        rollout = dataclasses.replace(rollout, sampling=request.sampling)
    return rollout


def _unique_ids(requests: Sequence[Request]) -> None:
    ids = [r.request_id for r in requests]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise InputError(f"request_id {repeated[0]!r} is used by more than one request; give every request "
                         "its own id")
