"""The wire of vLLM's OpenAI-compatible server: a sample as a `/v1/completions` body, and its answers
(tokens, logprobs, top-k, routes, cached tokens, prompt logprobs) back in parity's form."""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from parity.backends.base import SampleJob, TopKRows
from parity.backends.http import HttpClient
from parity.backends.vllm_requests import translate_sampling
from parity.core.errors import BackendError, ConfigError

#: vLLM clamps reported logprobs to this value (serving_completion); it stands for -inf.
VLLM_LOGPROB_FLOOR = -9999.0
#: neutral values of the server-side sampling knobs parity has no field for.
NEUTRAL_SAMPLING = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0}


def completion_body(job: SampleJob, eos_ids: Sequence[int], model: str) -> dict[str, Any]:
    """One sample -> a `/v1/completions` JSON body (the offline adapter's translation, plus the
    fields a server needs)."""
    params = translate_sampling(job, eos_ids)
    params.pop("detokenize")
    return {"model": model, "prompt": list(job.request.prompt_ids), **params, **NEUTRAL_SAMPLING,
            "return_token_ids": True, "return_tokens_as_token_ids": True}


def unclamp(logprob: float) -> float:
    """The server's -9999.0 floor back to -inf (what the offline engine reports)."""
    return float("-inf") if logprob <= VLLM_LOGPROB_FLOOR else float(logprob)


def wire_token_id(token: object) -> int:
    """A token as the server names it with `return_tokens_as_token_ids` ("token_id:N") -> N; BackendError
    for a token given as text (a server that ignored the flag)."""
    text = str(token).removeprefix("token_id:")
    if not text.isdecimal():
        raise BackendError(f"vLLM server named a token {token!r}, not \"token_id:N\": it ignored "
                           "return_tokens_as_token_ids (is it an OpenAI-compatible vLLM server?)")
    return int(text)


def parse_completion(answer: dict[str, Any]) -> tuple[list[int], list[float], str | None, np.ndarray | None]:
    """A `/v1/completions` answer with one choice -> (token ids, logprobs, finish reason, routes);
    the ids the logprobs name ("token_id:N") must be the returned ones. Routes: vLLM's base64 `.npy`."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not choices or len(choices) != 1:
        raise BackendError(f"vLLM server answer has {len(choices or [])} choices; expected 1")
    choice = choices[0]
    tokens, logprobs = choice.get("token_ids"), choice.get("logprobs")
    if tokens is None or not isinstance(logprobs, dict):
        raise BackendError("vLLM server answer has no token_ids or logprobs; the server ignored "
                           "return_token_ids / logprobs (is it an OpenAI-compatible vLLM server?)")
    named = [wire_token_id(t) for t in logprobs.get("tokens", [])]
    if named != list(tokens):
        raise BackendError(f"vLLM server logprobs name tokens {named} but token_ids are {tokens}")
    values = [unclamp(v) for v in logprobs.get("token_logprobs", [])]
    if len(values) != len(tokens):
        raise BackendError(f"vLLM server returned {len(values)} logprobs for {len(tokens)} tokens")
    routes = choice.get("routed_experts")
    if routes is not None:
        routes = np.load(io.BytesIO(base64.b64decode(routes)), allow_pickle=False)
    return [int(t) for t in tokens], values, choice.get("finish_reason"), routes


def top_k_rows(answer: dict[str, Any], tokens: Sequence[int], k: int) -> TopKRows | None:
    """The `top_logprobs` of a `/v1/completions` answer -> parity's top-k rows (as `top_k_of` gives
    them); None for k = 0.

    vLLM lists the sampled token first, then the top-k: k + 1 entries exactly when the sampled token
    is not among the engine's top-k (dropped here, whatever its value: a sampled token that ties the
    k-th but was not picked is outside, as the offline engine's rank, the count of logprobs >= its
    own, says).
    """
    if not k:
        return None
    positions = answer["choices"][0].get("logprobs", {}).get("top_logprobs")
    if not isinstance(positions, list) or len(positions) != len(tokens):
        raise BackendError(f"vLLM server answer has top_logprobs for {len(positions or [])} of {len(tokens)} "
                           f"tokens; asked for logprobs={k} (is it an OpenAI-compatible vLLM server?)")
    ids, values = [], []
    for token, entries in zip(tokens, positions):
        items = [(wire_token_id(t), unclamp(v)) for t, v in (entries or {}).items()]
        if not items or items[0][0] != token or len(items) > k + 1:
            raise BackendError(f"vLLM server top_logprobs for token {token} are not that token and then the "
                               f"top-{k} ({len(items)} entries, first {items[:1]})")
        if len(items) > k:  # the sampled token is not among the top-k
            if items[0][1] > min(v for _, v in items[1:]):
                raise BackendError(f"vLLM server top_logprobs list token {token} outside the top-{k} but "
                                   f"more likely than one inside ({items})")
            items = items[1:]
        order = sorted(range(len(items)), key=lambda i: (-items[i][1], i))
        ids.append([items[i][0] for i in order])
        values.append([items[i][1] for i in order])
    return ids, values


def cached_tokens(answer: dict[str, Any]) -> int | None:
    """Prompt tokens the prefix cache served for a `/v1/completions` answer; None when the server does
    not report them (started without `--enable-prompt-tokens-details`)."""
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    value = details.get("cached_tokens")
    return None if value is None else int(value)


class PromptRow(dict[int, float]):
    """{token id: logprob} of one prompt position; a token it lacks is a BackendError naming the position
    (a bare KeyError would name neither the server nor where)."""

    def __init__(self, entries: dict[int, float], position: int) -> None:
        super().__init__(entries)
        self.position = position

    def __missing__(self, token: int) -> float:
        raise BackendError(f"vLLM server prompt_logprobs at position {self.position} hold no logprob for "
                           f"token {token} ({len(self)} entries: {sorted(self)[:5]}); the scored sequence's "
                           "token must be among them (is it an OpenAI-compatible vLLM server?)")


def prompt_logprob_rows(answer: dict[str, Any], n_prompt: int) -> list[dict[int, float]]:
    """`prompt_logprobs` of a scoring answer from position `n_prompt` on: {token id: logprob} per position
    (a `PromptRow`: looking up a token it lacks is a BackendError naming the position)."""
    rows = answer["choices"][0].get("prompt_logprobs")
    if rows is None:
        raise BackendError("vLLM server answer has no prompt_logprobs")
    out: list[dict[int, float]] = []
    for position, row in enumerate(rows[n_prompt:], start=n_prompt):
        entries = row.values() if isinstance(row, dict) else [None]
        if not all(isinstance(e, dict) and isinstance(e.get("logprob"), (int, float)) for e in entries):
            raise BackendError(f"vLLM server prompt_logprobs at position {position} are not "
                               f"{{token id: {{logprob: ...}}}} entries: {row!r:.80}")
        out.append(PromptRow({int(tok): unclamp(entry["logprob"]) for tok, entry in row.items()}, position))
    return out


def probe_logprobs_mode(client: HttpClient, model: str, token: int) -> str:
    """The server's logprob definition from its answers: "processed_logprobs" or "raw_logprobs".

    With top_k=1 a processed logprob is exactly 0 (a point mass); a raw one equals the (raw) prompt
    logprob of the same token. A raw logprob of 0 too (a model all but certain of that token) tells
    neither: refused, not read as processed. `token`: any valid prompt token.
    """
    base = {"model": model, "max_tokens": 1, "temperature": 1.0, "top_k": 1, "seed": 0, "logprobs": 0,
            "return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True}
    tokens, values, _, _ = parse_completion(client.post("/v1/completions", {**base, "prompt": [token]}))
    scored = client.post("/v1/completions", {**base, "prompt": [token, tokens[0]], "temperature": 0.0,
                                             "prompt_logprobs": 0})
    raw = prompt_logprob_rows(scored, 1)[0][tokens[0]]
    as_raw = abs(raw - values[0]) <= 1e-3
    if values[0] == 0.0 and as_raw:
        raise ConfigError(f"the server at {client.endpoint.public} gives token {tokens[0]} after token "
                          f"{token} a raw logprob of {raw:.3g}, as near 0 as a processed one under top_k=1: "
                          "its logprob mode cannot be told apart this way; start it with "
                          "VLLM_SERVER_DEV_MODE=1 (its /server_info shows --logprobs-mode)")
    if values[0] == 0.0:
        return "processed_logprobs"
    if as_raw:
        return "raw_logprobs"
    raise ConfigError(f"the server at {client.endpoint.public} reports neither processed nor raw logprobs "
                      "(a logits mode?); start it with --logprobs-mode processed_logprobs")
