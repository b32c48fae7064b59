"""parity's samples into vLLM's `SamplingParams`, and vLLM's top-k and routes back into parity's
form: the translation the offline and the server adapter share."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from parity.backends.base import SampleJob, TopKRows, stop_set
from parity.core.errors import BackendError, ConfigError
from parity.core.types import Request, Rollout

#: vLLM rejects temperatures above this (SamplingParams._verify_args).
VLLM_MAX_TEMPERATURE = 2.0
#: vLLM raises a temperature in (0, this) to this, with only a log line (SamplingParams.__post_init__,
#: `_MAX_TEMP`): it would sample, and report processed logprobs, at another temperature than asked.
VLLM_MIN_TEMPERATURE = 0.01
#: the finish reasons of a sample that ran as asked (to a stop id or its length); vLLM's others ("abort":
#: a client or `/pause`, "error", "repetition") end it early, at a point no parity sampling chose.
FINISHED_AS_ASKED = ("stop", "length")


def translate_sampling(job: SampleJob, eos_ids: Sequence[int]) -> dict[str, Any]:
    """parity sampling for one sample -> keyword arguments of `vllm.SamplingParams`; stop ids carry
    EOS explicitly (with `skip_tokenizer_init` vLLM has no tokenizer to read it from)."""
    sp = job.sampling
    if sp.temperature > VLLM_MAX_TEMPERATURE:
        raise ConfigError(f"request {job.request.request_id!r}: sampling.temperature={sp.temperature} "
                          f"is above vLLM's limit of {VLLM_MAX_TEMPERATURE}; use a lower temperature")
    if 0 < sp.temperature < VLLM_MIN_TEMPERATURE:
        raise ConfigError(f"request {job.request.request_id!r}: sampling.temperature={sp.temperature} is "
                          f"below {VLLM_MIN_TEMPERATURE}, which vLLM silently raises to "
                          f"{VLLM_MIN_TEMPERATURE} (it would sample at another temperature than asked); use "
                          f"temperature=0 (greedy) or at least {VLLM_MIN_TEMPERATURE}")
    return {
        "n": 1, "temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k,
        "max_tokens": sp.max_tokens, "min_tokens": 0, "seed": job.seed,
        "stop_token_ids": list(stop_set(sp, eos_ids)), "ignore_eos": sp.ignore_eos,
        "logprobs": sp.top_k_logprobs, "detokenize": False, "skip_special_tokens": False,
    }


def check_vllm_requests(requests: Sequence[Request], logprobs_mode: str, backend: str) -> None:
    """ConfigError for a request a vLLM engine reporting `logprobs_mode` would refuse or run otherwise
    than asked, before it starts: the engine-wide logprob mode, `translate_sampling`'s refusals. Per
    request, not per sample or turn: what is checked is the same for each of them."""
    for request in requests:
        mode = request.sampling.logprobs_mode
        if mode != logprobs_mode:
            raise ConfigError(
                f"request {request.request_id!r} asks for logprobs_mode={mode!r} but backend {backend!r} "
                f"is started with logprobs_mode={logprobs_mode!r} (one mode per engine); start it with "
                f"logprobs_mode={mode!r} (--option logprobs_mode={mode})")
        translate_sampling(SampleJob(request, 0, request.sampling.seed), ())


def check_finish(reason: object, job: SampleJob, n_tokens: int, backend: str) -> None:
    """BackendError for a sample vLLM cut short ("abort", "error"...): its tokens would pass for a sample
    that ran to its length (parity's finish reason reads the stop set only)."""
    if reason is not None and str(reason) not in FINISHED_AS_ASKED:
        raise BackendError(f"{backend} ended sample {job.request.request_id!r}/{job.sample_index} with "
                           f"finish_reason {str(reason)!r} after {n_tokens} tokens (an abort, e.g. a /pause "
                           "of the server, or an engine error): not a sample to a stop id or max_tokens; "
                           "run it again while nothing else pauses or aborts the engine's requests")


def check_sample(reason: object, job: SampleJob, tokens: Sequence[int], eos_ids: Sequence[int],
                 backend: str) -> None:
    """`check_finish`, then BackendError for a sample whose stops disagree with the stop set parity sent
    (no min_tokens, no stop strings): a stop id before its last token (the engine sampled past a stop,
    or its ids are shifted), or finish_reason "stop" on a last token outside the set (parity would
    record "length")."""
    check_finish(reason, job, len(tokens), backend)
    stops = stop_set(job.sampling, eos_ids)
    where = f"{backend} sample {job.request.request_id!r}/{job.sample_index}"
    early = next((i for i, token in enumerate(tokens[:-1]) if token in stops), None)
    if early is not None:
        raise BackendError(f"{where} holds stop id {tokens[early]} at position {early} of its {len(tokens)} "
                           f"tokens (stop set {list(stops)}): the engine sampled past a stop parity sent, or "
                           "its token ids are misaligned; its later tokens answer no parity sampling")
    if str(reason) == "stop" and (not tokens or tokens[-1] not in stops):
        last = tokens[-1] if tokens else None
        raise BackendError(f"{where} ended with finish_reason 'stop' on token {last}, which is not in the "
                           f"stop set parity sent {list(stops)} (the server stops on an id parity does not "
                           "know, e.g. its tokenizer's eos or a stop string); parity would record it as "
                           "'length': add that id to sampling.stop_token_ids")


def check_scored(scored: int, response: int, backend: str) -> None:
    """BackendError unless `prompt_logprobs` covered every response token (zip would drop the rest)."""
    if scored != response:
        raise BackendError(f"{backend} returned prompt logprobs for {scored} of {response} response tokens")


def top_k_of(steps: Sequence[dict[int, Any]], k: int) -> TopKRows | None:
    """vLLM's per-step {token id: Logprob} dicts -> parity's top-k rows (the entries of rank <= k, by
    rank; the sampled token is listed too when it ranks lower); None for k = 0."""
    if not k:
        return None
    rows = [sorted((entry.rank, token, entry.logprob) for token, entry in step.items() if entry.rank <= k)
            for step in steps]
    return [[t for _, t, _ in row] for row in rows], [[lp for _, _, lp in row] for row in rows]


def routes_for_rollout(routes: np.ndarray | None, n_prompt: int, n_tokens: int) -> np.ndarray | None:
    """vLLM's `routed_experts` `[positions, layers, top_k]` -> parity's P + T - 1 positions (vLLM
    may add a row for the last sampled token, never fed back)."""
    if routes is None:
        return None
    routes = np.asarray(routes)
    want = n_prompt + n_tokens - 1
    if routes.shape[0] == want + 1:
        routes = routes[:want]
    if routes.shape[0] != want:
        raise BackendError(f"vLLM returned routed_experts for {routes.shape[0]} positions; expected "
                           f"{want} (prompt {n_prompt} + tokens {n_tokens} - 1)")
    return routes.astype(np.int32)


def with_routes(rollouts: list[Rollout], routes: Mapping[int, np.ndarray]) -> list[Rollout]:
    """The rollouts with the routes a probe captured (by sample index) as their `routed_experts`."""
    out = list(rollouts)
    for i, ids in routes.items():
        r = out[i]
        out[i] = dataclasses.replace(r, routed_experts=routes_for_rollout(ids, len(r.prompt_ids),
                                                                          len(r.token_ids)))
    return out
