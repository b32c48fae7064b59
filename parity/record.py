"""Rollouts on disk: recorded runs that replay through any backend, and offline ingestion.

Record (JSONL, one object per line, `kind` says which):
    {"kind": "header", "format": "parity-record", "version": 1, "model": ..., "meta": {...}}
    {"kind": "request", "request_id": ..., "prompt_ids": [...], "sampling": {every field}}
    {"kind": "rollout", ...Rollout.to_dict()}          (any number, from any backends)
Requests carry every sampling field and seed, so `replay` sends exactly the same requests
through another backend and the rollouts line up by (request_id, sample_index).

Ingestion (`load_rollouts`) reads rollouts produced elsewhere, e.g. on a TRT-LLM cluster
parity cannot reach, from JSONL or Parquet with one rollout per row:
    prompt_ids, response_ids, rollout_logprobs            (required)
    request_id, sample_index, finish_reason, logprobs_mode, routed_experts, response_mask
verl's batch key names are accepted too (`prompts`, `responses`, `rollout_log_probs`,
`response_mask` to strip right padding). verl's `trainer.rollout_data_dir` dump is not: it
holds decoded text and scores, no token ids or logprobs.
"""

from __future__ import annotations

import argparse
import json
import math
import numbers
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from parity.backends import Backend, get_backend, parse_option
from parity.errors import EXIT_INTERRUPTED, ConfigError, InputError, ParityError, report_error
from parity.models import model_limits
from parity.outputs import output_file
from parity.schema import LOGPROBS_MODES
from parity.types import Request, Rollout

RECORD_FORMAT = "parity-record"
RECORD_VERSION = 1

#: ingestion column -> accepted spellings, parity's first.
COLUMN_ALIASES: dict[str, tuple[str, ...]] = {
    "prompt_ids": ("prompt_ids", "prompts", "prompt_token_ids"),
    "response_ids": ("response_ids", "responses", "token_ids", "response_token_ids"),
    "rollout_logprobs": ("rollout_logprobs", "rollout_log_probs", "logprobs"),
}
#: a logprob above this is not a logprob (logits or probabilities were dumped instead).
_MAX_LOGPROB = 1e-4


@dataclass(frozen=True)
class Record:
    """A recorded run: the requests, and the rollouts of each backend that served them."""

    requests: tuple[Request, ...]
    rollouts: dict[str, tuple[Rollout, ...]] = field(default_factory=dict)
    model: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def write_record(path: str | Path, requests: Sequence[Request], rollouts: Sequence[Rollout] = (), *,
                 model: str | None = None, meta: dict[str, Any] | None = None) -> Path:
    """Write a record file; `rollouts` may mix backends (each rollout names its own)."""
    path = Path(path)
    _unique_ids(requests)
    lines = [{"kind": "header", "format": RECORD_FORMAT, "version": RECORD_VERSION, "model": model,
              "meta": meta or {}}]
    lines += [{"kind": "request", **r.to_dict()} for r in requests]
    lines += [{"kind": "rollout", **r.to_dict()} for r in rollouts]
    path.write_text("".join(json.dumps(line, allow_nan=False) + "\n" for line in lines))
    return path


def read_record(path: str | Path) -> Record:
    """Parse a record file; errors name the file and line."""
    requests: list[Request] = []
    rollouts: dict[str, list[Rollout]] = {}
    seen: set[tuple[str, str, int]] = set()
    header: dict[str, Any] | None = None
    for where, obj in _jsonl(Path(path)):
        kind = obj.pop("kind", None)
        try:
            if kind == "header":
                if obj.get("format") != RECORD_FORMAT or obj.get("version") != RECORD_VERSION:
                    raise InputError(f"not a {RECORD_FORMAT} v{RECORD_VERSION} header: format="
                                     f"{obj.get('format')!r} version={obj.get('version')!r}")
                header = obj
            elif header is None:
                raise InputError(f"the first line must be the header ({{'kind': 'header', 'format': "
                                 f"{RECORD_FORMAT!r}, ...}})")
            elif kind == "request":
                request = Request.from_dict(obj)
                if any(r.request_id == request.request_id for r in requests):
                    raise InputError(f"request_id {request.request_id!r} appears more than once; replay "
                                     "sends each request once and matches rollouts by id")
                requests.append(request)
            elif kind == "rollout":
                _check_logprobs(obj.get("logprobs", []))
                rollout = Rollout.from_dict(obj)
                if (rollout.backend, *rollout.key) in seen:
                    raise InputError(f"rollout {rollout.key} of backend {rollout.backend!r} appears more "
                                     "than once")
                seen.add((rollout.backend, *rollout.key))
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
    return backend.generate(list(record.requests))


def _unique_ids(requests: Sequence[Request]) -> None:
    ids = [r.request_id for r in requests]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise InputError(f"request_id {repeated[0]!r} is used by more than one request; give every request "
                         "its own id")


def replay_main(argv: Sequence[str] | None = None) -> int:
    """`parity replay RECORD --backend NAME [--model M] [--dtype D] [--option K=V ...] [--out PATH]`.

    Writes a record with the original requests and rollouts plus the new backend's rollouts
    (default: RECORD with `.NAME` before the suffix; checked before any backend starts) and
    prints its path. Returns 0, or 2 on
    any error (one line on stderr; the traceback with --verbose), 130 on Ctrl-C.
    """
    parser = argparse.ArgumentParser(prog="parity replay", description=replay_main.__doc__)
    parser.add_argument("record", type=Path, help="record file (JSONL) written by parity")
    parser.add_argument("--backend", required=True, help="backend to replay through")
    parser.add_argument("--model", help="model (built-in name or HF directory); default: the record's")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="backend option; VALUE is parsed as JSON when it can be")
    parser.add_argument("--out", type=Path, help="output record path")
    parser.add_argument("--verbose", action="store_true", help="print the traceback of an unexpected error")
    args = parser.parse_args(argv)
    try:
        record = read_record(args.record)
        model = args.model or record.model
        if model is None:
            raise ConfigError("the record names no model; pass --model")
        out = args.out or args.record.with_suffix(f".{args.backend}{args.record.suffix}")
        output_file(out, "--out")
        options = dict(map(parse_option, args.option))
        with get_backend(args.backend, model, dtype=args.dtype, **options) as backend:
            new = replay(record, backend)
        previous = [r for name, rs in record.rollouts.items() if name != args.backend for r in rs]
        write_record(out, record.requests, previous + new, model=str(model), meta=record.meta)
    except KeyboardInterrupt:
        sys.stderr.write("parity replay: interrupted\n")
        return EXIT_INTERRUPTED
    except Exception as exc:  # one line, exit 2 (see parity.errors.report_error)
        return report_error("parity replay", exc, verbose=args.verbose)
    sys.stdout.write(f"{out}\n")
    return 0


def dump_rollouts(path: str | Path, rollouts: Sequence[Rollout]) -> Path:
    """Write rollouts in the ingestion format (JSONL, or Parquet for a .parquet path)."""
    path = Path(path)
    rows = [{
        "request_id": r.request_id, "sample_index": r.sample_index, "prompt_ids": list(r.prompt_ids),
        "response_ids": list(r.token_ids), "rollout_logprobs": list(r.logprobs),
        "finish_reason": r.finish_reason, "logprobs_mode": r.logprobs_mode,
        **({} if r.routed_experts is None else {"routed_experts": r.routed_experts.tolist()}),
    } for r in rollouts]
    if path.suffix == ".parquet":
        pq, pa = _pyarrow()
        pq.write_table(pa.Table.from_pylist(rows), str(path))
    else:
        path.write_text("".join(json.dumps(row, allow_nan=False) + "\n" for row in rows))
    return path


def load_rollouts(path: str | Path, *, backend: str = "external",
                  logprobs_mode: str = "processed") -> list[Rollout]:
    """Rollouts from a JSONL or Parquet dump (format by suffix); errors name the line or row.

    backend: name stamped on the rollouts (e.g. "trtllm-cluster").
    logprobs_mode: the mode of rows without a `logprobs_mode` column. Say which one the
        producer reported: comparing rollouts in different modes is an error, not drift.
    """
    if logprobs_mode not in LOGPROBS_MODES:
        raise ConfigError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
    path = Path(path)
    if path.suffix == ".parquet":
        pq, _ = _pyarrow()
        try:
            table = pq.read_table(str(path))
        except Exception as e:
            raise InputError(f"{path}: not a readable Parquet file ({e})") from e
        rows: Iterator[tuple[str, dict[str, Any]]] = (
            (f"{path} row {i + 1}", row) for i, row in enumerate(table.to_pylist()))
    else:
        rows = _jsonl(path)
    out: list[Rollout] = []
    prompts: dict[str, tuple[int, ...]] = {}
    for index, (where, row) in enumerate(rows):
        try:
            rollout = _row_to_rollout(row, index, backend, logprobs_mode)
            if prompts.setdefault(rollout.request_id, rollout.prompt_ids) != rollout.prompt_ids:
                raise InputError(f"request_id {rollout.request_id!r} came with another prompt on an earlier "
                                 "row; the samples of one request share its prompt, so give each prompt its "
                                 "own request_id")
        except ParityError as e:
            raise type(e)(f"{where}: {e}") from e
        out.append(rollout)
    if not out:
        raise InputError(f"{path}: no rollouts (the file holds no rows); point at a dump with one rollout "
                         "per row")
    keys = [r.key for r in out]
    if len(set(keys)) != len(keys):
        raise InputError(f"{path}: (request_id, sample_index) repeats; give each rollout a unique pair")
    return out


def _row_to_rollout(row: dict[str, Any], index: int, backend: str, logprobs_mode: str) -> Rollout:
    prompt = _column(row, "prompt_ids")
    response = _column(row, "response_ids")
    logprobs = _column(row, "rollout_logprobs")
    mask = row.get("response_mask")
    if mask is not None:
        keep = _padding_mask(_list(mask, "response_mask"), len(response))
        response, logprobs = response[:keep], logprobs[:keep]
    if len(response) != len(logprobs):
        raise InputError(f"{len(response)} response ids but {len(logprobs)} rollout logprobs; "
                         "give one logprob per response token")
    _check_ids(prompt, "prompt_ids")
    _check_ids(response, "response_ids")
    _check_logprobs(logprobs)
    return Rollout(
        request_id=row.get("request_id", str(index)), sample_index=row.get("sample_index", 0),
        prompt_ids=tuple(prompt), token_ids=tuple(response), logprobs=tuple(logprobs),
        finish_reason=str(row.get("finish_reason", "unknown")), backend=backend,
        logprobs_mode=row.get("logprobs_mode", logprobs_mode), routed_experts=row.get("routed_experts"),
        meta={"source": "offline ingestion"})


def _padding_mask(mask: list[Any], length: int) -> int:
    """How many response tokens a right-padding `response_mask` keeps (its leading 1s).

    Values must be 0 or 1, one per response token, all 1s before all 0s. A 0 before a 1 is
    not padding: it is a token the policy did not generate (a tool or user turn of a multi-turn
    trajectory), and dropping or scoring it as a response token would both be wrong, so it is
    refused rather than guessed at.
    """
    if len(mask) != length:
        raise InputError(f"response_mask has {len(mask)} entries for {length} response tokens; give one "
                         "entry per response token")
    for m in mask:
        if isinstance(m, (str, bytes)) or not isinstance(m, (numbers.Real, np.bool_)) or m not in (0, 1):
            raise InputError(f"response_mask values must be 0 or 1, got {m!r}")
    keep = next((i for i, m in enumerate(mask) if m == 0), len(mask))
    if any(m == 1 for m in mask[keep:]):
        raise InputError(f"response_mask has a zero before a one (token {keep}): that is a multi-turn mask "
                         "with tokens the policy did not generate (tool or user turns), not right padding; "
                         "parity reads right-padded single-turn responses only, so split the trajectory "
                         "into one row per policy turn")
    return keep


def _column(row: dict[str, Any], name: str) -> list[Any]:
    for alias in COLUMN_ALIASES[name]:
        if row.get(alias) is not None:
            return _list(row[alias], alias)
    raise InputError(f"missing field {name!r} (accepted spellings: {', '.join(COLUMN_ALIASES[name])})")


def _list(value: Any, name: str) -> list[Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise InputError(f"{name} must be a list, got {value!r:.80}")
    return list(value)


def _check_ids(ids: list[Any], name: str) -> None:
    if not ids:
        raise InputError(f"{name} is empty")
    if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise InputError(f"{name} must be non-negative integers")


def _check_logprobs(values: Sequence[Any]) -> None:
    for t, v in enumerate(_list(values, "logprobs")):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise InputError(f"logprob {t} is {v!r}; every logprob must be a finite number")
        if v > _MAX_LOGPROB:
            raise InputError(f"logprob {t} is {v} > 0; a log-probability is <= 0 (were logits or "
                             "probabilities dumped instead?)")


def _jsonl(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(location, object) per non-blank line; malformed JSON raises InputError with the line."""
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(obj, dict):
                raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            yield where, obj


def _pyarrow() -> tuple[Any, Any]:
    try:
        # pyarrow only for Parquet: an optional dependency that JSONL records never need
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ConfigError("Parquet needs pyarrow: pip install pyarrow (or use a .jsonl file)") from e
    return pq, pa
