"""Rollout dumps: rollouts produced elsewhere (verl batches, a TRT-LLM or SGLang cluster parity
cannot reach, any engine), read from JSONL or Parquet with one rollout per row.

Columns, their aliases (`COLUMN_ALIASES`) and the padding and sampling rules are in
docs/DESIGN.md, "Case files and rollout dumps". Logprobs at injected tokens are read as 0.0; a
processed-mode row must carry its sampling parameters or be given them.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parity.core.errors import ConfigError, InputError, ParityError
from parity.core.logprobs import check_logprob_values
from parity.core.schema import LOGPROBS_MODES, json_float
from parity.core.strict import check_dtype
from parity.core.tables import read_rows, write_rows
from parity.core.types import Rollout, SamplingParams, check_int
from parity.rollouts.row_sampling import check_given_sampling, row_sampling

#: ingestion column -> accepted spellings, parity's first.
COLUMN_ALIASES: dict[str, tuple[str, ...]] = {
    "prompt_ids": ("prompt_ids", "prompts", "prompt_token_ids"),
    "response_ids": ("response_ids", "responses", "token_ids", "response_token_ids"),
    "rollout_logprobs": ("rollout_logprobs", "rollout_log_probs", "logprobs"),
    "trainer_logprobs": ("trainer_logprobs", "old_log_probs", "old_logprobs"),
    "request_id": ("request_id", "uid"),
    "top_k_ids": ("top_k_ids", "topk_ids", "rollout_top_k_ids"),
    "top_k_logprobs": ("top_k_logprobs", "topk_logprobs", "rollout_top_k_logprobs"),
}
#: the columns holding token ids and floats (logprobs in all their spellings, sampling): a Parquet dump
#: must store them wide enough to hold every id and float32 precision (`parity.core.tables.read_rows`).
ID_COLUMNS: tuple[str, ...] = (*COLUMN_ALIASES["prompt_ids"], *COLUMN_ALIASES["response_ids"],
                               *COLUMN_ALIASES["top_k_ids"])
FLOAT_COLUMNS: tuple[str, ...] = (*COLUMN_ALIASES["rollout_logprobs"], *COLUMN_ALIASES["trainer_logprobs"],
                                  *COLUMN_ALIASES["top_k_logprobs"], "temperature", "top_p",
                                  "sampling.temperature", "sampling.top_p")

#: sampling given to `read_dump`: one for every row, or one per request id.
GivenSampling = SamplingParams | Mapping[str, SamplingParams] | None


@dataclass(frozen=True)
class Dump:
    """The rollouts of a dump and, when it has the column (`trainer_column`), the trainer's logprobs of
    their tokens (verl's `old_log_probs`, one per token; else None).
    """

    path: Path
    rollouts: tuple[Rollout, ...]
    trainer_logprobs: tuple[tuple[float, ...], ...] | None = None
    trainer_column: str | None = None


def read_dump(path: str | Path, *, backend: str = "external", logprobs_mode: str = "processed",
              sampling: GivenSampling = None) -> Dump:
    """Read a JSONL or Parquet rollout dump; errors name the line or row. logprobs_mode: of rows without
    the column (different modes are an error, not drift); sampling: for rows without sampling columns.
    """
    if logprobs_mode not in LOGPROBS_MODES:
        raise ConfigError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
    check_given_sampling(sampling)
    path = Path(path)
    rollouts: list[Rollout] = []
    trainer: list[tuple[float, ...] | None] = []
    columns: set[str] = set()
    samples: dict[str, int] = {}
    prompts: dict[str, tuple[int, ...]] = {}
    sources: dict[str, tuple[bool, str]] = {}  # request id -> (named by a request_id column?, first row)
    rows = read_rows(path, id_columns=ID_COLUMNS, float_columns=FLOAT_COLUMNS)
    for index, (where, row) in enumerate(rows):
        try:
            rollout, theirs, column = _row(row, index, samples, backend, logprobs_mode, sampling)
            _one_id_source(rollout.request_id, _aliased(row, "request_id")[0] is not None, where, sources)
            if prompts.setdefault(rollout.request_id, rollout.prompt_ids) != rollout.prompt_ids:
                raise InputError(f"request_id {rollout.request_id!r} came with another prompt on an earlier "
                                 "row; the samples of one request share its prompt, so give each prompt its "
                                 "own request_id")
        except ParityError as e:
            raise type(e)(f"{where}: {e}") from e
        rollouts.append(rollout)
        trainer.append(theirs)
        columns.update([column] if column else [])
    if not rollouts:
        raise InputError(f"{path}: no rollouts (the dump holds no rows); point at a dump with one rollout "
                         "per row")
    _warn_unmatched(path, sampling, rollouts)
    keys = [r.key for r in rollouts]
    if len(set(keys)) != len(keys):
        raise InputError(f"{path}: (request_id, sample_index) repeats; give each rollout a unique pair")
    if not columns:
        return Dump(path, tuple(rollouts))
    missing = [i for i, t in enumerate(trainer) if t is None]
    if missing or len(columns) > 1:
        raise InputError(f"{path}: trainer logprobs must be in one column on every row; rows "
                         f"{[i + 1 for i in missing[:5]]} have none, columns used: {sorted(columns)}")
    return Dump(path, tuple(rollouts), tuple(t for t in trainer if t is not None), columns.pop())


def _one_id_source(request_id: str, named: bool, where: str, sources: dict[str, tuple[bool, str]]) -> None:
    """InputError when a row without a request_id, whose row index is its id, has the id another row
    names in its request_id column ("3" on row 0, and row 3 without one): else the two became one
    request of two samples."""
    first_named, first = sources.setdefault(request_id, (named, where))
    if first_named != named:
        if named:
            what = f"request_id {request_id!r} is also the id of {first}, a row without one (its row index)"
        else:
            what = f"this row has no request_id, so its row index {request_id!r} is its id; {first} names it"
        raise InputError(f"{what}: the two would be one request of two samples; give every row a request_id "
                         "(or none)")


def _warn_unmatched(path: Path, given: GivenSampling, rollouts: Sequence[Rollout]) -> None:
    """Warn when sampling given by request id matches no row: then it was used nowhere, and rows with their
    own sampling went unchecked against it (valid input, so a warning, not a refusal)."""
    if not isinstance(given, Mapping) or not given or any(r.request_id in given for r in rollouts):
        return
    ids = ", ".join(map(repr, list(given)[:5])) + (", ..." if len(given) > 5 else "")
    seen = sorted({r.request_id for r in rollouts})
    rows = ", ".join(map(repr, seen[:5])) + (", ..." if len(seen) > 5 else "")
    warnings.warn(f"{path}: sampling was given by request id ({ids}) but no row has any of those ids (the "
                  f"rows' ids: {rows}); it was not used, and the rows are scored at their own sampling "
                  "unchecked: give the dump a request_id column naming those ids, or drop the given sampling",
                  stacklevel=3)


def load_rollouts(path: str | Path, *, backend: str = "external", logprobs_mode: str = "processed",
                  sampling: GivenSampling = None) -> list[Rollout]:
    """The rollouts of a dump (`read_dump` without the trainer logprobs)."""
    return list(read_dump(path, backend=backend, logprobs_mode=logprobs_mode, sampling=sampling).rollouts)


def dump_rollouts(path: str | Path, rollouts: Sequence[Rollout],
                  trainer_logprobs: Sequence[Sequence[float]] | None = None) -> Path:
    """Write rollouts in the dump format (JSONL, or Parquet for a .parquet path), their sampling and
    the dtype their meta records included; `trainer_logprobs` (one sequence per rollout) adds the
    trainer-logprob column."""
    if trainer_logprobs is not None and len(trainer_logprobs) != len(rollouts):
        raise InputError(f"{len(trainer_logprobs)} trainer logprob lists for {len(rollouts)} rollouts")
    rows = []
    for i, r in enumerate(rollouts):
        row: dict[str, Any] = {
            "request_id": r.request_id, "sample_index": r.sample_index, "prompt_ids": list(r.prompt_ids),
            "response_ids": list(r.token_ids), "rollout_logprobs": list(r.logprobs),
            "finish_reason": r.finish_reason, "logprobs_mode": r.logprobs_mode,
        }
        if r.sampling is not None:
            row["sampling"] = r.sampling.to_dict()
        if r.routed_experts is not None:
            row["routed_experts"] = r.routed_experts.tolist()
        if r.response_mask is not None:
            row["response_mask"] = list(r.response_mask)
            if not r.response_mask[-1]:  # else the injected tokens that end it would read as padding
                row["attention_mask"] = [1] * (len(r.prompt_ids) + len(r.token_ids))
        if r.meta.get("dtype") is not None:  # the limits depend on it
            row["rollout_dtype"] = r.meta["dtype"]
        if r.top_k_ids is not None:
            row["top_k_ids"] = r.top_k_ids.tolist()
            row["top_k_logprobs"] = r.top_k_logprobs.tolist()
        if trainer_logprobs is not None:
            row["trainer_logprobs"] = logprob_floats(trainer_logprobs[i], "trainer logprob",
                                                     f"rollout {r.request_id!r}/{r.sample_index}: ")
        rows.append(row)
    return write_rows(path, rows)


def _row(row: dict[str, Any], index: int, samples: dict[str, int], backend: str, default_mode: str,
         given: GivenSampling) -> tuple[Rollout, tuple[float, ...] | None, str | None]:
    """One row -> (rollout, trainer logprobs or None, the trainer column's name or None)."""
    prompt = _column(row, "prompt_ids")
    response = _column(row, "response_ids")
    logprobs = [json_float(_sampled_logprob(v, response[i] if i < len(response) else None))
                for i, v in enumerate(_column(row, "rollout_logprobs"))]
    trainer_column, trainer_values = _aliased(row, "trainer_logprobs")
    trainer = None if trainer_column is None else [json_float(v) for v in _as_list(trainer_values,
                                                                                   trainer_column)]
    padded = len(response)
    prompt, keep, generated = _strip_padding(row, prompt, padded)
    _check_length(len(logprobs), padded, keep, "rollout logprobs", "logprob")
    response, logprobs = response[:keep], logprobs[:keep]
    _check_ids(prompt, "prompt_ids")
    _check_ids(response, "response_ids")
    logprobs = _generated_only(logprobs, generated)
    check_logprobs(logprobs)
    if trainer is not None:
        _check_length(len(trainer), padded, keep, str(trainer_column), "trainer logprob")
        trainer = _generated_only(trainer[:keep], generated)
        check_logprobs(trainer, trainer_column)
    id_column, request_id = _aliased(row, "request_id")
    if id_column is not None and (isinstance(request_id, (bool, np.bool_))
                                  or not isinstance(request_id, (str, numbers.Integral))):
        raise InputError(f"{id_column} {request_id!r:.40} is no request id (a string or an integer; a float "
                         "1.0 would name request '1.0', not '1'): write the column as strings or integers")
    request_id = str(index if id_column is None else request_id)
    if row.get("sample_index") is not None:
        sample_index = check_int(row["sample_index"], "sample_index", low=0, error=InputError)
    else:
        sample_index = samples.get(request_id, 0)  # verl's `uid` names a group: number its samples
    samples[request_id] = sample_index + 1
    mode = _mode(row, default_mode)
    routes = row.get("routed_experts")
    meta: dict[str, Any] = {"source": "offline ingestion"}
    if row.get("rollout_dtype") is not None:
        try:
            meta["dtype"] = check_dtype(row["rollout_dtype"], "rollout_dtype")
        except ConfigError as exc:
            raise InputError(str(exc)) from exc
    unmatched = None
    if isinstance(given, Mapping) and request_id not in given:
        ids = ", ".join(map(repr, list(given)[:5])) + (", ..." if len(given) > 5 else "")
        origin = f"its {id_column!r} column" if id_column else "row order (the dump has no request_id column)"
        unmatched = (f"it was given by request id ({ids}; --case gives its requests' ids) but this row's id "
                     f"{request_id!r} (from {origin}) is none of them: give the dump a request_id column "
                     "naming those ids, or ")
    mine = given.get(request_id) if isinstance(given, Mapping) else given
    sampling = row_sampling(row, mode, mine, unmatched)
    if row.get("attention_mask") is None and row.get("response_mask") is None:
        greedy = sampling is not None and sampling.temperature == 0
        _refuse_unmasked_padding(response, logprobs, greedy)
    rollout = Rollout(
        request_id=request_id, sample_index=sample_index,
        prompt_ids=tuple(prompt), token_ids=tuple(response), logprobs=tuple(logprobs),
        finish_reason=str(row.get("finish_reason") or "unknown"), backend=backend, logprobs_mode=mode,
        routed_experts=None if routes is None else _routes(routes),
        meta=meta, sampling=sampling, response_mask=generated, **_top_k_columns(row, padded, keep))
    return rollout, None if trainer is None else tuple(float(x) for x in trainer), trainer_column


def _routes(value: Any) -> Any:
    """The routed_experts column as an int64 array; InputError for entries that are no integers (a
    cast would make expert 1.7 expert 1) or past int32 (Rollout keeps int32: 2**32 + 1 would become
    expert 1). Ragged lists are left to `Rollout`, which names them."""
    try:
        routes = np.asarray(value)
    except ValueError:
        return value
    if routes.size and (routes.dtype.kind not in "iu"
                        or not -2 ** 31 <= routes.min() <= routes.max() < 2 ** 31):
        bad = next((v for v in routes.ravel().tolist()
                    if isinstance(v, bool) or not isinstance(v, int) or not -2 ** 31 <= v < 2 ** 31),
                   routes.dtype)
        raise InputError(f"routed_experts holds {bad!r}; every entry must be an integer expert id (int32)")
    return routes.astype(np.int64, copy=False)


def _check_length(count: int, padded: int, keep: int, name: str, what: str) -> None:
    """InputError unless `count` values cover the response: one per response id, padding included
    (`padded`) or not (`keep`). Values are never cut to fit: one extra means they are shifted (a
    logprob of the last prompt token first, say), and every figure would be off by a token.
    """
    if count not in (padded, keep):
        real = "" if keep == padded else f" ({keep} without the padding)"
        raise InputError(f"{padded} response ids{real} but {count} {name}; give one {what} per response "
                         "token, aligned with response_ids")


def _mode(row: dict[str, Any], default_mode: str) -> str:
    """The row's logprobs mode: its `logprobs_mode` column, else its sampling object's, else
    `default_mode`; the column and the object must agree."""
    mode = row.get("logprobs_mode") or None
    sampling = row.get("sampling")
    said = sampling.get("logprobs_mode") if isinstance(sampling, Mapping) else None
    if mode is not None and said is not None and said != mode:
        raise InputError(f"the row's logprobs_mode column says {mode!r} but its sampling object says "
                         f"logprobs_mode {said!r}; the row contradicts itself: drop one of them")
    mode = mode or said or default_mode
    if mode not in LOGPROBS_MODES:
        raise InputError(f"logprobs_mode {mode!r}; allowed: {list(LOGPROBS_MODES)}")
    return mode


def _sampled_logprob(entry: Any, token: Any) -> Any:
    """A rollout-logprob entry as a number (a per-position dict read at the sampled `token`)."""
    if not isinstance(entry, Mapping):
        return entry
    value = entry.get(str(token), entry.get(token))
    if value is None:
        raise InputError(f"a rollout logprobs entry {dict(entry)!r:.80} has no logprob of the sampled token "
                         f"{token}; give one number per response token, or a dict that holds the sampled one")
    return value.get("logprob") if isinstance(value, Mapping) else value


def _top_k_columns(row: dict[str, Any], padded: int, keep: int) -> dict[str, Any]:
    found = {name: _aliased(row, name)[1] for name in ("top_k_ids", "top_k_logprobs")}
    if all(v is None for v in found.values()):
        return {}
    if any(v is None for v in found.values()):
        raise InputError("top_k_ids and top_k_logprobs come together: the row has only one of them")
    try:
        rows = {"top_k_ids": [list(r) for r in _as_list(found["top_k_ids"], "top_k_ids")],
                "top_k_logprobs": [[json_float(v) for v in r]
                                   for r in _as_list(found["top_k_logprobs"], "top_k_logprobs")]}
    except (TypeError, ValueError) as exc:
        raise InputError(f"top_k_ids/top_k_logprobs must hold one list of k entries per response position "
                         f"({exc})") from exc
    for name, listed in rows.items():
        _check_length(len(listed), padded, keep, f"{name} rows", "row")
        _check_numbers(listed[:keep], name)
    try:
        ids = np.asarray(rows["top_k_ids"][:keep])
        values = np.asarray(rows["top_k_logprobs"][:keep], dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InputError(f"top_k_ids/top_k_logprobs must hold one list of k entries per response position "
                         f"({exc})") from exc
    return {"top_k_ids": ids, "top_k_logprobs": values}


def _check_numbers(rows: list[list[Any]], name: str) -> None:
    """InputError at the first entry of `rows` that is no number (an integer for top_k_ids): a cast
    would parse "-0.5" and take True for 1."""
    kind = numbers.Integral if name == "top_k_ids" else numbers.Real
    for t, row in enumerate(rows):
        for j, v in enumerate(row):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, kind):
                what = "integer token ids" if kind is numbers.Integral else "numbers (logprobs in nats)"
                raise InputError(f"{name}[{t}][{j}] is {v!r}; every entry must be one of {what}")


def _strip_padding(row: dict[str, Any], prompt: list[Any],
                   response_len: int) -> tuple[list[Any], int, tuple[int, ...] | None]:
    """(prompt without left padding, real response tokens, the response mask when it has interior
    zeros, else None).
    """
    keep = response_len
    attention = row.get("attention_mask")
    if attention is not None:
        attention = _mask_values(attention, "attention_mask")
        if len(attention) != len(prompt) + response_len:
            raise InputError(f"attention_mask has {len(attention)} entries for {len(prompt)} prompt + "
                             f"{response_len} response tokens; it must cover both")
        head, tail = attention[:len(prompt)], attention[len(prompt):]
        pad = len(head) - sum(head)
        if head != [0] * pad + [1] * (len(head) - pad):
            raise InputError("attention_mask over the prompt must be 0s then 1s (left padding)")
        prompt = prompt[pad:]
        keep = _right_padded(tail, "attention_mask over the response")
    mask = row.get("response_mask")
    if mask is not None:
        mask = _mask_values(mask, "response_mask")
        if len(mask) != response_len:
            raise InputError(f"response_mask has {len(mask)} entries for {response_len} response tokens; "
                             "give one entry per response token")
        if not any(mask[:keep]):
            raise InputError("response_mask has no 1 over the response: no generated token to score; the "
                             "mask marks generated tokens 1 (and tool or padding tokens 0)")
        if attention is None:  # no other word on padding: trailing zeros are padding
            keep = max((i + 1 for i, m in enumerate(mask) if m), default=0)
        elif any(mask[keep:]):
            at = keep + mask[keep:].index(1)
            raise InputError(f"response_mask marks response token {at} generated (1) but attention_mask says "
                             f"it is padding (the response has {keep} real tokens); the masks disagree: fix "
                             "the one that is wrong (verl's response_mask is 0 wherever attention_mask is)")
        mask = mask[:keep]
        if 0 in mask:
            return prompt, keep, tuple(mask)
    return prompt, keep, None


def _refuse_unmasked_padding(response: list[Any], logprobs: list[Any], greedy: bool) -> None:
    """InputError when a maskless row ends like right padding: two or more copies of its last id with
    one logprob bit for bit (verl pads with -1, others 0); greedy rows (all 0.0) are let through.
    """
    tail = 1
    while tail < len(response) and response[-1 - tail] == response[-1] \
            and logprobs[-1 - tail] == logprobs[-1]:
        tail += 1
    if tail >= 2 and tail < len(response) and not greedy:
        raise InputError(f"the response ends with {tail} tokens of id {response[-1]} whose logprobs are all "
                         f"{logprobs[-1]}: this looks like right padding, which would be scored as tokens; "
                         "give response_mask (verl's) or attention_mask, or trim the padding")


def _generated_only(values: list[Any], mask: tuple[int, ...] | None) -> list[Any]:
    """`values` with 0.0 at injected tokens (a dump may hold anything there, NaN included)."""
    return values if mask is None else [v if m else 0.0 for v, m in zip(values, mask)]


def _mask_values(mask: Any, name: str) -> list[int]:
    """A mask column as 0/1 ints; anything else (2, 0.5, "1") is refused, not rounded."""
    if isinstance(mask, (str, bytes)) or not isinstance(mask, (Sequence, np.ndarray)):
        raise InputError(f"{name} must be a list of 0s and 1s, got {mask!r:.80}")
    for m in mask:
        if isinstance(m, (str, bytes)) or not isinstance(m, (numbers.Real, np.bool_)) or m not in (0, 1):
            raise InputError(f"{name} values must be 0 or 1, got {m!r}")
    return [int(m) for m in mask]


def _right_padded(mask: list[int], name: str) -> int:
    """The leading 1s of a 1s-then-0s attention mask over a response (a 1 after a 0 is an error)."""
    keep = mask.index(0) if 0 in mask else len(mask)
    if any(mask[keep:]):
        raise InputError(f"{name} has a zero before a one (token {keep}): it must be 1s then 0s (right "
                         "padding); mark tool or user tokens of a trajectory with 0s in response_mask")
    return keep


def _column(row: dict[str, Any], name: str) -> list[Any]:
    alias, value = _aliased(row, name)
    if alias is None:
        raise InputError(f"missing field {name!r} (accepted spellings: {', '.join(COLUMN_ALIASES[name])})")
    return _as_list(value, alias)


def _aliased(row: dict[str, Any], name: str) -> tuple[str | None, Any]:
    """(the spelling used, its value) of ingestion column `name`, or (None, None) when absent; two
    spellings with different values are an InputError (which one is meant cannot be told)."""
    present = [a for a in COLUMN_ALIASES[name] if row.get(a) is not None]
    if not present:
        return None, None
    first = present[0]
    for other in present[1:]:
        if not _same(row[first], row[other]):
            raise InputError(f"the row spells {name!r} twice with different values: {first!r} and {other!r} "
                             f"(accepted spellings: {', '.join(COLUMN_ALIASES[name])}); which one is meant "
                             "cannot be told: drop or rename one of them")
    return first, row[first]


def _same(a: Any, b: Any) -> bool:
    """Whether two column values are equal (lists, NumPy arrays or scalars)."""
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # arrays compare elementwise
        try:
            return bool(np.array_equal(np.asarray(a), np.asarray(b)))
        except (TypeError, ValueError):
            return False


def _as_list(value: Any, name: str) -> list[Any]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (Sequence, np.ndarray)):
        raise InputError(f"{name} must be a list, got {value!r:.80}")
    return list(value)


def _check_ids(ids: list[Any], name: str) -> None:
    if not ids:
        raise InputError(f"{name} is empty")
    if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise InputError(f"{name} must be non-negative integers")


def check_logprobs(values: Sequence[Any], name: str = "logprob", where: str = "") -> None:
    """Every value <= 0 (a little rounding allowed) or -inf (outside the support, counted apart), else
    InputError prefixed with `where`.
    """
    check_logprob_values(values, name, where)


def logprob_floats(values: Any, name: str = "logprob", where: str = "") -> list[float]:
    """`values` (a list, a NumPy array or a tensor) as checked floats (`check_logprobs`): checked
    before any conversion, since float() would parse "-0.5" and take False for 0.0."""
    if isinstance(values, (str, bytes, Mapping)):
        raise InputError(f"{where}{name}s must be a list of numbers, got {values!r:.80}")
    try:
        listed = values.tolist() if hasattr(values, "tolist") else list(values)
    except TypeError as exc:
        raise InputError(f"{where}{name}s must be a list of numbers, got {values!r:.80}") from exc
    if not isinstance(listed, list):  # a NumPy or torch scalar
        raise InputError(f"{where}{name}s must be a list of numbers, got {values!r:.80}")
    listed = [v.item() if isinstance(v, np.generic) else v for v in listed]  # NumPy scalars as Python's
    check_logprobs(listed, name, where)
    return [float(v) for v in listed]
