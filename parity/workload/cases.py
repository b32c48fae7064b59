"""Cases: a model, a prompt workload, sampling, dtypes, backends and a tolerance, in one object.

`load_case` reads a TOML case file, `load_cases` a directory, file or comma-separated list, and
`default_case` is the built-in workload. The file schema is in docs/DESIGN.md, "Case files and
rollout dumps"; an unknown key or bad value is a `ConfigError` naming file, field and choices.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parity.core.errors import ConfigError, ParityError
from parity.core.schema import (
    BACKEND_NAMES,
    CASE_KINDS,
    DTYPES,
    LOGPROBS_MODES,
    ROUTER_REPLAY_CHOICES,
    LogprobsMode,
    sweep_request_id,
)
from parity.core.turns import Generate, Inject, Turn, check_turns
from parity.core.types import Request, SamplingParams
from parity.drift.tolerance import Tolerance, given_limits
from parity.models import ModelLimits, model_limits
from parity.workload.case_fields import (
    Fields,
    check_model_place,
    check_requests_agree,
    check_unshadowed,
    control_character,
    load_lora,
    printable_field,
)
from parity.workload.case_prompts import load_prompt_table
from parity.workload.tools import bind_tools, encode_text


@dataclass(frozen=True)
class Case:
    """One parity workload.

    requests: in send order, seeds included. dtypes: `compare` uses the first. backends: nightly's
    matrix (empty: any). tolerance (None, or limits it omits: the row's default), backend_tolerances.
    router_replay, prefix_caching: variants nightly runs as rows (empty: one row). kind: "compare",
    "lifecycle", "trajectory", "loop" or "audit". reference_tensor_parallel_size: ranks of the
    reference engine in nightly rows. lora: adapter on `model`. loop_steps, loop_lr: loop cases.
    """

    name: str
    model: str
    requests: tuple[Request, ...]
    dtypes: tuple[str, ...] = ("bfloat16",)
    backends: tuple[str, ...] = ()
    logprobs_mode: LogprobsMode = "processed"
    tolerance: Tolerance | None = None
    path: Path | None = None
    description: str = ""
    backend_tolerances: tuple[tuple[str, Tolerance], ...] = ()
    router_replay: tuple[str, ...] = ()
    kind: str = "compare"
    prefix_caching: tuple[bool, ...] = ()
    reference_tensor_parallel_size: int = 1
    loop_steps: int = 10
    loop_lr: float = 1e-3
    lora: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"case name must be a non-empty string, got {self.name!r}")
        where = f"case {self.name!r}"
        for name in ("model", "description", "logprobs_mode", "kind", "lora"):
            if not isinstance(getattr(self, name), str) and not (name == "lora" and self.lora is None):
                raise ConfigError(f"{where}: {name} must be a string, got {getattr(self, name)!r}")
        for name in ("name", "description"):  # printed as they are: the terminal, summary.md, HTML
            bad = control_character(getattr(self, name))
            if bad is not None:
                raise ConfigError(f"case {name} contains the control character {bad!r}; give printable text")
        for name in ("requests", "dtypes", "backends", "router_replay", "backend_tolerances"):
            if not isinstance(getattr(self, name), tuple):
                kind = type(getattr(self, name)).__name__
                raise ConfigError(f"{where}: {name} must be a tuple, got {kind}")
        if not all(isinstance(r, Request) for r in self.requests):
            raise ConfigError(f"{where}: requests must hold parity.Request objects")
        if not self.requests:
            raise ConfigError(f"{where}: requests is empty; a case needs at least one prompt")
        ids = [r.request_id for r in self.requests]
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            # scoring finds each rollout's sampling parameters by its request id
            raise ConfigError(f"{where}: request_id {repeated[0]!r} is used more than once; give every "
                              "request its own id")
        if self.tolerance is not None and not isinstance(self.tolerance, Tolerance):
            raise ConfigError(f"{where}: tolerance must be a parity.Tolerance or None, got "
                              f"{self.tolerance!r}")
        if not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], Tolerance)
                   for p in self.backend_tolerances):
            raise ConfigError(f"{where}: backend_tolerances must hold (backend, Tolerance) pairs")
        if self.path is not None and not isinstance(self.path, Path):
            raise ConfigError(f"{where}: path must be a pathlib.Path or None, got {self.path!r}")
        _check_choices(where, "dtypes", self.dtypes, DTYPES)
        _check_choices(where, "backends", self.backends, BACKEND_NAMES)
        _check_choices(where, "router_replay", self.router_replay, ROUTER_REPLAY_CHOICES)
        _check_choices(where, "kind", [self.kind], CASE_KINDS)
        if not self.dtypes:
            raise ConfigError(f"{where}: dtypes is empty; allowed: {list(DTYPES)}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(
                f"{where}: logprobs_mode {self.logprobs_mode!r}; allowed: {list(LOGPROBS_MODES)}")
        _check_choices(where, "tolerance.<backend>", [b for b, _ in self.backend_tolerances], BACKEND_NAMES)
        check_requests_agree(where, self.requests, self.logprobs_mode)
        trajectories = [r.request_id for r in self.requests if r.turns]
        if self.kind == "trajectory" and len(trajectories) != len(self.requests):
            raise ConfigError(f"{where}: kind 'trajectory' needs turns on every request; give [[turns]]")
        if self.kind != "trajectory" and trajectories:
            raise ConfigError(f"{where}: requests {trajectories[:3]} have turns; set kind = 'trajectory'")
        caching = self.prefix_caching
        if not isinstance(caching, tuple) or not all(isinstance(v, bool) for v in caching) \
                or len(set(caching)) != len(caching):
            # a string "false" would run the prefix cache on: any non-empty string is true
            raise ConfigError(f"{where}: prefix_caching must hold distinct True/False values, got "
                              f"{self.prefix_caching!r}")
        if self.prefix_caching and self.kind != "trajectory":
            raise ConfigError(f"{where}: prefix_caching is an axis of trajectory cases; "
                              "set kind = 'trajectory'")
        if self.lora is not None and self.kind == "lifecycle":
            raise ConfigError(f"{where}: lora does not apply to a lifecycle case (its weight-update check "
                              "pushes base weights); check adapter swaps with check_adapter_sync")
        tp = self.reference_tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"{where}: reference_tensor_parallel_size must be an integer >= 1, got {tp!r}")
        steps, lr = self.loop_steps, self.loop_lr
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"{where}: loop_steps must be an integer >= 1, got {steps!r}")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < math.inf:
            raise ConfigError(f"{where}: loop_lr must be a finite number > 0, got {lr!r}")
        object.__setattr__(self, "loop_lr", float(lr))  # 1 and 1.0 are one workload, one hash
        if tp > 1 and self.kind != "compare":
            raise ConfigError(f"{where}: reference_tensor_parallel_size applies to compare cases only "
                              f"(this case's kind is {self.kind!r}); remove it or set it to 1")

    @property
    def hash(self) -> str:
        """sha256 of everything that defines the workload (provenance; 16 hex digits)."""
        body = {
            "model": self.model, "dtypes": list(self.dtypes), "logprobs_mode": self.logprobs_mode,
            "requests": [r.to_dict() for r in self.requests],
            **({"kind": self.kind} if self.kind != "compare" else {}),
            **({"prefix_caching": list(self.prefix_caching)} if self.prefix_caching else {}),
            **({"reference_tensor_parallel_size": self.reference_tensor_parallel_size}
               if self.reference_tensor_parallel_size != 1 else {}),
            **({"loop_steps": self.loop_steps, "loop_lr": self.loop_lr} if self.kind == "loop" else {}),
            **({"lora": self.lora} if self.lora is not None else {}),
        }
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def seeds(self) -> list[int]:
        """The sampling seed of every request, in send order (provenance)."""
        return [r.sampling.seed for r in self.requests]

    def tolerance_for(self, backend: str) -> Tolerance | None:
        """The limits for `backend`: its override, else the case-wide limits, else None (default)."""
        return dict(self.backend_tolerances).get(backend, self.tolerance)


def _check_choices(where: str, field: str, values: Iterable[str], allowed: tuple[str, ...]) -> None:
    values = list(values)
    bad = [v for v in values if v not in allowed]
    if bad:
        raise ConfigError(f"{where}: {field} has {bad}; allowed: {list(allowed)}")
    twice = next((v for i, v in enumerate(values) if v in values[:i]), None)
    if twice is not None:  # a row run twice; of two tolerances for one backend, the last silently wins
        raise ConfigError(f"{where}: {field} has {twice!r} twice; give each value once")


def default_case(model: str = "tiny-llama", *, num_prompts: int = 8, max_tokens: int = 32,
                 seed: int = 0) -> Case:
    """The built-in workload: `num_prompts` random byte-token prompts of 8-48 tokens, n=2,
    temperature 1.0, top-p 0.95, seeds 1000+i."""
    rng = np.random.Generator(np.random.PCG64(seed))
    sampling = SamplingParams(n=2, temperature=1.0, top_p=0.95, max_tokens=max_tokens)
    requests = []
    for i in range(num_prompts):
        length = int(rng.integers(8, 49))
        ids = tuple(int(t) for t in rng.integers(3, 259, size=length))
        requests.append(Request(ids, sampling.replace(seed=1000 + i), request_id=f"default-{i}"))
    return Case(name="default", model=model, requests=tuple(requests))


# --------------------------------------------------------------------------------------------
# Loading


def load_cases(spec: str | Path, *, cases_dir: str | Path = "cases", flag: str = "--cases") -> list[Case]:
    """Cases named by `spec`: a directory (every *.toml in it, sorted), one file, or a
    comma-separated list of files and bare names (`smoke` means `<cases_dir>/smoke.toml`).
    flag: how errors name the option (`--cases` of nightly, `--case` of a command taking one)."""
    cases: list[Case] = []
    for part in (p.strip() for p in str(spec).split(",")):
        if not part:
            continue
        path = Path(part)
        check_unshadowed(part, cases_dir, flag)
        if path.is_dir():
            files = sorted(path.glob("*.toml"))
            if not files:
                raise ConfigError(f"{flag}: directory {str(path)!r} has no *.toml case files")
            cases.extend(load_case(f) for f in files)
        elif path.is_file():
            cases.append(load_case(path))
        elif path.suffix != ".toml" and (Path(cases_dir) / f"{part}.toml").is_file():
            cases.append(load_case(Path(cases_dir) / f"{part}.toml"))
        else:
            raise ConfigError(
                f"{flag}: {part!r} is neither a case file, a directory, nor a name in "
                f"{str(cases_dir)!r}; give a .toml path, a directory or {_case_names_text(cases_dir)}"
            )
    if not cases:
        raise ConfigError(f"{flag}: {str(spec)!r} names no case")
    names = [c.name for c in cases]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"{flag}: case name(s) {dupes} appear more than once; names must be unique")
    return cases


def resolve_case(spec: Case | str | os.PathLike[str], *, cases_dir: str | Path = "cases",
                 what: str = "case") -> Case:
    """The one case `spec` names: a `Case`, a case file, or a bare name in `cases_dir` (`smoke`
    means `<cases_dir>/smoke.toml`). Every command and function that takes one case reads it here.
    what: how the error names the argument ("--case", "case")."""
    if isinstance(spec, Case):
        return spec
    if not isinstance(spec, (str, os.PathLike)):
        raise ConfigError(f"{what} must be a Case, a case file or a case name, got {type(spec).__name__}")
    path = Path(spec)
    if isinstance(spec, str) and path.is_file():  # a pathlib.Path is a path; a directory is no case
        check_unshadowed(spec, cases_dir, what)
    if path.is_file():
        return load_case(path)
    named = Path(cases_dir) / f"{path.name}.toml"
    if path.suffix != ".toml" and len(path.parts) == 1 and named.is_file():
        return load_case(named)
    raise ConfigError(f"{what} {str(spec)!r} is neither a case file nor a case name in {str(cases_dir)!r}; "
                      f"give a .toml path or {_case_names_text(cases_dir)}")


def _case_names(cases_dir: str | Path) -> list[str]:
    return sorted(p.stem for p in Path(cases_dir).glob("*.toml"))


def _case_names_text(cases_dir: str | Path) -> str:
    """"one of [names]", or where the case directory is missing (a run outside the repository)."""
    names = _case_names(cases_dir)
    if names:
        return f"one of {names}"
    return f"a name in a case directory (there is none at {str(Path(cases_dir).resolve())!r})"


_TOP_KEYS = ("name", "description", "model", "dtypes", "backends", "logprobs_mode", "router_replay",
             "kind", "prompts", "sampling", "tolerance", "turns", "prefix_caching",
             "reference_tensor_parallel_size", "loop", "lora")
_SAMPLING_KEYS = ("label", "n", "temperature", "top_p", "top_k", "max_tokens", "seed", "stop_token_ids",
                  "ignore_eos", "top_k_logprobs")


def load_case(path: str | Path) -> Case:
    """Parse and validate one case file (schema in this module's docstring)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))  # TOML is UTF-8 whatever the locale
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read case file ({exc.strerror})") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); TOML case files are "
                          "UTF-8: save it as UTF-8") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from exc
    f = Fields(path)
    f.only(data, "", _TOP_KEYS)
    model = f.get(data, "model", str)
    check_model_place(f, model)
    try:
        limits = model_limits(model)
    except ParityError as exc:
        raise f.error("model", str(exc)) from exc
    # every field is checked before the prompts are encoded: a tokenizer takes seconds to load
    logprobs_mode = f.choice(data, "logprobs_mode", LOGPROBS_MODES, default="processed")
    encode = load_prompt_table(f, f.get(data, "prompts", dict), model, limits)
    blocks = _sampling_blocks(f, data.get("sampling"), logprobs_mode, limits)
    kind = f.choice(data, "kind", CASE_KINDS, default="compare")
    if kind != "trajectory" and "turns" in data:
        raise f.error("turns", "only a trajectory case has turns; set kind = \"trajectory\"")
    if kind != "loop" and "loop" in data:
        raise f.error("loop", "only a loop case has loop settings; set kind = \"loop\"")
    loop = f.get(data, "loop", dict, default={})
    f.only(loop, "loop.", ("steps", "lr"))
    lr = f.get(loop, "lr", (int, float), default=1e-3, prefix="loop.")
    if not 0 < lr < math.inf:
        raise f.error("loop.lr", f"must be a finite number > 0, got {lr!r}")
    tolerance, per_backend = _load_tolerances(f, data.get("tolerance", {}))
    fields = dict(
        name=printable_field(f, data, "name", default=path.stem),
        dtypes=tuple(f.choices(data, "dtypes", DTYPES, default=["bfloat16"], nonempty=True)),
        backends=tuple(f.choices(data, "backends", BACKEND_NAMES, default=[])),
        description=printable_field(f, data, "description", default=""),
        router_replay=tuple(f.choices(data, "router_replay", ROUTER_REPLAY_CHOICES, default=[])),
        prefix_caching=tuple(_load_prefix_caching(f, data)),
        reference_tensor_parallel_size=f.count(data, "reference_tensor_parallel_size", prefix="", default=1),
        loop_steps=f.count(loop, "steps", prefix="loop.", default=10), loop_lr=float(lr),
        lora=load_lora(f, data, model),
    )
    requests = _requests(blocks, encode())
    if kind == "trajectory":
        turns = _load_turns(f, data.get("turns"), model)
        for j, (_, base, _) in enumerate(blocks):
            where = f"sampling[{j}]" if len(blocks) > 1 else "sampling"
            problem = turns_problem(turns, base.max_tokens, limits, max_tokens_field=f"{where}.max_tokens")
            if problem is not None:
                raise f.error(*problem)
        requests = tuple(dataclasses.replace(r, turns=turns) for r in requests)
    try:
        limits.check(requests)
    except ParityError as exc:
        raise f.error("prompts", str(exc)) from exc
    return Case(model=model, requests=requests, logprobs_mode=logprobs_mode, tolerance=tolerance, path=path,
                backend_tolerances=per_backend, kind=kind, **fields)


_TURN_KEYS = ("generate", "stop_token_ids", "inject", "tool")


def _load_turns(f: Fields, table: Any, model: str) -> tuple[Turn, ...]:
    if not isinstance(table, list) or not table or not all(isinstance(t, dict) for t in table):
        raise f.error("turns", "a trajectory case needs [[turns]] tables (generate, inject or tool)")
    turns: list[Turn] = []
    for i, t in enumerate(table):
        where = f"turns[{i}]"
        f.only(t, where + ".", _TURN_KEYS)
        given = [k for k in ("generate", "inject", "tool") if k in t]
        if len(given) != 1:
            raise f.error(where, f"give exactly one of generate, inject, tool; got {given}")
        if "stop_token_ids" in t and "generate" not in t:
            raise f.error(where + ".stop_token_ids", "only a generate turn has stop ids")
        try:
            if "generate" in t:
                stops = t.get("stop_token_ids", [])
                if not isinstance(stops, list) or not all(isinstance(x, int) for x in stops):
                    raise f.error(where + ".stop_token_ids", f"must be a list of token ids, got {stops!r}")
                turns.append(Generate(f.count(t, "generate", prefix=where + "."), tuple(stops)))
            elif "tool" in t:
                turns.append(bind_tools(model, (Inject(name=f.get(t, "tool", str, prefix=where + ".")),),
                                        where)[0])
            elif isinstance(t["inject"], str):
                ids = encode_text(model, t["inject"], where + ".inject")
                if not ids:  # an Inject without ids is an unbound tool: it would fail mid-run
                    raise f.error(where + ".inject", f"the text {t['inject']!r} encodes to no tokens; give "
                                                     "text of at least one token, or token ids")
                turns.append(Inject(ids, name="text"))
            elif _token_ids(t["inject"]):
                turns.append(Inject(tuple(t["inject"])))
            else:
                raise f.error(where + ".inject",
                              f"must be text or a non-empty list of token ids, got {t['inject']!r}")
        except ConfigError as exc:
            raise exc if str(exc).startswith(str(f.path)) else f.error(where, str(exc)) from exc
    try:
        return check_turns(turns, "turns")
    except ConfigError as exc:
        raise f.error("turns", str(exc)) from exc


def turns_problem(turns: Iterable[Turn], max_tokens: int, limits: ModelLimits | None, *,
                  max_tokens_field: str = "sampling.max_tokens") -> tuple[str, str] | None:
    """(field, message) of the first turn that cannot be what it says, or None: a stop or injected id
    outside the vocabulary (a stop that never fires, an id the engine refuses mid-run), or a generated
    turn whose budget cannot fit in `max_tokens` (the whole response, injections included) even when
    every turn before it is as short as it can be (a generated turn: 1 token; a tool reply: none), so
    that it is cut or never sampled."""
    fewest = 0  # the fewest response tokens before turn i
    for i, turn in enumerate(turns):
        where = f"turns[{i}]"
        if isinstance(turn, Generate):
            problem = None if limits is None else limits.vocabulary_problem(turn.stop_token_ids)
            if problem:
                return f"{where}.stop_token_ids", problem
            if fewest + turn.max_tokens > max_tokens:
                before = f", the turns before it take at least {fewest} of them," if fewest else ","
                need = fewest + turn.max_tokens
                return (f"{where}.generate",
                        f"{turn.max_tokens} tokens do not fit in {max_tokens_field} = {max_tokens}, which "
                        f"bounds the whole response (generated and injected tokens){before} so this turn "
                        f"would be cut or never sampled; raise {max_tokens_field} to at least {need} or "
                        "lower generate")
            fewest += 1
        else:
            problem = None if limits is None else limits.vocabulary_problem(turn.token_ids)
            if problem:
                return f"{where}.inject", problem
            fewest += len(turn.token_ids)
    return None


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(x, int) for x in value)


def _load_prefix_caching(f: Fields, data: dict[str, Any]) -> list[bool]:
    values = data.get("prefix_caching", [])
    if not isinstance(values, list) or not all(isinstance(v, bool) for v in values) \
            or len(set(values)) != len(values):
        raise f.error("prefix_caching", f"must be a list of distinct true/false values, got {values!r}")
    return values


def _sampling_blocks(f: Fields, sampling: Any, logprobs_mode: str,
                     limits: ModelLimits) -> list[tuple[str, SamplingParams, int]]:
    """(label, parameters, first seed) of each sampling block (a table, or labelled [[sampling]] blocks)."""
    if sampling is None:
        sampling = {}
    blocks = sampling if isinstance(sampling, list) else [sampling]
    if not blocks or not all(isinstance(b, dict) for b in blocks):
        raise f.error("sampling", "must be a table, or a non-empty list of tables ([[sampling]]) for a sweep")
    out = []
    labels: set[str] = set()
    for j, block in enumerate(blocks):
        where = f"sampling[{j}]." if len(blocks) > 1 else "sampling."
        f.only(block, where, _SAMPLING_KEYS)
        params = {k: v for k, v in block.items() if k not in ("label", "seed")}
        seed = f.count(block, "seed", prefix=where, low=0, default=0)
        try:
            base = SamplingParams.from_dict({**params, "logprobs_mode": logprobs_mode})
        except (ParityError, TypeError) as exc:
            raise f.error(where.rstrip("."), str(exc)) from exc
        problem = limits.vocabulary_problem(base.stop_token_ids)
        if problem:
            raise f.error(where + "stop_token_ids", problem)
        if len(blocks) == 1 and "label" in block:
            # a label prefixes the request ids of a sweep's blocks; on a lone block it would be dropped
            raise f.error(where + "label", "names a block of a sweep ([[sampling]] given two or more times); "
                                           "remove it, or add the sweep's other blocks")
        label = f.get(block, "label", str, default=_label(base), prefix=where) if len(blocks) > 1 else ""
        if len(blocks) > 1 and (not label or control_character(label) is not None):
            # "" would give the block plain ids ("0"), outside the sweep; a label is printed as it is
            raise f.error(where + "label", f"must be non-empty printable text, got {label!r}")
        if label in labels:
            raise f.error(where + "label", f"{label!r} is used by two sampling blocks; labels must be unique")
        labels.add(label)
        out.append((label, base, seed))
    return out


def _requests(blocks: list[tuple[str, SamplingParams, int]],
              prompts: list[tuple[int, ...]]) -> tuple[Request, ...]:
    """One request per (sampling block, prompt); in a sweep, ids are "<label>/<i>" (`sweep_request_id`)."""
    return tuple(Request(ids, base.replace(seed=seed + i),
                         request_id=sweep_request_id(label, i) if label else str(i))
                 for label, base, seed in blocks for i, ids in enumerate(prompts))


def _label(s: SamplingParams) -> str:
    """A readable default label for a sweep block, e.g. "t0.6-p0.9-k20"."""
    parts = [f"t{s.temperature:g}"]
    if s.top_p < 1.0:
        parts.append(f"p{s.top_p:g}")
    if s.top_k:
        parts.append(f"k{s.top_k}")
    return "-".join(parts)


def _load_tolerances(f: Fields, table: Any) -> tuple[Tolerance | None, tuple[tuple[str, Tolerance], ...]]:
    """[tolerance] scalars are case-wide limits; [tolerance.<backend>] tables override one backend."""
    if not isinstance(table, dict):
        raise f.error("tolerance", f"must be a table of Tolerance fields, got {table!r}")
    common = {k: v for k, v in table.items() if not isinstance(v, dict)}
    per_backend = {k: v for k, v in table.items() if isinstance(v, dict)}
    for name in per_backend:
        if name not in BACKEND_NAMES:
            raise f.error(f"tolerance.{name}", f"unknown backend; allowed: {list(BACKEND_NAMES)}")
    try:
        tolerance = given_limits(common) if common else None
        overrides = tuple(
            (name, given_limits({**common, **limits}, where=f"tolerance.{name}"))
            for name, limits in per_backend.items()
        )
    except (ParityError, TypeError) as exc:
        raise ConfigError(f"{f.path}: {exc}") from exc
    return tolerance, overrides
