"""`parity.compare`: sample a case with one backend, score the same tokens with the training
forward, and build the `ParityReport`.

Data flows one way: case -> requests -> backend.generate -> rollouts (checked against their
requests, `parity.rollouts.matching`) -> the training side
(`parity.assess.training_side.report_for`: each rollout scored under its request's logprob
definition and in the layout it records) -> report. Every argument is checked before an engine starts.
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
    lora_options,
    route_capture_options,
    shared_backend,
    top_k_limit,
)
from parity.backends import backend_options as backend_options_of
from parity.backends.borrowed import check_borrowed, resolve_device
from parity.backends.turns import generate
from parity.core.errors import ConfigError, OutputError
from parity.core.outputs import output_file
from parity.core.schema import KERNEL_MODES, REDUCTION_GROUPS
from parity.core.strict import check_dtype
from parity.core.top_k import TopKError
from parity.core.turns import Turn
from parity.core.types import SamplingParams
from parity.drift.tolerance import Tolerance
from parity.models import model_limits
from parity.models.lora import LoraSpec, check_adapter, check_without_tensor_parallel
from parity.report.document import ParityReport
from parity.report.provenance import provenance
from parity.rollouts.matching import check_samples, match_requests
from parity.rollouts.record import write_record
from parity.workload.cases import Case
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

    model: built-in checkpoint name or local HF directory; None takes the case's model.
    backend: a registry name (started once per process through `shared_backend`, with
        `backend_options`) or a running `Backend` to reuse. A `logprobs_mode` backend option
        (vllm-server's: the mode the server reports) puts every request in that mode
        (`parity.workload.resolve.with_logprobs_mode`), so `--option logprobs_mode=raw` alone compares raw
        logprobs.
    case: a `Case` or the path of a case TOML file. prompts: a list of token-id lists, strings
        or chat-message lists (`[{"role": "user", "content": ...}]`, rendered with the
        checkpoint's chat template), or a dataset file (a `parity.workload.prompts.Dataset`, or a path:
        JSONL or Parquet in verl's layout); see `parity.workload.prompts`. Prompt i is sampled with
        `sampling` (default `SamplingParams(max_tokens=32)`) and seed `sampling.seed + i`. With
        neither, `parity.workload.cases.default_case(model)` is used.
    turns: with prompts, makes every prompt a multi-turn trajectory (`parity.core.turns`):
        `Generate(max_tokens)` and `Inject(token_ids)`, `Inject(fn=...)` or `Inject(name=TOOL)`
        (a built-in tool, `parity.workload.tools`); `sampling.max_tokens` bounds the whole response.
        Backends other than the reference engine run it turn by turn (`parity.backends.turns`);
        metrics read generated tokens only and the report adds drift by turn.
    reference: training-forward kernels, "invariant" (batch-invariant) or "native" (stock torch).
    dtype: the engine's dtype, "bfloat16", "float16" or "float32"; None = the case's first dtype, else
        "bfloat16".
    trainer_dtype: the training forward's dtype when it differs from the engine's (verl's float32
        trainer beside a bf16 vLLM); None = `dtype`. Provenance records both (`dtype` is the
        trainer's, `rollout_dtype` the engine's).
    tolerance: limits for `passed`; None = the case's limits for this backend, else
        `Tolerance.for_backend(name, trainer_dtype, dtype)` (the less precise dtype of the pair's
        limits: docs/PRECISION.md); a dict overrides fields of that default.
    router_replay: MoE router replay mode of the training forward: "R3" replays the routes the
        backend recorded, "R2" the trainer's own first pass; None or "none" = off. Either mode
        starts a named backend with its route-capture option on (`route_capture_options`), so
        the report also holds router agreement; R3 on a backend that cannot record routes is a
        ConfigError.
    device: where the training forward runs ("cpu", "cuda"), and the backend too where it takes a
        `device` option (reference, hf); a running reference or hf backend on another device
        type is a ConfigError. "auto" (default): where the backend runs
        (`parity.backends.borrowed.resolve_device`: cuda for vLLM or SGLang on a CUDA host, else
        cpu). Engines that choose
        their own device (vLLM, servers) run where they run; `provenance["backend_device"]` and
        `["train_device"]` record both sides.
    correction: keyword arguments of `parity.correction.rollout_correction` for `metrics`;
        None = `DEFAULT_CORRECTION`.
    attribute: drift-attribution axes (`parity.attribute.AXES`: "batch", "layout", "mode",
        "dtype") run on the sampled tokens; the result goes to `report.extras["attribution"]`.
    record: write the run's record (the requests and the rollouts, `parity.rollouts.record`) to this
        path, to replay through another backend or score again with `parity.scoring.score`;
        written right after sampling. If it cannot be written the comparison still finishes and
        `OutputError` is raised with the report in its `report` attribute.
    tensor_parallel: the backend's tensor-parallel degree (its `tensor_parallel_size` option; a
        running backend keeps its own); the training forward then runs parity's TP-invariant
        layout (`train_forward(tensor_parallel_size=1)`), whose logprobs the reference engine
        matches at every degree, with the reference backend's `reduction_groups` option (default 8;
        bits match only for the same value, which `provenance["train_tensor_parallel"]` records).
    gold: also score the tokens with the gold forward (`parity.engine.gold`: float64 on CPU, float32
        without TF32 on CUDA, on `device`) and add which side is farther from it (`parity.assess.accuracy`:
        the `gold/*` summary keys, the "Which side moved" page section). None (default) runs it when
        its estimated time is under a second or at most 20% of the row's sampling and
        training-forward time (`parity.engine.gold.decide`); `report.extras["gold"]` says whether it
        ran and why.
    lora: a LoRA adapter on top of `model` (a peft adapter directory or a built-in adapter name,
        `parity.models.lora`) that the backend and the training forward apply; None = the case's
        `lora`, if any. Checked against the model before an engine starts; a backend that cannot
        apply one (`parity.backends.lora_backends`), a running backend with another adapter,
        tensor_parallel and attribute are ConfigErrors. The report's provenance records it.
    top_k_logprobs: also ask the backend for its k most likely tokens at every response position
        (every request's `sampling.top_k_logprobs`) and add the full-distribution drift against the
        training forward's full row (`parity.drift.distribution`: the `distribution/` summary keys,
        `report.extras["distribution"]`; docs/DISTRIBUTION.md). A k above what the backend returns
        (`parity.backends.top_k_limit`) is a `TopKError` before the engine starts.
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
    model_arg = os.fspath(model) if model is not None else the_case.model
    # every id against the model's vocabulary and context: an engine given a bad id dies or fails late
    names = None if prompts is None else [f"prompts[{i}]" for i in range(len(the_case.requests))]
    limits_of_model = model_limits(model_arg)
    limits_of_model.check(
        the_case.requests, names=names, prefix="" if prompts is not None else f"case {the_case.name!r}: ")
    spec = _check_lora(lora if lora is not None else the_case.lora, model_arg, tensor_parallel, attribute)
    dtype = check_dtype(dtype or (the_case.dtypes[0] if the_case.dtypes else "bfloat16"))
    train_dtype = check_dtype(trainer_dtype or dtype, "trainer_dtype")
    name = backend if isinstance(backend, str) else getattr(backend, "name", "")
    given = tolerance if tolerance is not None else the_case.tolerance_for(name)
    limits = Tolerance.resolve(given, name, train_dtype, dtype)
    router_replay_options(router_replay)
    check_gold(gold)
    device = resolve_device(device, [backend], {str(backend): backend_options})
    _check_device(device)
    _check_axes(attribute)
    _check_correction(correction)
    if record is not None:
        output_file(record, "record")
    if isinstance(backend, str):
        adapter = lora_options(backend, None if spec is None else str(spec.path))
        backend_options = {**route_capture_options(backend, router_replay), **adapter, **backend_options}
        if tensor_parallel is not None:
            backend_options["tensor_parallel_size"] = tensor_parallel
        backend_options = _place(backend, device, backend_options)
    engine = _resolve_backend(backend, model_arg, dtype, backend_options, device, spec)

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
    """`case` with every request asking for `k` top-k logprobs, refused (`TopKError`) before the
    engine starts when k is not an integer >= 1 or above what the backend returns."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise TopKError(f"top_k_logprobs must be an integer >= 1 (how many of the most likely tokens the "
                        f"engine returns per position), got {k!r}")
    name = backend if isinstance(backend, str) else getattr(backend, "name", "")
    limit = top_k_limit(name, options) if name in BACKENDS else type(backend).top_k_limit(options)
    if limit == 0:
        raise TopKError(f"backend {name!r} returns no top-k logprobs yet; drop top_k_logprobs or use "
                        "reference, hf, vllm or sglang")
    if limit is not None and k > limit:
        raise TopKError(f"top_k_logprobs={k} is above the {limit} logprobs per position backend {name!r} "
                        f"returns; ask for at most {limit}")
    requests = tuple(dataclasses.replace(r, sampling=r.sampling.replace(top_k_logprobs=k))
                     for r in case.requests)
    return dataclasses.replace(case, requests=requests)


def _check_lora(lora: str | os.PathLike[str] | None, model: str, tensor_parallel: int | None,
                attribute: Sequence[str]) -> LoraSpec | None:
    """The adapter checked against the model (`check_adapter`, files only) and against the other
    arguments, before an engine starts; None without one."""
    if lora is None:
        return None
    spec = check_adapter(lora, model)
    check_without_tensor_parallel(tensor_parallel, "tensor_parallel (--tp)")
    if attribute:
        raise ConfigError("attribute does not run with a LoRA adapter yet; drop attribute (--attribute) or "
                          "lora")
    return spec


def _place(backend: str, device: str, options: dict[str, Any]) -> dict[str, Any]:
    """`options` with the backend placed on `device` where the backend takes a `device` option
    (the reference engine, hf): a comparison's two sides run on one device. Left as is on the CPU
    default, so CPU runs share the engines started without the option."""
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


def _check_axes(attribute: Sequence[str]) -> None:
    """ConfigError unless every drift-attribution axis exists (checked before sampling, not after)."""
    if isinstance(attribute, str) or not isinstance(attribute, Sequence):
        raise ConfigError(f"attribute must be a list of axes, got {attribute!r}")
    if attribute:
        from parity.attribute import AXES  # torch: `import parity` stays light

        unknown = [axis for axis in attribute if axis not in AXES]
        if unknown:
            raise ConfigError(f"attribute: unknown axes {unknown}; choose from {list(AXES)}")


def _resolve_backend(backend: str | Backend, model: str, dtype: str, options: dict[str, Any],
                     device: str, lora: LoraSpec | None) -> Backend:
    """The named backend started (shared), or the running one checked against the call; a running
    backend's device matters only where it takes a `device` option (reference, hf)."""
    if isinstance(backend, str):
        return shared_backend(backend, model, dtype=dtype, **options)
    placed = device if isinstance(backend, Backend) and "device" in backend.option_names() else None
    return check_borrowed(backend, model=model, dtype=dtype, device=placed, options=options, lora=lora)
