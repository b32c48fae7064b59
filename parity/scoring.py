"""`parity.scoring.score` and `parity score`: the report `compare` builds, for rollouts produced
elsewhere.

A dump (verl batch, SGLang or TRT-LLM cluster) or a record is scored with the training forward
here and reported as `compare` reports, or judged on the dump's own trainer logprobs
(`trainer_logprobs="dump"`) with no forward; provenance says which side was computed here.
Processed logprobs are scored under each rollout's recorded sampling, else `sampling`, else the
sampling of the case request (`case=`, `--case`) with the rollout's request id and prompt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parity.assess.training_side import check_gold, report_for
from parity.backends.borrowed import resolve_device
from parity.core.errors import ConfigError, InputError
from parity.core.schema import KERNEL_MODES
from parity.core.strict import check_dtype
from parity.core.tables import PARQUET_SUFFIX, read_jsonl
from parity.core.types import Rollout, SamplingParams
from parity.drift.tolerance import Tolerance
from parity.models import check_sampled_with, resolve_model
from parity.models.checkpoints import model_text
from parity.models.lora import check_adapter
from parity.report.document import ParityReport
from parity.report.provenance import TRAIN_COMPUTED, provenance
from parity.rollouts.dumps import GivenSampling, check_logprobs, logprob_floats, read_dump
from parity.rollouts.matching import check_unique_keys
from parity.rollouts.record import RECORD_FORMAT, Record, read_record
from parity.rollouts.row_sampling import check_given_sampling
from parity.workload.cases import Case, resolve_case

#: `trainer_logprobs=FROM_DUMP`: the trainer logprobs the dump holds (its trainer-logprob column).
FROM_DUMP = "dump"
#: the dtype of the training forward when neither the caller nor the rollouts' meta names one.
DEFAULT_DTYPE = "bfloat16"


@dataclass(frozen=True)
class Source:
    """Rollouts read from a file: kind ("record" or "dump"), model (a record's), a dump's trainer
    logprobs and their column, and the case a record's header names (`compare --record` writes it).
    """

    path: Path
    kind: str
    rollouts: tuple[Rollout, ...]
    model: str | None = None
    trainer_logprobs: tuple[tuple[float, ...], ...] | None = None
    trainer_column: str | None = None
    case: str | None = None


def read_source(path: str | os.PathLike[str], *, backend: str | None = None, sampling: GivenSampling = None,
                logprobs_mode: str | None = None) -> Source:
    """A record or a dump (see the module doc), read once. backend: for a record, whose rollouts to take;
    for a dump, the name stamped on its rollouts (default "external"). sampling, logprobs_mode:
    for rollouts that carry none (`parity.rollouts.dumps.read_dump`; logprobs_mode None: the one
    `sampling` names, else "processed"); a record's rollouts carry their own mode, so a given one
    that contradicts it is a ConfigError."""
    path = Path(path)
    if path.suffix != PARQUET_SUFFIX and is_record(path):
        check_given_sampling(sampling)  # matched by request id as a dump's rows (`read_dump` checks those)
        record = read_record(path)
        _check_record_mode(path, record, backend, logprobs_mode)
        if not record.rollouts:
            raise InputError(f"{path}: the record holds requests but no rollouts; replay it through a "
                             "backend first (`parity replay`)")
        if backend is None and len(record.rollouts) > 1:
            raise ConfigError(f"{path}: the record holds rollouts of {sorted(record.rollouts)}; pick one "
                              "with backend= (--backend)")
        name = backend if backend is not None else next(iter(record.rollouts))
        if name not in record.rollouts:
            raise ConfigError(f"{path}: the record holds no rollouts of backend {name!r}; "
                              f"it has {sorted(record.rollouts)}")
        rollouts = _with_sampling(record.rollouts[name], sampling)
        named = record.meta.get("case")
        return Source(path, "record", tuple(rollouts), record.model,
                      case=named if isinstance(named, str) and named else None)
    mode = logprobs_mode or _given_mode(sampling) or "processed"
    dump = read_dump(path, backend=backend or "external", logprobs_mode=mode, sampling=sampling)
    return Source(path, "dump", dump.rollouts, None, dump.trainer_logprobs, dump.trainer_column)


def _check_record_mode(path: Path, record: Record, backend: str | None, mode: str | None) -> None:
    """ConfigError when `mode` was given and the record's rollouts (of `backend`) carry another
    logprobs mode: a record's own mode is the one scored, so the given one would be ignored."""
    own = {r.logprobs_mode for name, rs in record.rollouts.items() if backend in (None, name) for r in rs}
    if mode is not None and own - {mode}:
        raise ConfigError(f"--logprobs-mode {mode} (logprobs_mode=): {path} is a parity record whose "
                          f"rollouts carry their own logprobs mode ({', '.join(sorted(own))}), which is the "
                          "one scored; leave logprobs_mode unset")


def score(rollouts: Sequence[Rollout] | str | os.PathLike[str], model: str | os.PathLike[str] | None = None,
          *, trainer_logprobs: Sequence[Sequence[float]] | str | None = None, backend: str | None = None,
          sampling: GivenSampling = None, logprobs_mode: str | None = None, dtype: str | None = None,
          reference: str = "invariant", tolerance: Tolerance | dict[str, Any] | None = None,
          router_replay: str | None = None, device: str = "auto", correction: dict[str, Any] | None = None,
          attribute: Sequence[str] = (), gold: bool | None = None,
          lora: str | os.PathLike[str] | None = None, rollout_dtype: str | None = None,
          case: Case | str | os.PathLike[str] | None = None) -> ParityReport:
    """Score rollouts produced elsewhere; the report `parity.compare` would build for them.

    rollouts: `Rollout`s or a record or dump path. logprobs_mode: of a dump's rows without one (None:
    the given sampling's or case's, else "processed"); a record's rollouts carry theirs. model: None
    is the record's (not needed with trainer logprobs). trainer_logprobs: None runs the forward; a
    list (paired with the rollouts by position, in the file's row order: only each one's length is
    checked), or "dump" for the dump's column (its own row's). sampling: for rollouts that record
    none; a dict is matched by request id alone. case: instead of sampling, a case (or its file)
    whose request of each rollout's id gives its sampling; that request's prompt must be the
    rollout's (else InputError). dtype: None is the rollouts', else the case's first, else bfloat16;
    rollout_dtype: None is the recorded one (a contradiction is a ConfigError). tolerance: None is the
    case's limits, else the default for the backend and dtype pair. lora: for rollouts that record
    none (a contradiction is a ConfigError). device: "auto" is where the rollouts' backend runs here.
    The rest as `parity.compare` (gold's default counts the forward's time only).
    """
    if reference not in KERNEL_MODES:
        raise ConfigError(f"reference must be one of {KERNEL_MODES}, got {reference!r}")
    if isinstance(rollouts, (str, os.PathLike)):
        if case is not None:
            case, sampling = _case_sampling(case, sampling)
        source = read_source(rollouts, backend=backend, sampling=sampling, logprobs_mode=logprobs_mode)
    else:
        if backend is not None or sampling is not None or logprobs_mode is not None or case is not None:
            raise ConfigError("backend, sampling, logprobs_mode and case apply to a file; Rollout objects "
                              "carry their own")
        source = Source(Path("."), "rollouts", tuple(rollouts))
    if not source.rollouts:
        raise InputError("no rollouts to score")
    check_unique_keys(source.rollouts)
    if isinstance(case, Case):
        _check_case_prompts(source, case)
    if source.kind == "rollouts":  # files are checked as they are read; objects only here
        for ro in source.rollouts:
            check_logprobs(ro.logprobs, "logprob", f"rollout {ro.request_id!r}/{ro.sample_index}: ")
    theirs = _trainer_logprobs(trainer_logprobs, source)
    model_arg = model_text(model) if model is not None else source.model  # a Path stays a path
    check_gold(gold)
    if model_arg is None and (theirs is None or attribute or gold):
        raise ConfigError("the rollouts name no model; pass model= (--model), the checkpoint to score with")
    if model_arg is not None:
        resolve_model(model_arg)
        check_sampled_with(model_arg, hashes=[r.meta.get("model_hash") for r in source.rollouts],
                           name=source.model, where=f"the rollouts of {source.path}"
                           if source.kind != "rollouts" else "the rollouts")
    if lora is not None and model_arg is None:
        raise ConfigError("lora applies to the model the rollouts are scored with; pass model= (--model)")
    adapter = None if lora is None else check_adapter(lora, model_arg).to_dict()
    recorded = next((r.meta["lora"] for r in source.rollouts if r.meta.get("lora")), None)
    rollout_dtype = _rollout_dtype(rollout_dtype, source)
    from_case = case if isinstance(case, Case) else None  # its dtype and limits, as compare takes them
    dtype = check_dtype(dtype or rollout_dtype or (from_case.dtypes[0] if from_case and from_case.dtypes else
                                                   DEFAULT_DTYPE))
    names = sorted({r.backend for r in source.rollouts})
    name = names[0] if len(names) == 1 else "+".join(names)
    if tolerance is None and from_case is not None:
        tolerance = from_case.tolerance_for(name)
    limits = Tolerance.resolve(tolerance, name, dtype, rollout_dtype)
    device = resolve_device(device, names)
    where = "the given rollouts" if source.kind == "rollouts" else f"{source.kind} {source.path}"
    if theirs is None:
        train_side = TRAIN_COMPUTED
    elif isinstance(trainer_logprobs, str):  # FROM_DUMP (checked); an array must not meet `==`
        train_side = (f"from the dump's {source.trainer_column!r} column (not computed here; no forward "
                      "ran, so the rollouts' sampling columns were not checked)")
    else:
        train_side = "given by the caller (not computed here; the rollouts' sampling was not checked)"
    prov = provenance(
        model_arg, backend=name, backend_meta=dict(source.rollouts[0].meta), dtype=dtype, device=device,
        reference=reference, router_replay=router_replay,
        seeds=[r.sampling.seed if r.sampling is not None else None for r in source.rollouts],
        case=_case_name(source, from_case), case_hash=_rollouts_hash(source, theirs),
        rollout_logprobs=f"from {where} (backend {name!r})", train_logprobs=train_side,
        lora=adapter or recorded)
    prov["sampling_checked"] = theirs is None
    prov["rollout_dtype"] = rollout_dtype or dtype
    return report_for(model_arg, source.rollouts, dtype=dtype, device=device, reference=reference,
                      router_replay=router_replay, tolerance=limits, provenance=prov, correction=correction,
                      attribute=attribute, train_logprobs=theirs, gold=gold, lora=lora)


def _trainer_logprobs(value: Sequence[Sequence[float]] | str | None,
                      source: Source) -> list[np.ndarray] | None:
    """The trainer's logprobs per rollout as float32 arrays, checked, or None (run the forward)."""
    if value is None:
        return None
    if isinstance(value, str):
        if value != FROM_DUMP:
            raise ConfigError(f"trainer_logprobs must be None, a list of per-rollout logprobs or "
                              f"{FROM_DUMP!r}, got {value!r}")
        if source.kind != "dump":
            origin = "a record" if source.kind == "record" else "the caller"
            raise ConfigError(f"trainer_logprobs={FROM_DUMP!r} reads a dump's trainer-logprob column; these "
                              f"rollouts come from {origin}: give the trainer logprobs as a list instead")
        if source.trainer_logprobs is None:
            raise InputError(f"{source.path}: no trainer-logprob column (trainer_logprobs, old_log_probs); "
                             "without one the training forward runs here: leave trainer_logprobs unset")
        value = source.trainer_logprobs
    if isinstance(value, Mapping) or not hasattr(value, "__len__"):
        raise ConfigError(f"trainer_logprobs must be a list with one list of logprobs per rollout, paired "
                          f"with the rollouts by position, got a {type(value).__name__}; give a list in the "
                          "rollouts' order (the file's row order)")
    if len(value) != len(source.rollouts):
        raise InputError(f"{len(value)} trainer logprob lists for {len(source.rollouts)} rollouts; give one "
                         "per rollout")
    out = []
    for ro, lp in zip(source.rollouts, value):
        where = f"rollout {ro.request_id!r}/{ro.sample_index}: "
        lp = logprob_floats(lp, "trainer logprob", where)  # checked before float() parses "-0.5"
        if len(lp) != len(ro.token_ids):
            raise InputError(f"{where}{len(ro.token_ids)} tokens but {len(lp)} trainer logprobs")
        out.append(np.asarray(lp, dtype=np.float32))
    return out


def _case_sampling(spec: Case | str | os.PathLike[str],
                   sampling: GivenSampling) -> tuple[Case, dict[str, SamplingParams]]:
    """The case and its sampling by request id."""
    if sampling is not None:
        raise ConfigError("give the sampling with sampling= (--temperature/--top-p/--top-k) or with case= "
                          "(--case), not both")
    case = resolve_case(spec, what="case")
    return case, {r.request_id: r.sampling for r in case.requests}


def _given_mode(sampling: GivenSampling) -> str | None:
    """The logprobs mode the given sampling names (a dump's rows without one are read in it), or None;
    ConfigError when it names several: one default cannot serve both."""
    values = sampling.values() if isinstance(sampling, Mapping) else [sampling]
    modes = {s.logprobs_mode for s in values if isinstance(s, SamplingParams)}
    if len(modes) > 1:
        raise ConfigError(f"the given sampling names the logprobs modes {sorted(modes)}; a dump's rows "
                          "without a logprobs_mode column are read in one: give logprobs_mode= "
                          "(--logprobs-mode) or the dump a logprobs_mode column")
    return modes.pop() if modes else None


def _check_case_prompts(source: Source, case: Case) -> None:
    """InputError when a rollout's prompt is not the one of the case request of its id: the case's
    sampling is matched by request id alone, so a reordered dump (ids from row order) would be scored
    under another request's sampling."""
    prompts = {r.request_id: r.prompt_ids for r in case.requests}
    for i, ro in enumerate(source.rollouts):
        want = prompts.get(ro.request_id)
        if want is None or want == ro.prompt_ids:
            continue
        fix = ("give the dump a request_id column naming each row's case request, or order its rows one per "
               "case request as the case lists them (or, if the engine tokenized the prompts otherwise, put "
               "the sampling in the dump's temperature/top_p/top_k columns and leave --case out)"
               if source.kind == "dump" else "give the case these rollouts were sampled from")
        row = f"row {i + 1}" if source.kind == "dump" else f"rollout {i + 1}"
        raise InputError(
            f"{source.path}: {row} (request_id {ro.request_id!r}, sample {ro.sample_index}) has the prompt "
            f"{_ids_text(ro.prompt_ids)} but the case's request {ro.request_id!r} has {_ids_text(want)}; "
            "the case's sampling is matched by request id alone, so this row would be scored under another "
            f"prompt's sampling: {fix}")


def _ids_text(ids: Sequence[int]) -> str:
    """Token ids for a message: all of a short prompt, else its first 8 and its length."""
    return str(tuple(ids)) if len(ids) <= 8 else f"({', '.join(map(str, ids[:8]))}, ...; {len(ids)} ids)"


def _with_sampling(rollouts: Sequence[Rollout], given: GivenSampling) -> list[Rollout]:
    """Rollouts without sampling take the given one; a contradiction is an error."""
    if given is None:
        return list(rollouts)
    out = []
    for ro in rollouts:
        mine = given.get(ro.request_id) if isinstance(given, Mapping) else given
        if mine is None:
            out.append(ro)
            continue
        mine = mine.replace(logprobs_mode=ro.logprobs_mode)
        if ro.sampling is None:
            out.append(dataclasses.replace(ro, sampling=mine))
        elif ro.sampling.definition != mine.definition:
            s = ro.sampling
            raise ConfigError(f"rollout {ro.request_id!r}/{ro.sample_index} was sampled with temperature="
                              f"{s.temperature}, top_k={s.top_k}, top_p={s.top_p} but other sampling was "
                              "given; drop the given one")
        else:
            out.append(ro)
    return out


def _rollout_dtype(given: str | None, source: Source) -> str | None:
    """The rollouts' dtype: `given` (checked against what they record), else the one they record."""
    recorded = _meta_dtype(source.rollouts)
    if given is None:
        if recorded is not None and any(r.meta.get("dtype") is None for r in source.rollouts):
            unnamed = next(r for r in source.rollouts if r.meta.get("dtype") is None)
            raise InputError(f"some rollouts record dtype {recorded!r} and others none (rollout "
                             f"{unnamed.request_id!r}/{unnamed.sample_index}); the limits depend on it: give "
                             "rollout_dtype (--rollout-dtype) for the rest, or record it on every rollout")
        return recorded
    given = check_dtype(given, "rollout_dtype")
    if recorded is not None and recorded != given:
        raise ConfigError(f"rollout_dtype (--rollout-dtype) {given!r} contradicts the rollouts' record: they "
                          f"were computed in {recorded!r}; leave rollout_dtype unset")
    return given


def _meta_dtype(rollouts: Sequence[Rollout]) -> str | None:
    """The one dtype the rollouts' meta name (rollouts naming none aside), or None when none names
    one; InputError when they name several (one report judges one dtype pair)."""
    dtypes = {r.meta.get("dtype") for r in rollouts} - {None}
    if len(dtypes) > 1:
        raise InputError(f"the rollouts record several dtypes {sorted(map(str, dtypes))}; one report judges "
                         "one dtype pair: score the rollouts of each dtype apart (rollout_dtype)")
    return dtypes.pop() if dtypes else None


def _case_name(source: Source, case: Case | None) -> str:
    """The report's `case`: the case given (`--case`), else the one a record names, else the file's
    stem ("rollouts" for objects)."""
    if case is not None:
        return case.name
    if source.case is not None:
        return source.case
    return source.path.stem if source.kind != "rollouts" else "rollouts"


def _rollouts_hash(source: Source, trainer: Sequence[np.ndarray] | None = None) -> str:
    """sha256 of what was scored (each rollout's ids, logprobs and sampling, and where it has them its
    response mask with an injected token, top-k logprobs, routes, the trainer logprobs scored against
    it when given, and a processed mode without sampling); 16 hex digits. A rollout without these
    hashes as it did before they entered (the mode of one without sampling is raw or processed, and
    only processed is marked: raw is the common case)."""
    h = hashlib.sha256()
    for i, r in enumerate(source.rollouts):
        scored: tuple[Any, ...] = (r.key, r.prompt_ids, r.token_ids, r.logprobs,
                                   None if r.sampling is None else r.sampling.to_dict())
        mask = r.response_mask if r.response_mask is not None and 0 in r.response_mask else None  # all 1s
        unsampled = "processed" if r.sampling is None and r.logprobs_mode == "processed" else None
        fields = (("response_mask", mask), ("top_k_ids", r.top_k_ids), ("top_k_logprobs", r.top_k_logprobs),
                  ("routed_experts", r.routed_experts), ("logprobs_mode", unsampled),
                  ("trainer_logprobs", None if trainer is None else np.asarray(trainer[i], np.float32)))
        extra = {name: _array_digest(value) if isinstance(value, np.ndarray) else value
                 for name, value in fields if value is not None}
        h.update(repr((*scored, extra) if extra else scored).encode())
    return h.hexdigest()[:16]


def _array_digest(array: np.ndarray) -> str:
    """An array's dtype, shape and bytes, as a sha256 hex digest."""
    array = np.ascontiguousarray(array)
    return hashlib.sha256(f"{array.dtype.str}{array.shape}".encode() + array.tobytes()).hexdigest()


def is_record(path: Path) -> bool:
    """Whether a JSONL file is a parity record (its first line is the record header)."""
    for _, first in read_jsonl(path):
        return first.get("kind") == "header" and first.get("format") == RECORD_FORMAT
    return False
