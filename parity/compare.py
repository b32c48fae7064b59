"""`parity.compare`: sample a case with one backend, score the same tokens with the training
forward, and build the `ParityReport`. Every argument is checked before an engine starts.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any

from parity.assess.training_side import check_gold, report_for, router_replay_options
from parity.backends import (
    BACKENDS,
    Backend,
    check_requests,
    lora_options,
    route_capture_options,
    shared_backend,
    top_k_limit,
)
from parity.backends import backend_options as backend_options_of
from parity.backends.base import check_samples
from parity.backends.borrowed import check_borrowed, resolve_device
from parity.backends.turns import generate
from parity.core.errors import ConfigError, OutputError
from parity.core.outputs import output_file
from parity.core.schema import KERNEL_MODES, REDUCTION_GROUPS
from parity.core.strict import check_dtype
from parity.core.top_k import TopKError
from parity.core.turns import Turn
from parity.core.types import SamplingParams
from parity.drift.tolerance import Tolerance, over_limits
from parity.models import ModelLimits, model_limits
from parity.models.checkpoints import model_text
from parity.models.lora import LoraSpec, check_adapter, check_without_tensor_parallel
from parity.report.document import ParityReport
from parity.report.provenance import provenance
from parity.rollouts.matching import match_requests
from parity.rollouts.record import write_record
from parity.workload.cases import Case, turns_problem
from parity.workload.prompts import Dataset, PromptSource
from parity.workload.resolve import resolve_workload, with_logprobs_mode


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
    trainer_dtype: str | None = None,
    tolerance: Tolerance | dict[str, Any] | None = None,
    router_replay: str | None = None,
    device: str = "auto",
    correction: dict[str, Any] | None = None,
    attribute: Sequence[str] = (),
    record: str | os.PathLike[str] | None = None,
    tensor_parallel: int | None = None,
    gold: bool | None = None,
    lora: str | os.PathLike[str] | None = None,
    top_k_logprobs: int | None = None,
    **backend_options: Any,
) -> ParityReport:
    """Measure train/infer logprob parity of `backend` on `model`.

    model: None takes the case's (another model than the case names is a ConfigError). backend: a
    registry name (shared, with `backend_options`) or a running `Backend`; a `logprobs_mode` option
    puts every request in that mode. case: a `Case` or TOML path; prompts: token ids, strings, chat
    messages or a dataset, prompt i sampled with `sampling` (default `SamplingParams(max_tokens=32)`,
    whose fields a dict overrides) and seed `sampling.seed + i`; neither:
    `default_case(model)`. turns: makes every prompt a trajectory. reference: "invariant" or
    "native". dtype: the engine's (None: a running backend's where the case lists it, else the case's
    first); trainer_dtype: the training forward's when different. tolerance: None is the case's or
    `Tolerance.for_backend`; a dict overrides the fields it names (of the case's limits where it has
    them). router_replay: "R3", "R2" or None (starts the backend with route capture; R3 without it is
    a ConfigError). device: "auto" is where the backend runs. correction: `rollout_correction` kwargs.
    attribute: `parity.attribute.AXES`. record: write the run's record after sampling (unwritable:
    `OutputError` carrying the report). tensor_parallel: the backend's degree; the forward runs the
    TP-invariant layout. gold: True, False or None (when cheap: `parity.engine.gold.decide`). lora:
    an adapter (None: the case's; another than the case's is a ConfigError; not with
    tensor_parallel or attribute). top_k_logprobs: the backend's top-k per position for the
    full-distribution drift (None: the case's; above the backend's limit: `TopKError`).
    """
    # every argument is checked before an engine starts (vLLM takes ~40 s to start on CPU)
    if reference not in KERNEL_MODES:
        raise ConfigError(f"reference must be one of {KERNEL_MODES}, got {reference!r}")
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise ConfigError(f"model must be a built-in model name or a checkpoint path, got "
                          f"{type(model).__name__} {model!r:.40}")
    the_case = resolve_workload(model, case, prompts, sampling, turns)
    if isinstance(backend, str) and "logprobs_mode" in backend_options:
        the_case = with_logprobs_mode(the_case, backend_options["logprobs_mode"])
    if top_k_logprobs is not None:
        the_case = _with_top_k(the_case, top_k_logprobs, backend, backend_options)
    elif asked := _one_top_k(the_case):
        # the case's own top_k_logprobs: a backend that returns fewer would drop the distribution drift
        _top_k_limit_check(asked, backend, backend_options, "the case's sampling.top_k_logprobs")
    model_arg = model_text(model) if model is not None else the_case.model  # a Path stays a path
    # every id against the model's vocabulary and context: an engine given a bad id dies or fails late
    names = None if prompts is None else [f"prompts[{i}]" for i in range(len(the_case.requests))]
    limits_of_model = model_limits(model_arg)
    limits_of_model.check(
        the_case.requests, names=names, prefix="" if prompts is not None else f"case {the_case.name!r}: ")
    _check_turns(the_case, limits_of_model, names)
    spec = _check_lora(lora if lora is not None else the_case.lora, model_arg, tensor_parallel, attribute)
    if spec is not None and lora is not None and the_case.lora is not None \
            and check_adapter(the_case.lora, model_arg).path.resolve() != spec.path.resolve():
        raise ConfigError(f"lora {os.fspath(lora)!r} is not the adapter case {the_case.name!r} names "
                          f"({the_case.lora!r}); drop lora (--lora) to run the case's, or copy the case file "
                          "with lora set to the one you mean")
    if dtype is None and isinstance(backend, Backend) and backend.dtype in the_case.dtypes:
        dtype = backend.dtype  # a running backend in a dtype the case lists: measured as it runs
    dtype = check_dtype(dtype or (the_case.dtypes[0] if the_case.dtypes else "bfloat16"))
    train_dtype = check_dtype(trainer_dtype or dtype, "trainer_dtype")
    name = backend if isinstance(backend, str) else getattr(backend, "name", "")
    given = _given_tolerance(tolerance, the_case.tolerance_for(name))
    limits = Tolerance.resolve(given, name, train_dtype, dtype)
    router_replay_options(router_replay)
    check_gold(gold)
    tp = tensor_parallel
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
        # True would run a degree of 1 recorded as True; 0 would fail only once vLLM starts
        raise ConfigError(f"tensor_parallel (--tp) must be an integer >= 1 (the backend's degree) or None, "
                          f"got {tensor_parallel!r}")
    device = resolve_device(device, [backend], {str(backend): backend_options})
    _check_device(device)
    _check_axes(attribute, sum(r.sampling.n for r in the_case.requests))
    _check_correction(correction)
    if record is not None:
        output_file(record, "record")
    if isinstance(backend, str):
        adapter = lora_options(backend, None if spec is None else str(spec.path))
        # a RouterReplay object by its mode: R3 on a backend that cannot record routes is refused here
        replay_mode = getattr(router_replay, "mode", router_replay)
        backend_options = {**route_capture_options(backend, replay_mode), **adapter, **backend_options}
        if tensor_parallel is not None:
            backend_options["tensor_parallel_size"] = tensor_parallel
        backend_options = _place(backend, device, backend_options)
        check_requests(backend, the_case.requests, backend_options)
    engine = _resolve_backend(backend, model_arg, dtype, backend_options, device, spec, tensor_parallel)

    start = time.perf_counter()
    generated = generate(engine, the_case.requests)
    check_samples(the_case.requests, generated, engine.name)
    rollouts = match_requests(generated, the_case.requests, limits=limits_of_model)
    record_failure = None
    if record is not None:  # written before scoring: the sampling is kept whatever happens next
        try:
            write_record(record, the_case.requests, rollouts, model=model_arg,
                         meta={"case": the_case.name, "case_hash": the_case.hash,
                               **({} if spec is None else {"lora": spec.to_dict()})})
        except OSError as e:
            record_failure = f"record {record}: could not be written ({e.strerror or e})"
    prov = provenance(model_arg, backend=engine.name, backend_meta=dict(engine.meta), dtype=train_dtype,
                      device=device, backend_device=engine.meta.get("device"), reference=reference,
                      router_replay=router_replay, seeds=[r.sampling.seed for r in the_case.requests],
                      case=the_case.name, case_hash=the_case.hash,
                      rollout_logprobs=f"sampled here by backend {engine.name!r}",
                      lora=None if spec is None else spec.to_dict())
    if train_dtype != dtype:
        prov["rollout_dtype"] = dtype
    train_tp: dict[str, Any] = {}
    if tensor_parallel is not None and engine.meta.get("reduction_groups") is None:
        # a backend of its own tensor parallelism (vLLM's): the training forward runs parity's
        # TP-invariant layout with the default K groups. A reference engine's rollouts record their
        # layout, which the training forward follows (`train_forward`'s `scoring_layout`).
        train_tp = {"tensor_parallel_size": 1, "reduction_groups": REDUCTION_GROUPS}
    if tensor_parallel is not None:
        prov["train_tensor_parallel"] = {"tensor_parallel_size": 1,
                                         "reduction_groups": engine.meta.get("reduction_groups")
                                         or REDUCTION_GROUPS}
    report = report_for(model_arg, rollouts, dtype=train_dtype, device=device, reference=reference,
                        router_replay=router_replay, tolerance=limits, provenance=prov,
                        correction=correction, attribute=attribute, gold=gold,
                        elapsed=time.perf_counter() - start,
                        lora=None if spec is None else spec.path, **train_tp)
    if record_failure is not None:
        raise OutputError(record_failure, report=report)
    return report


def _with_top_k(case: Case, k: Any, backend: str | Backend, options: dict[str, Any]) -> Case:
    """`case` asking for `k` top-k logprobs; `TopKError` unless 1 <= k <= the backend's limit."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise TopKError(f"top_k_logprobs must be an integer >= 1 (how many of the most likely tokens the "
                        f"engine returns per position), got {k!r}")
    _top_k_limit_check(k, backend, options, "top_k_logprobs")
    requests = tuple(dataclasses.replace(r, sampling=r.sampling.replace(top_k_logprobs=k))
                     for r in case.requests)
    return dataclasses.replace(case, requests=requests)


def _one_top_k(case: Case) -> int:
    """The one top_k_logprobs of every request of `case`; `TopKError` for a mix (the distribution drift
    needs one k for all rollouts: otherwise refused only after sampling)."""
    first = case.requests[0]
    other = next((r for r in case.requests if r.sampling.top_k_logprobs != first.sampling.top_k_logprobs),
                 None)
    if other is not None:
        raise TopKError(f"case {case.name!r}: request {first.request_id!r} asks for top_k_logprobs="
                        f"{first.sampling.top_k_logprobs} but request {other.request_id!r} for "
                        f"{other.sampling.top_k_logprobs}; the full-distribution drift needs one k for every "
                        "request: give every sampling block the same top_k_logprobs, or pass top_k_logprobs "
                        "(--top-k-logprobs) to ask every request for it")
    return first.sampling.top_k_logprobs


def _top_k_limit_check(k: int, backend: str | Backend, options: dict[str, Any], field: str) -> None:
    """`TopKError` naming `field` unless `backend` returns `k` top-k logprobs per position."""
    if isinstance(backend, str):
        limit = top_k_limit(backend, options)  # an unknown name: ConfigError listing the names
    elif callable(getattr(type(backend), "top_k_limit", None)):  # a running Backend (or one shaped so)
        limit = type(backend).top_k_limit(options)
    else:
        raise ConfigError(f"backend must be a backend name or a running parity Backend, got "
                          f"{type(backend).__name__} {backend!r:.40}")
    name = backend if isinstance(backend, str) else getattr(backend, "name", "")
    if limit == 0:
        raise TopKError(f"backend {name!r} returns no top-k logprobs yet; drop {field} or use "
                        "reference, hf, vllm or sglang")
    if limit is not None and k > limit:
        raise TopKError(f"{field}={k} is above the {limit} logprobs per position backend {name!r} "
                        f"returns; ask for at most {limit}")


def _given_tolerance(tolerance: Tolerance | dict[str, Any] | None, case: Tolerance | None
                     ) -> Tolerance | dict[str, Any] | None:
    """The `tolerance=` argument over the case's limits for the backend: None keeps the case's, a dict
    overrides the fields it names (of the case's limits where the case has them, else of the default)."""
    if tolerance is None:
        return case
    if isinstance(tolerance, dict) and case is not None:
        return over_limits(case, tolerance)
    return tolerance


def _check_turns(case: Case, limits: ModelLimits, names: Sequence[str] | None) -> None:
    """ConfigError naming the request and turn whose ids are outside the vocabulary or whose generated
    turn cannot fit the request's max_tokens (`turns_problem`)."""
    for i, r in enumerate(case.requests):
        problem = turns_problem(r.turns, r.sampling.max_tokens, limits)
        if problem is not None:
            who = names[i] if names is not None else f"case {case.name!r}: request {r.request_id!r}"
            raise ConfigError(f"{who}: {problem[0]}: {problem[1]}")


def _check_lora(lora: str | os.PathLike[str] | None, model: str, tensor_parallel: int | None,
                attribute: Sequence[str]) -> LoraSpec | None:
    """The adapter checked (files only) against the model and the other arguments; None without one."""
    if lora is None:
        return None
    spec = check_adapter(lora, model)
    check_without_tensor_parallel(tensor_parallel, "tensor_parallel (--tp)")
    if attribute:
        raise ConfigError("attribute does not run with a LoRA adapter yet; drop attribute (--attribute) or "
                          "lora")
    return spec


def _place(backend: str, device: str, options: dict[str, Any]) -> dict[str, Any]:
    """`options` with the backend on `device` where it takes one (left as is on the CPU default)."""
    if device == "cpu" or backend not in BACKENDS:
        return options
    if "device" in backend_options_of(backend):
        return {**options, "device": device}
    return options


def _check_device(device: str) -> None:
    """ConfigError unless the training forward can run on `device`, checked before an engine starts."""
    from parity.models.loading import check_device  # torch: `import parity` stays light

    check_device(device)


def _check_correction(correction: dict[str, Any] | None) -> None:
    """ConfigError unless `correction` is None or valid `CorrectionConfig` options, before sampling."""
    from parity.correction import CorrectionConfig  # torch: `import parity` stays light

    if correction is not None:
        CorrectionConfig.from_dict(correction)


def _check_axes(attribute: Sequence[str], rollouts: int) -> None:
    """ConfigError unless every drift-attribution axis exists and can show drift on the `rollouts` the
    case samples (checked before sampling, not after)."""
    if isinstance(attribute, str) or not isinstance(attribute, Sequence):
        raise ConfigError(f"attribute must be a list of axes, got {attribute!r}")
    if attribute:
        # torch: `import parity` stays light
        from parity.attribute import AXES
        from parity.attribute.section import ONE_SEQUENCE_SAME

        unknown = [axis for axis in attribute if axis not in AXES]
        if unknown:
            raise ConfigError(f"attribute: unknown axes {unknown}; choose from {list(AXES)}")
        alone = [axis for axis in attribute if axis in ONE_SEQUENCE_SAME]
        if rollouts == 1 and alone:  # attribution_section's refusal, before the engine rather than after
            both = " and ".join(alone)
            raise ConfigError(f"attribute {alone}: the case samples 1 rollout, and with 1 sequence both "
                              f"sides of {both} run the same [1, len] forward, so it would show no drift by "
                              "construction; give at least 2 prompts (or sampling n >= 2) or drop the axis "
                              "from attribute (--attribute)")


def _resolve_backend(backend: str | Backend, model: str, dtype: str, options: dict[str, Any],
                     device: str, lora: LoraSpec | None, tensor_parallel: int | None = None) -> Backend:
    """The named backend started (shared), or the running one checked against the call."""
    if isinstance(backend, str):
        return shared_backend(backend, model, dtype=dtype, **options)
    placed = device if isinstance(backend, Backend) and "device" in backend.option_names() else None
    return check_borrowed(backend, model=model, dtype=dtype, device=placed, options=options, lora=lora,
                          tensor_parallel=tensor_parallel)
