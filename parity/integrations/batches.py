"""A training step's batch as parity reads it, whichever framework made it: the monitor's arrays
and the rows of a rollout dump.

A `StepBatch` is verl's layout (`[batch, response_len]`, left-aligned, right-padded); `log_step`
hands it to `Monitor.log`, `dump_step` writes a rollout dump `parity score` reads (JSONL, or
Parquet for `.parquet`; no pickle): per sequence `prompt_ids`, `response_ids`, `rollout_logprobs`,
`trainer_logprobs`, `request_id`, `temperature`, `top_p`, `top_k`, `logprobs_mode`, and
`response_mask` for a multi-turn row. NumPy (pyarrow for Parquet); tensors by duck typing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from parity.core.errors import InputError
from parity.core.logprobs import check_logprob_array
from parity.core.outputs import output_file
from parity.core.schema import LOGPROBS_MODES
from parity.core.strict import check_choice
from parity.core.tables import write_rows
from parity.core.types import scalar_meant, top_k_off
from parity.monitor.arrays import host_array
from parity.monitor.core import checked_sampling
from parity.rollouts.row_sampling import SAMPLING_COLUMNS

if TYPE_CHECKING:
    from parity.monitor import Monitor

log = logging.getLogger("parity.monitor")


@dataclass(frozen=True)
class StepBatch:
    """One step's batch in verl's layout: rollout, trainer `[batch, response_len]` nats; mask bool
    (generated tokens that count); lengths `[batch]` up to the last real token; responses, prompts,
    request_ids (verl's `uid`) and sampling, each None when unknown; notes: what the reader saw of
    the batch that its arrays no longer show (tokens the trainer's own mask removed), stored in the
    step's meta by `log_step`.
    """

    rollout: np.ndarray
    trainer: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray
    responses: np.ndarray | None = None
    prompts: Sequence[np.ndarray] | None = None
    request_ids: Sequence[str] | None = None
    sampling: Mapping[str, Any] | None = None
    notes: Mapping[str, Any] | None = None


def log_step(monitor: Monitor, step: int, batch: StepBatch, *, meta: Mapping[str, Any] | None = None,
             policy_version: int | None = None, rollout_policy_version: int | None = None) -> dict[str, Any]:
    """`monitor.log` of one step's batch (its request ids as the rows' uids); returns the stored
    record. policy_version, rollout_policy_version: the trainer's and the rollout's weight
    versions, as `Monitor.log` takes them. The batch's notes go into the meta (`meta` wins a name
    both hold)."""
    if batch.notes:
        meta = {**batch.notes, **(meta or {})}
    return monitor.log(step, rollout_log_probs=batch.rollout, old_log_probs=batch.trainer,
                       response_mask=batch.mask, responses=batch.responses, prompts=batch.prompts,
                       uids=batch.request_ids, sampling=batch.sampling, meta=meta,
                       policy_version=policy_version, rollout_policy_version=rollout_policy_version)


def dump_step(batch: StepBatch, path: str | Path, *, logprobs_mode: str = "processed") -> Path:
    """Write the batch as a parity rollout dump (see the module doc); rows with no counted token
    (a trainer's mask took them out whole) are left out, with a warning on the `parity.monitor`
    logger that counts them (the dump has no field for them). Processed logprobs need the
    temperature (`InputError` without it); a path that cannot be written is a `ConfigError`
    before any row is built."""
    check_choice(logprobs_mode, LOGPROBS_MODES, "logprobs_mode")
    path = output_file(path, "dump path")
    if batch.responses is None or batch.prompts is None:
        raise InputError("a dump needs the token ids: the batch has no responses or no prompts")
    sampling = _dump_sampling(batch.sampling, logprobs_mode)
    if logprobs_mode == "processed" and "temperature" not in sampling:
        raise InputError("processed logprobs depend on the temperature, and the batch does not say it; pass "
                         "sampling={'temperature': T} (verl keeps it in meta_info['temperature'])")
    _check_layout(batch)
    rows = []
    left_out = 0
    for r in range(batch.mask.shape[0]):
        n = int(batch.lengths[r])
        mask = batch.mask[r, :n]
        if not mask.any():
            left_out += 1
            continue
        rollout = _checked(batch.rollout[r, :n], mask, "rollout", r)
        trainer = _checked(batch.trainer[r, :n], mask, "trainer", r)
        row: dict[str, Any] = {
            "request_id": str(batch.request_ids[r]) if batch.request_ids is not None else str(r),
            "prompt_ids": [int(t) for t in batch.prompts[r]],
            "response_ids": [int(t) for t in batch.responses[r, :n]],
            "rollout_logprobs": rollout, "trainer_logprobs": trainer,
            "logprobs_mode": logprobs_mode, **sampling,
        }
        if not mask.all():
            row["response_mask"] = [int(m) for m in mask]
        rows.append(row)
    if not rows:
        raise InputError("the batch has no generated token (every mask is 0): nothing to dump")
    if left_out:
        log.warning("parity: the dump %s leaves out %d of %d rows: no token of theirs counts (a mask "
                    "all 0, or no response), so parity score does not measure them%s", path, left_out,
                    batch.mask.shape[0], f" ({dict(batch.notes)})" if batch.notes else "")
    return write_rows(path, rows)


def _dump_sampling(sampling: Mapping[str, Any] | None, logprobs_mode: str) -> dict[str, Any]:
    """The dump's sampling columns of `sampling`, checked as `Monitor.log` checks it (`checked_sampling`:
    InputError for a field parity does not know, min_p: the dump would say a distribution it was not
    sampled from) and for a logprobs_mode other than the dump's. Fields that do not shape the
    distribution (n, seed, max_tokens, ...) are checked and left out."""
    given = checked_sampling(sampling) or {}
    mode = given.get("logprobs_mode")
    if mode is not None and mode != logprobs_mode:
        raise InputError(f"sampling logprobs_mode={mode!r} but the dump is written with logprobs_mode="
                         f"{logprobs_mode!r}; pass logprobs_mode={mode!r} to the dump (or drop one)")
    return {k: v for k, v in given.items() if k in SAMPLING_COLUMNS}


def _check_layout(batch: StepBatch) -> None:
    """InputError unless the batch's arrays share the mask's `[batch, response_len]`, its token ids are
    integers, and every counted token lies inside its row's length: a dump cut at `lengths` must hold
    what the monitor counts."""
    shape = batch.mask.shape
    for name, values in (("rollout logprobs", batch.rollout), ("trainer logprobs", batch.trainer),
                         ("responses", batch.responses)):
        if values is not None and values.shape != shape:
            raise InputError(f"{name} {list(values.shape)} and the response mask {list(shape)} differ in "
                             "shape; each holds one entry per response position")
    for name, rows in (("prompts", batch.prompts), ("request ids", batch.request_ids)):
        if rows is not None and len(rows) != shape[0]:
            raise InputError(f"the batch has {len(rows)} {name} for {shape[0]} rows")
    ids = [("responses", batch.responses)] + [(f"prompts[{r}]", p) for r, p in enumerate(batch.prompts or ())]
    for name, values in ids:  # int() would take 5.7 for token 5, a bfloat16 151643 for 151552
        values = np.asarray(values)
        if values.size and values.dtype.kind not in "iu":
            raise InputError(f"{name} must hold integer token ids, got dtype {values.dtype}; pass the ids "
                             "the rollout sampled (an integer tensor)")
    check_lengths(batch.mask, batch.lengths, "the response mask", "the response lengths")


def check_lengths(mask: np.ndarray, lengths: np.ndarray, mask_name: str, lengths_name: str) -> None:
    """InputError unless `lengths` `[batch]` lie in `[0, width]` of `mask` `[batch, width]` and no
    row's mask is 1 at or past its length (a token counted where the batch says padding)."""
    lengths = np.asarray(lengths)
    batch, width = mask.shape
    if lengths.shape != (batch,):
        raise InputError(f"{lengths_name} has shape {list(lengths.shape)}; give one length per row ({batch})")
    outside = (lengths < 0) | (lengths > width)
    if outside.any():
        r = int(np.argmax(outside))
        raise InputError(f"{lengths_name} says row {r} has {int(lengths[r])} tokens, outside [0, {width}] "
                         "(the padded width)")
    past = mask_lengths(mask) > lengths  # a row's last counted position + 1 past its length
    if past.any():
        r = int(np.argmax(past))
        c = int(mask_lengths(mask[r:r + 1])[0]) - 1
        raise InputError(f"row {r}: {mask_name} is 1 at position {c}, but {lengths_name} ends the row at "
                         f"{int(lengths[r])}: a token counted inside the padding; the two must describe the "
                         "same padding (right-padded rows)")


def _checked(values: np.ndarray, mask: np.ndarray, side: str, row: int) -> list[float]:
    """One row's logprobs as floats, 0.0 at mask 0; InputError for a non-logprob counted value (-inf kept)."""
    v = np.where(mask, values.astype(np.float64), 0.0)
    check_logprob_array(v, None, f"row {row}: {side} logprob")
    bad = np.isnan(v) | (v == np.inf)  # -inf stays: a token outside the sampling support
    if bad.any():
        t = int(np.argmax(bad))
        raise InputError(f"row {row}: {side} logprob {t} is {float(v[t])!r}; every logprob of a counted "
                         "token must be a number <= 0 (-inf: outside the sampling support)")
    return v.tolist()


def get_entry(entries: Any, key: str, where: str, hint: str) -> Any:
    """`entries[key]`, or InputError naming the key and how the framework fills it. Membership is
    asked of `entries.keys()`: tensordict's TensorDict (verl's `batch.batch`) refuses `key in td`."""
    keys = getattr(entries, "keys", None)
    if keys is None:
        raise InputError(f"{where} must be a mapping of the batch's tensors, got {type(entries).__name__}")
    if key not in keys():
        raise InputError(f"{where} has no {key!r} ({hint}); it holds {sorted(map(str, keys()))}")
    return entries[key]


def optional_entry(entries: Any, key: str) -> Any:
    """`entries[key]`, or None when it is missing."""
    return entries[key] if key in entries.keys() else None  # noqa: SIM118 (a TensorDict refuses `in`)


def sampling_of(found: Mapping[str, Any], given: Mapping[str, Any] | None) -> dict[str, Any]:
    """The batch's sampling: what it holds (`found`), then `given` (the caller's); the two must agree.
    NumPy/torch scalars become Python numbers (`_scalar`), and top_k=-1 (off in verl, vLLM, SGLang,
    slime) parity's 0."""
    out = {k: _sampling_value(k, v) for k, v in found.items() if v is not None}
    for key, value in (given or {}).items():
        value = _sampling_value(key, value)
        if key in out and out[key] != value:
            raise InputError(f"sampling {key}={value!r} was given but the batch says {out[key]!r}; drop one")
        out[key] = value
    return out


def _sampling_value(key: str, value: Any) -> Any:
    """One sampling field as parity writes it: a Python number; top_k by a dump row's rule (`top_k_off`:
    -1, the trainers' "off", as 0; a float left for `checked_sampling` to refuse)."""
    value = _scalar(value)
    return top_k_off(value) if key == "top_k" else value


def _scalar(value: Any) -> Any:
    """A NumPy/torch scalar as a Python number (a float32, float16 or bfloat16 as its shortest spelling:
    0.7, not 0.699999988 or 0.69921875; `parity.core.types.scalar_meant`, the monitor's rule too)."""
    return scalar_meant(value)


#: `sequence_batch`'s names of its rollout, trainer, mask, tokens and lengths in its errors.
SEQUENCE_NAMES = ("rollout logprobs", "trainer logprobs", "token_mask", "tokens", "lengths")


def sequence_batch(rollout: np.ndarray, trainer: np.ndarray, token_mask: np.ndarray,
                   tokens: np.ndarray | None, lengths: np.ndarray,
                   sampling: Mapping[str, Any] | None,
                   names: tuple[str, str, str, str, str] = SEQUENCE_NAMES) -> StepBatch:
    """Whole right-padded sequences `[batch, seq]` (logprob of token i at position i) as a `StepBatch`:
    the response starts at the first `token_mask` position and is left-aligned. `names` spell the
    rollout, trainer, mask, tokens and lengths in the framework's words for the errors: `InputError`
    for arrays of other shapes than the mask, or a mask 1 at or past its row's length.
    """
    if token_mask.ndim != 2:
        raise InputError(f"{names[2]} must be [batch, seq], got shape {list(token_mask.shape)}")
    for name, values in ((names[0], rollout), (names[1], trainer), (names[3], tokens)):
        if values is not None and values.shape != token_mask.shape:
            raise InputError(f"{name} {list(values.shape)} and {names[2]} {list(token_mask.shape)} differ in "
                             "shape; each holds one entry per position of the sequences")
    check_lengths(token_mask, lengths, names[2], names[4])
    batch, seq = token_mask.shape
    start = np.where(token_mask.any(axis=1), np.argmax(token_mask, axis=1), lengths)
    width = int((lengths - start).max(initial=0))
    index = np.minimum(start[:, None] + np.arange(width)[None, :], seq - 1)
    inside = np.arange(width)[None, :] < (lengths - start)[:, None]

    def aligned(values: np.ndarray, fill: Any) -> np.ndarray:
        return np.where(inside, np.take_along_axis(values, index, axis=1), fill)

    return StepBatch(
        rollout=aligned(rollout, 0.0).astype(rollout.dtype),
        trainer=aligned(trainer, 0.0).astype(trainer.dtype),
        mask=aligned(token_mask, False), lengths=lengths - start,
        responses=None if tokens is None else aligned(tokens, 0).astype(tokens.dtype),
        prompts=None if tokens is None else [tokens[r, :start[r]] for r in range(batch)],
        sampling=sampling_of({}, sampling))


def padded_rows(rows: Sequence[Any], name: str, fill: float) -> tuple[np.ndarray, np.ndarray]:
    """Ragged 1-D rows (tensors, arrays or lists) as one `[len(rows), longest]` array, left-aligned
    and right-padded with `fill`, in the rows' common dtype; and each row's length `[len(rows)]`."""
    arrays = [host_array(r, f"{name}[{i}]").reshape(-1) for i, r in enumerate(rows)]
    lengths = np.array([a.size for a in arrays], dtype=np.int64)
    dtype = np.result_type(*arrays) if arrays else np.float32
    out = np.full((len(arrays), int(lengths.max(initial=0))), fill, dtype=dtype)
    for i, a in enumerate(arrays):
        out[i, :a.size] = a
    return out, lengths


def bool_mask(value: Any, name: str) -> np.ndarray:
    """A 0/1 (or bool) mask as bool; InputError for any other value (2, 0.5 are not rounded)."""
    mask = host_array(value, name)
    if mask.dtype != np.bool_:
        if not np.isin(mask, (0, 1)).all():
            raise InputError(f"{name} must hold only 0 and 1 (1 = the token counts)")
        mask = mask != 0
    return mask


def right_padded(mask: np.ndarray, *, left: bool = False) -> np.ndarray:
    """Per row of a bool `[batch, width]` mask, whether it is ones then zeros (no 0 followed by a 1),
    or with `left` zeros then ones."""
    first, then = (mask[:, :-1], mask[:, 1:]) if left else (mask[:, 1:], mask[:, :-1])
    return ~(first > then).any(axis=1)


def mask_lengths(mask: np.ndarray) -> np.ndarray:
    """Per row, the position after its last True (0 for a row with none): the response length when
    nothing else says where padding starts."""
    width = mask.shape[1]
    last = width - np.argmax(mask[:, ::-1], axis=1)
    return np.where(mask.any(axis=1), last, 0)
