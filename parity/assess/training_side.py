"""The training side of a comparison, for rollouts from anywhere (`compare`, `parity score`): score
them with the training forward (or take the trainer's own logprobs), run the gold forward where
asked or cheap, build the report with decoded text, and add the router section and attribution.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from parity.advisor import DATA_BUGS
from parity.assess.distribution import check_rollout_top_k, distribution_section, has_top_k, shown_ids
from parity.assess.mismatch import sampling_findings
from parity.assess.reporting import build_report
from parity.core.errors import ConfigError, InputError
from parity.core.schema import NO_REPLAY, ROUTER_SUMMARY_KEYS
from parity.core.types import Rollout
from parity.drift.distribution import TrainerView
from parity.drift.routes import router_agreement
from parity.drift.tolerance import Tolerance
from parity.models import model_limits, parameter_count, resolve_model
from parity.report.document import ParityReport
from parity.report.text import report_text


def report_for(model: str | None, rollouts: Sequence[Rollout], *, dtype: str, device: str, reference: str,
               router_replay: str | None, tolerance: Tolerance, provenance: dict[str, Any],
               correction: dict[str, Any] | None = None, attribute: Sequence[str] = (),
               train_logprobs: Sequence[np.ndarray] | None = None,
               tensor_parallel_size: int | None = None,
               reduction_groups: int | None = None, gold: bool | None = None,
               elapsed: float = 0.0, lora: str | os.PathLike[str] | None = None) -> ParityReport:
    """The second half of a comparison: score the rollouts (or take `train_logprobs`, running no
    forward), build the report with decoded text, add router agreement and attribution.

    model: None only with `train_logprobs` and no `attribute`. tensor_parallel_size,
    reduction_groups: the training layout (None: as recorded). gold: True, False or None (run when
    cheap; `elapsed` seconds so far count). lora: for rollouts that record none.
    """
    check_gold(gold)
    if model is None and (train_logprobs is None or attribute or gold):
        raise ConfigError("a model is needed to run the training forward (and the gold forward); "
                          "pass model=")
    if attribute and (lora is not None or any("lora" in r.meta for r in rollouts)):
        raise ConfigError("attribute does not run with a LoRA adapter yet; drop attribute (--attribute) or "
                          "the adapter")
    start = time.perf_counter()
    top_k = has_top_k(rollouts)
    if top_k:  # refused before any forward: ids outside the vocabulary, mixed k
        check_rollout_top_k(rollouts, None if model is None else model_limits(model).vocab_size)
    views = None
    if train_logprobs is None:
        train_logprobs, views = score_with_views(
            model, rollouts, dtype=dtype, device=device, kernels=reference, router_replay=router_replay,
            tensor_parallel_size=tensor_parallel_size, reduction_groups=reduction_groups, lora=lora,
            distribution=top_k)
        computed = True
    else:
        computed = False
    bugs = sampling_findings(model, rollouts, train_logprobs, dtype=dtype, device=device, kernels=reference,
                             tensor_parallel_size=tensor_parallel_size, reduction_groups=reduction_groups,
                             router_replay=router_replay, lora=lora) if computed else []
    gold_lp, gold_how = gold_side(model, rollouts, gold=gold, device=device,
                                  row_seconds=elapsed + time.perf_counter() - start, lora=lora)
    extras: dict[str, Any] = {"gold": gold_how, **({DATA_BUGS: bugs} if bugs else {})}
    report = build_report(rollouts, train_logprobs, tolerance=tolerance, provenance=provenance,
                          correction=correction, gold_logprobs=gold_lp, extras=extras)
    if views is not None:
        distribution_summary, report.extras["distribution"] = distribution_section(rollouts, views)
        report.summary.update(distribution_summary)
    text = None if model is None else report_text(
        model, rollouts, extra_ids=shown_ids(report.extras["distribution"]) if views is not None else ())
    if text is not None:
        report.extras["text"] = text  # decoded now, so a stored report shows text without a tokenizer
    if computed and rollouts and all(r.routed_experts is not None for r in rollouts):
        # MoE rollouts that carry routes: router agreement, and drift with and without replay.
        router_summary, report.extras["router"] = router_report(
            model, rollouts, dtype=dtype, device=device, kernels=reference, router_replay=router_replay,
            tolerance=tolerance, tensor_parallel_size=tensor_parallel_size, reduction_groups=reduction_groups,
            lora=lora)
        report.summary.update(router_summary)
    if attribute:
        from parity.attribute import attribution_section  # torch: `import parity` stays light

        report.extras["attribution"] = attribution_section(model, rollouts, axes=attribute,
                                                           dtype=dtype, device=device)
    return report


def check_gold(gold: object) -> None:
    """ConfigError unless `gold` is True, False or None (checked before an engine starts)."""
    if gold is not None and not isinstance(gold, bool):
        raise ConfigError(f"gold must be True, False or None (None: run it when cheap next to the row), "
                          f"got {gold!r}")


def gold_side(model: str | None, rollouts: Sequence[Rollout], *, gold: bool | None, device: str,
              row_seconds: float, lora: str | os.PathLike[str] | None = None
              ) -> tuple[list[np.ndarray] | None, dict[str, Any]]:
    """The gold forward's logprobs of every response token (None when it does not run) and how it went,
    for `extras["gold"]`: ran, reason (`parity.engine.gold.decide`), dtype, device, seconds.
    """
    if gold is False or model is None:
        return None, {"ran": False, "reason": "gold=False was asked for" if gold is False
                      else "no model to run it (the trainer's logprobs were given)"}
    unrecorded = next((r for r in rollouts if r.logprobs_mode == "processed" and r.sampling is None), None)
    if unrecorded is not None:  # only with the trainer's logprobs: the training forward refuses it first
        where = f"rollout {unrecorded.request_id!r}/{unrecorded.sample_index} has processed logprobs but " \
                "records no sampling"
        if gold:
            raise InputError(f"gold=True: {where}, which the gold forward scores under; give the sampling "
                             "(sampling=; parity score: --temperature, --top-k, --top-p) or drop gold=True "
                             "(--no-gold)")
        return None, {"ran": False, "reason": f"by default: not run: {where}, which the gold forward scores "
                      "under (give the sampling, --temperature/--top-k/--top-p, to run it)"}
    from parity.engine.gold import decide, gold_dtype, gold_logprobs  # torch: `import parity` stays light

    tokens = sum(len(r.prompt_ids) + len(r.token_ids) for r in rollouts)
    plan = decide(gold, parameters=parameter_count(resolve_model(model)), tokens=tokens,
                  row_seconds=row_seconds, device=device)
    how: dict[str, Any] = {"ran": plan.run, "reason": plan.reason,
                           "estimated_seconds": round(plan.estimated_seconds, 4),
                           "row_seconds": round(plan.row_seconds, 4)}
    if not plan.run:
        return None, how
    start = time.perf_counter()
    logprobs = gold_logprobs(model, rollouts, device=device, lora=lora)
    how.update(dtype=gold_dtype(device), device=device,
               seconds=round(time.perf_counter() - start, 4))
    return logprobs, how


def score_rollouts(model: str | os.PathLike[str], rollouts: Sequence[Rollout], *, dtype: str,
                   device: str = "cpu", kernels: str = "invariant",
                   router_replay: str | None = None,
                   tensor_parallel_size: int | None = None,
                   reduction_groups: int | None = None,
                   lora: str | os.PathLike[str] | None = None) -> list[np.ndarray]:
    """Training-forward logprobs of every rollout's response tokens, float32 `[response_len]` each,
    each rollout scored under the sampling it records (mode, temperature, top-k, top-p) and with the
    LoRA adapter it records (else `lora`)."""
    return score_with_views(model, rollouts, dtype=dtype, device=device, kernels=kernels,
                            router_replay=router_replay, tensor_parallel_size=tensor_parallel_size,
                            reduction_groups=reduction_groups, lora=lora)[0]


def score_with_views(model: str | os.PathLike[str], rollouts: Sequence[Rollout], *, dtype: str, device: str,
                     kernels: str, router_replay: str | None, tensor_parallel_size: int | None,
                     reduction_groups: int | None, lora: str | os.PathLike[str] | None,
                     distribution: bool = False) -> tuple[list[np.ndarray], list[TrainerView] | None]:
    """`score_rollouts`, and with `distribution` the trainer's views against each rollout's top-k
    (`train_forward(distribution=True)`; None without)."""
    from parity.engine import train_forward  # torch: `import parity` stays light

    scored = train_forward(model, list(rollouts), dtype=dtype, device=device, kernels=kernels,
                           tensor_parallel_size=tensor_parallel_size, reduction_groups=reduction_groups,
                           lora=lora, distribution=distribution, **router_replay_options(router_replay))
    return [lp.detach().to("cpu").float().numpy() for lp in scored.logprobs], scored.views


def router_replay_options(router_replay: str | None) -> dict[str, Any]:
    """`train_forward` keyword arguments for `router_replay` (validated: a bad mode fails before
    an engine starts); none when it is None or "none" (the spelling of "off" in case files)."""
    from parity.models.routing import RouterReplay  # torch: `import parity` stays light

    return {} if RouterReplay.of(router_replay) is None else {"router_replay": router_replay}


def router_report(model: str, rollouts: Sequence[Rollout], *, dtype: str, device: str, kernels: str,
                  router_replay: str | None, tolerance: Tolerance, tensor_parallel_size: int | None = None,
                  reduction_groups: int | None = None,
                  lora: str | os.PathLike[str] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(summary, section) of router agreement and IS-ratio drift with and without replay.

    Scores once per side: "none", "R3" and `router_replay` if another mode. `summary`: the
    `ROUTER_SUMMARY_KEYS` of the side `router_replay` selects; `section` (`extras["router"]`): every
    side's agreement and drift summary.
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
            router_replay=main if name == main_name else RouterReplay.of(name),
            tensor_parallel_size=tensor_parallel_size, reduction_groups=reduction_groups, lora=lora)
        drift = build_report(rollouts, [lp.numpy() for lp in scored.logprobs], tolerance=tolerance).summary
        sides[name] = {**router_agreement(rollout_routes, scored.routes), "drift": drift}
    summary = {k: sides[main_name][k] for k in ROUTER_SUMMARY_KEYS}
    return summary, {"replay": main_name, "sides": sides}
