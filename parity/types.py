"""The contracts every part of parity speaks: `SamplingParams`, `Request`, `Rollout`, and the
(prompt_ids, response_ids) pairs every scoring entry point takes (`as_pairs`).

`top_k=0` means "off" everywhere in parity; each backend adapter translates it to its own
spelling. Every field is sent to every backend explicitly, because backend defaults differ
(`max_tokens` defaults to 16 in vLLM, 128 in SGLang, 32 in TRT-LLM).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parity.errors import ConfigError, InputError
from parity.schema import LOGPROBS_MODES, LogprobsMode


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    n: samples per prompt (GRPO groups use n >= 4).
    temperature: softmax temperature; 0 means greedy (argmax).
    top_p: nucleus mass in (0, 1]; 1 is off.
    top_k: keep the k most likely tokens; 0 is off (parity's one spelling of "off").
    max_tokens: most tokens to generate per sample (>= 1).
    seed: request seed; sample i of the request draws its noise from (seed, i, position), so a
        request's tokens never depend on what else shares the batch.
    stop_token_ids: generation stops after any of these (the stop token is kept).
    ignore_eos: keep generating past EOS until `max_tokens`; explicit `stop_token_ids` still stop
        (vLLM's meaning).
    logprobs_mode: "processed" = log-probs of the distribution actually sampled from (after
        temperature, top-k, top-p, renormalized; what an importance ratio needs); "raw" =
        log_softmax of the unmodified logits.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs_mode: LogprobsMode = "processed"

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"sampling.n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise ConfigError(
                f"sampling.temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"sampling.top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(
                f"sampling.top_k must be an integer >= 0 (0 = off; parity translates -1 for you), "
                f"got {self.top_k!r}"
            )
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"sampling.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"sampling.seed must be an integer >= 0, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(
                f"sampling.logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}"
            )

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(
                f"unknown sampling field(s) {sorted(unknown)}; allowed: {sorted(known)}"
            )
        return cls(**{**d, "stop_token_ids": tuple(d.get("stop_token_ids", ()))})


@dataclass(frozen=True)
class Request:
    """One prompt to sample: token ids, sampling parameters and an id unique in its batch."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = "0"

    def __post_init__(self) -> None:
        ids = tuple(int(t) for t in self.prompt_ids)
        if not ids:
            raise InputError(f"request {self.request_id!r}: prompt_ids is empty; give at least one token id")
        if min(ids) < 0:
            raise InputError(f"request {self.request_id!r}: prompt_ids contains a negative token id")
        object.__setattr__(self, "prompt_ids", ids)
        object.__setattr__(self, "request_id", str(self.request_id))
        if not isinstance(self.sampling, SamplingParams):
            raise ConfigError(
                f"request {self.request_id!r}: sampling must be a parity.SamplingParams, "
                f"got {type(self.sampling).__name__}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "prompt_ids": list(self.prompt_ids),
                "sampling": self.sampling.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Request:
        return cls(prompt_ids=tuple(d["prompt_ids"]), sampling=SamplingParams.from_dict(d["sampling"]),
                   request_id=str(d["request_id"]))


@dataclass(frozen=True)
class Rollout:
    """One sampled response in parity's normalized form.

    logprobs: one float per generated token, in `logprobs_mode`.
    routed_experts: optional int32 array `[len(prompt_ids) + len(token_ids) - 1, moe_layers,
        top_k]`: the experts chosen for every position whose output was computed (the layout of
        vLLM, SGLang and verl's R3).
    finish_reason: "stop" (a stop token) or "length" (max_tokens reached).
    meta: backend settings that affect numerics (version, dtype, attention backend, ...).
    sampling: the parameters the rollout was drawn with (its request's `SamplingParams`), so the
        training forward scores it under the distribution it was sampled from. Rollouts ingested
        from a dump know only the logprob-defining fields (temperature, top_k, top_p,
        logprobs_mode); the others are defaults. None when unknown (records written before
        rollouts carried it): such a rollout in processed mode cannot be scored until its
        parameters are given.
    """

    request_id: str
    sample_index: int
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    backend: str
    logprobs_mode: LogprobsMode = "processed"
    routed_experts: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    sampling: SamplingParams | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        object.__setattr__(self, "logprobs", tuple(float(x) for x in self.logprobs))
        if len(self.logprobs) != len(self.token_ids):
            raise InputError(
                f"rollout {self.request_id!r}/{self.sample_index}: {len(self.token_ids)} token_ids "
                f"but {len(self.logprobs)} logprobs; give one logprob per generated token"
            )
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise InputError(
                f"rollout {self.request_id!r}: logprobs_mode must be one of {LOGPROBS_MODES}, "
                f"got {self.logprobs_mode!r}"
            )
        if self.routed_experts is not None:
            routes = np.asarray(self.routed_experts)
            if routes.ndim != 3 or not np.issubdtype(routes.dtype, np.integer):
                raise InputError(
                    f"rollout {self.request_id!r}: routed_experts must be an integer array "
                    f"[len(prompt)+len(tokens)-1, moe_layers, top_k], got shape {routes.shape} "
                    f"dtype {routes.dtype}"
                )
            want = len(self.prompt_ids) + len(self.token_ids) - 1
            if routes.shape[0] != want:
                raise InputError(
                    f"rollout {self.request_id!r}: routed_experts has {routes.shape[0]} positions, "
                    f"expected len(prompt)+len(tokens)-1 = {want}"
                )
            object.__setattr__(self, "routed_experts", routes.astype(np.int32, copy=False))
        if self.sampling is not None:
            if not isinstance(self.sampling, SamplingParams):
                raise InputError(f"rollout {self.request_id!r}: sampling must be a parity.SamplingParams or "
                                 f"None, got {type(self.sampling).__name__}")
            if self.sampling.logprobs_mode != self.logprobs_mode:
                raise InputError(
                    f"rollout {self.request_id!r}/{self.sample_index}: logprobs_mode {self.logprobs_mode!r} "
                    f"but its sampling says {self.sampling.logprobs_mode!r}; they name the same quantity "
                    "and must agree")

    @property
    def key(self) -> tuple[str, int]:
        """(request_id, sample_index): identifies a rollout across backends."""
        return (self.request_id, self.sample_index)

    def to_dict(self) -> dict[str, Any]:
        d = {
            "request_id": self.request_id, "sample_index": self.sample_index,
            "prompt_ids": list(self.prompt_ids), "token_ids": list(self.token_ids),
            "logprobs": list(self.logprobs), "finish_reason": self.finish_reason,
            "backend": self.backend, "logprobs_mode": self.logprobs_mode, "meta": self.meta,
        }
        if self.routed_experts is not None:
            d["routed_experts"] = self.routed_experts.tolist()
        if self.sampling is not None:
            d["sampling"] = self.sampling.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Rollout:
        routes = d.get("routed_experts")
        sampling = d.get("sampling")
        return cls(
            request_id=str(d["request_id"]), sample_index=int(d["sample_index"]),
            prompt_ids=tuple(d["prompt_ids"]), token_ids=tuple(d["token_ids"]),
            logprobs=tuple(d["logprobs"]), finish_reason=d["finish_reason"], backend=d["backend"],
            logprobs_mode=d.get("logprobs_mode", "processed"),
            routed_experts=None if routes is None else np.asarray(routes, dtype=np.int32),
            meta=dict(d.get("meta", {})),
            sampling=None if sampling is None else SamplingParams.from_dict(sampling),
        )


#: one sequence to score: (prompt token ids, response token ids).
Pair = tuple[tuple[int, ...], tuple[int, ...]]
#: what every scoring entry point takes (`train_forward`, `Backend.score`, attribution):
#: Rollouts or (prompt_ids, response_ids) pairs, freely mixed.
Sequences = Sequence[Rollout | tuple[Sequence[int], Sequence[int]]]


def as_pairs(sequences: Sequences) -> list[Pair]:
    """Rollouts or (prompt_ids, response_ids) pairs -> (prompt, response) tuples of ints.

    Every prompt must hold at least one token and every id must be >= 0; whether an id fits a
    model's vocabulary is the model's check. An empty list gives an empty list.
    """
    if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Sequence):
        raise InputError(f"sequences must be a list of parity.Rollout or (prompt_ids, response_ids) pairs, "
                         f"got {type(sequences).__name__}")
    pairs = []
    for i, item in enumerate(sequences):
        if isinstance(item, Rollout):
            pair = (item.prompt_ids, item.token_ids)
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            pair = (tuple(int(t) for t in item[0]), tuple(int(t) for t in item[1]))
        else:
            raise InputError(f"sequences[{i}] must be a parity.Rollout or a (prompt_ids, response_ids) "
                             f"pair, got {type(item).__name__}")
        if not pair[0]:
            raise InputError(f"sequences[{i}]: prompt_ids is empty; give at least one prompt token")
        if min(pair[0] + pair[1]) < 0:
            raise InputError(f"sequences[{i}] contains a negative token id")
        pairs.append(pair)
    return pairs
