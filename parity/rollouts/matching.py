"""Rollouts checked against the requests they answer: one sample per (request, sample index), the
asked logprob mode, the request's prompt, at most its `max_tokens`, its sampling carried on.
A backend that repeats, drops or invents samples would otherwise skew every metric silently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from parity.core.errors import BackendError, InputError, ParityError
from parity.core.turns import Inject
from parity.core.types import Request, Rollout
from parity.models.limits import ModelLimits
from parity.rollouts.dumps import check_logprobs


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


def match_requests(rollouts: Sequence[Rollout], requests: Sequence[Request], *,
                   limits: ModelLimits | None = None) -> list[Rollout]:
    """`rollouts`, each checked against its request (`check_answer`) and carrying its sampling; a
    different logprobs mode would be a different quantity.
    """
    by_id = requests_by_id(requests)
    check_unique_keys(rollouts)
    out = []
    for ro in rollouts:
        if ro.request_id not in by_id:
            raise InputError(f"rollout {ro.request_id!r}/{ro.sample_index} matches no request of the case")
        check_answer(ro, by_id[ro.request_id], limits)
        check_sampled_as_asked(ro, by_id[ro.request_id])
        s = by_id[ro.request_id].sampling
        out.append(ro if ro.sampling is not None else dataclasses.replace(ro, sampling=s))
    return out


def check_sampled_as_asked(rollout: Rollout, request: Request) -> None:
    """InputError unless `rollout` holds logprobs of the kind `request` asked for: its logprobs mode,
    and (when the rollout records its own sampling) the same temperature, top_k and top_p, which
    processed logprobs depend on. A rollout is scored under its own sampling, so one that
    contradicts its request would be judged under a distribution nobody can say was used."""
    s = request.sampling
    who = f"rollout {rollout.request_id!r}/{rollout.sample_index} from backend {rollout.backend!r}"
    if rollout.logprobs_mode != s.logprobs_mode:
        raise InputError(
            f"{who} has logprobs_mode {rollout.logprobs_mode!r} but its request asked for "
            f"{s.logprobs_mode!r}; logprobs in different modes are different quantities and cannot be "
            "compared"
        )
    mine = rollout.sampling
    if mine is not None and (mine.temperature, mine.top_k, mine.top_p) != (s.temperature, s.top_k, s.top_p):
        raise InputError(
            f"{who} records sampling temperature={mine.temperature}, top_k={mine.top_k}, top_p={mine.top_p} "
            f"but its request asked for temperature={s.temperature}, top_k={s.top_k}, top_p={s.top_p}; "
            "which one the logprobs were drawn under cannot be told: fix the rollout's sampling or drop it "
            "(a rollout without sampling takes its request's)"
        )


def check_unique_keys(rollouts: Sequence[Rollout]) -> None:
    """InputError when a (request_id, sample_index) repeats: a repeated sample would count twice in
    every mean."""
    seen: set[tuple[str, int]] = set()
    for ro in rollouts:
        if ro.key in seen:
            raise InputError(f"rollout {ro.key} appears more than once; each (request_id, sample_index) "
                             "is one sample")
        seen.add(ro.key)


def check_answer(rollout: Rollout, request: Request, limits: ModelLimits | None = None, *,
                 error: type[ParityError] = BackendError) -> None:
    """`error` naming the request unless `rollout` could answer it: its prompt, at most `max_tokens`
    tokens, ids in the vocabulary (`limits`), logprobs that are log-probabilities.
    """
    who = (f"backend {rollout.backend!r} answered request {rollout.request_id!r} "
           f"(sample {rollout.sample_index})")
    if rollout.prompt_ids != request.prompt_ids:
        raise error(f"{who} for a prompt of {len(rollout.prompt_ids)} tokens that is not the request's "
                    f"({len(request.prompt_ids)} tokens); its rollout cannot be scored as an answer")
    injects = any(isinstance(t, Inject) for t in request.turns)
    if injects and rollout.response_mask is None:
        raise error(f"{who} without a response_mask, but the request's turns inject tokens; without the mask "
                    "the injected tokens would be scored as sampled ones: give response_mask (1 generated, "
                    "0 injected)")
    if not injects and rollout.response_mask is not None and 0 in rollout.response_mask:
        raise error(f"{who} with a response_mask that marks a token injected (0), but the request injects "
                    "nothing (no inject or tool turn), so every response token was sampled; give an all-1 "
                    "response_mask or none")
    if len(rollout.token_ids) > request.sampling.max_tokens:
        raise error(f"{who} with {len(rollout.token_ids)} tokens, more than its max_tokens="
                    f"{request.sampling.max_tokens}")
    problem = None if limits is None else limits.vocabulary_problem(rollout.token_ids)
    if problem is not None:
        raise error(f"{who} with a response that {problem}")
    try:
        check_logprobs(rollout.logprobs, where=f"{who}: ")
    except InputError as e:
        raise error(str(e)) from e
