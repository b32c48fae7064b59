"""The contracts every part of parity speaks: `SamplingParams`, `Request`, `Rollout`, and the
(prompt_ids, response_ids) pairs every scoring entry point takes (`as_pairs`).

`top_k=0` means "off" everywhere. Every field is sent to every backend explicitly, because
defaults differ (`max_tokens` is 16 in vLLM, 128 in SGLang, 32 in TRT-LLM).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parity.core.errors import ConfigError, InputError
from parity.core.schema import LOGPROBS_MODES, LogprobsMode, json_float, json_safe
from parity.core.strict import check_token_ids, from_mapping
from parity.core.top_k import TopKError, check_same_processing, check_top_k
from parity.core.turns import Turn, check_turns, turns_from_dict


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    n: samples per prompt. temperature: 0 is greedy. top_p: in (0, 1], 1 is off. top_k: 0 is off.
    max_tokens: >= 1. seed: sample i draws its noise from (seed, i, position), so its tokens never
    depend on the rest of the batch. stop_token_ids: stop after any (kept). ignore_eos: generate past
    EOS (stop ids still stop; vLLM's meaning).
    logprobs_mode: "processed" = the distribution sampled from (after temperature, top-k, top-p;
    what an importance ratio needs); "raw" = log_softmax of the logits.
    top_k_logprobs: also return the k most likely tokens per position (`Rollout.top_k_ids`); 0 is
    off; written to dicts only when set, so case hashes stay.
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
    top_k_logprobs: int = 0

    def __post_init__(self) -> None:
        # every field is checked for its type too: a TOML string "false" is truthy, `True` is an
        # int and a string is a sequence of characters, and each would silently mean something else
        set_ = object.__setattr__
        set_(self, "n", check_int(self.n, "sampling.n", low=1))
        # floats always: `temperature = 1` and `1.0` are one workload, and must write (and hash) as one;
        # `+ 0.0` makes -0.0 the 0.0 (greedy) it means, so it too writes and hashes as one
        set_(self, "temperature",
             float(check_real(self.temperature, "sampling.temperature", "(0 = greedy)")) + 0.0)
        if self.temperature < 0:
            raise ConfigError(
                f"sampling.temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        set_(self, "top_p", float(check_real(self.top_p, "sampling.top_p", "in (0, 1] (1 = off)")))
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"sampling.top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        set_(self, "top_k", check_int(self.top_k, "sampling.top_k", low=0,
                                    hint="(0 = off; parity translates -1 for you)"))
        set_(self, "max_tokens", check_int(self.max_tokens, "sampling.max_tokens", low=1))
        set_(self, "seed", check_int(self.seed, "sampling.seed", low=0))
        set_(self, "stop_token_ids", check_token_ids(self.stop_token_ids, "sampling.stop_token_ids",
                                                     ConfigError))
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise ConfigError(f"sampling.ignore_eos must be true or false, got {self.ignore_eos!r}")
        set_(self, "ignore_eos", bool(self.ignore_eos))
        if not isinstance(self.logprobs_mode, str) or self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(
                f"sampling.logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}"
            )
        set_(self, "top_k_logprobs", check_int(self.top_k_logprobs, "sampling.top_k_logprobs", low=0,
                                               hint="(0 = off)"))

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        if not self.top_k_logprobs:
            del d["top_k_logprobs"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        return from_mapping(cls, d, where="sampling")

    @property
    def definition(self) -> tuple[float, int, float]:
        """(temperature, top_k, top_p): what processed logprobs depend on (not the seed or lengths)."""
        return (self.temperature, self.top_k, self.top_p)


@dataclass(frozen=True)
class Request:
    """One prompt to sample: token ids, sampling parameters and an id unique in its batch; `turns`
    makes it a multi-turn trajectory (`parity.core.turns`).
    """

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = "0"
    turns: tuple[Turn, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "request_id", check_id(self.request_id, "request_id"))
        ids = check_token_ids(self.prompt_ids, f"request {self.request_id!r}: prompt_ids", InputError)
        if not ids:
            raise InputError(f"request {self.request_id!r}: prompt_ids is empty; give at least one token id")
        object.__setattr__(self, "prompt_ids", ids)
        if not isinstance(self.sampling, SamplingParams):
            raise ConfigError(
                f"request {self.request_id!r}: sampling must be a parity.SamplingParams, "
                f"got {type(self.sampling).__name__}"
            )
        object.__setattr__(self, "turns", check_turns(self.turns, f"request {self.request_id!r}"))

    def to_dict(self) -> dict[str, Any]:
        d = {"request_id": self.request_id, "prompt_ids": list(self.prompt_ids),
             "sampling": self.sampling.to_dict()}
        if self.turns:
            d["turns"] = [t.to_dict() for t in self.turns]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Request:
        """The inverse of `to_dict`; a missing key is an InputError naming it."""
        _require(d, "request", ("request_id", "prompt_ids", "sampling"))
        return cls(prompt_ids=d["prompt_ids"], sampling=SamplingParams.from_dict(d["sampling"]),
                   request_id=d["request_id"], turns=turns_from_dict(d.get("turns", ())))


@dataclass(frozen=True)
class Rollout:
    """One sampled response in parity's normalized form.

    logprobs: one per token, in `logprobs_mode`. response_mask: None for single-turn; else 1 at
    generated, 0 at injected tokens (metrics read mask-1 only).
    routed_experts: int32 `[len(prompt_ids) + len(token_ids) - 1, moe_layers, top_k]` (vLLM, SGLang,
    verl R3 layout). finish_reason: "stop" or "length". meta: backend settings that affect numerics.
    sampling: the `SamplingParams` drawn with, so training scores it under the same distribution;
    dump rollouts know only the logprob-defining fields; None when unknown (a processed-mode rollout
    then cannot be scored until given).
    top_k_ids, top_k_logprobs: both or neither, int64 / float64 `[len(token_ids), k]`, descending.
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
    response_mask: tuple[int, ...] | None = None
    top_k_ids: np.ndarray | None = None
    top_k_logprobs: np.ndarray | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "request_id", check_id(self.request_id, "rollout request_id"))
        where = f"rollout {self.request_id!r}"
        set_(self, "sample_index", check_int(self.sample_index, f"{where}: sample_index", low=0,
                                             error=InputError))
        set_(self, "prompt_ids", check_token_ids(self.prompt_ids, f"{where}: prompt_ids", InputError))
        set_(self, "token_ids", check_token_ids(self.token_ids, f"{where}: token_ids", InputError))
        if isinstance(self.logprobs, (str, bytes)) or not isinstance(self.logprobs, (Sequence, np.ndarray)) \
                or not all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in self.logprobs):
            raise InputError(f"{where}: logprobs must be a list of numbers, got {self.logprobs!r:.80}")
        set_(self, "logprobs", tuple(float(x) for x in self.logprobs))
        for name in ("finish_reason", "backend"):
            if not isinstance(getattr(self, name), str):
                raise InputError(f"{where}: {name} must be a string, got {getattr(self, name)!r}")
        if not isinstance(self.meta, dict):
            raise InputError(f"{where}: meta must be a dict, got {type(self.meta).__name__}")
        if self.response_mask is not None:
            if isinstance(self.response_mask, (str, bytes)) \
                    or not isinstance(self.response_mask, (Sequence, np.ndarray)) \
                    or not all(isinstance(m, (numbers.Integral, np.bool_)) for m in self.response_mask):
                raise InputError(  # 0.5 or "1" would be rounded or parsed into a mask nobody wrote
                    f"{where}/{self.sample_index}: response_mask must be a list of 0s (injected) and 1s "
                    f"(generated), got {self.response_mask!r:.80}")
            mask = tuple(int(m) for m in self.response_mask)
            if len(mask) != len(self.token_ids) or any(m not in (0, 1) for m in mask):
                raise InputError(
                    f"{where}/{self.sample_index}: response_mask must hold one 0 (injected) or 1 "
                    f"(generated) per response token ({len(self.token_ids)}), got {mask!r}")
            set_(self, "response_mask", mask)
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
            try:
                routes = np.asarray(self.routed_experts)
            except ValueError as exc:  # a ragged nested list
                raise InputError(f"rollout {self.request_id!r}: routed_experts is not a rectangular array "
                                 f"({exc})") from exc
            if routes.ndim != 3 or not np.issubdtype(routes.dtype, np.integer):
                raise InputError(
                    f"rollout {self.request_id!r}: routed_experts must be an integer array "
                    f"[len(prompt)+len(tokens)-1, moe_layers, top_k], got shape {routes.shape} "
                    f"dtype {routes.dtype}"
                )
            if routes.size and not 0 <= routes.min() <= routes.max() < 2 ** 31:  # int32 would wrap 2**32 + 1
                bad = routes.min() if routes.min() < 0 else routes.max()  # into expert 1; -1 is no expert
                raise InputError(
                    f"rollout {self.request_id!r}: routed_experts holds expert id {int(bad)}; expert ids are "
                    "the router's top-k indices, from 0 to below 2**31 (vLLM and SGLang record torch.topk's "
                    "ids and pad nothing with -1): record the routes again, or pass the engine's own")
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
        self._check_top_k(where)

    def _check_top_k(self, where: str) -> None:
        where = f"{where}/{self.sample_index}"
        if (self.top_k_ids is None) != (self.top_k_logprobs is None):
            raise TopKError(f"{where}: give top_k_ids and top_k_logprobs together, or neither")
        if self.top_k_ids is None:
            return
        ids, logprobs = check_top_k(self.top_k_ids, self.top_k_logprobs, where, positions=len(self.token_ids))
        generated = np.asarray(self.mask, dtype=bool)
        tokens = np.asarray(self.token_ids, np.int64)
        check_same_processing(ids[generated], logprobs[generated], tokens[generated],
                              np.asarray(self.logprobs)[generated], where)
        object.__setattr__(self, "top_k_ids", ids)
        object.__setattr__(self, "top_k_logprobs", logprobs)

    @property
    def mask(self) -> tuple[int, ...]:
        """1 per generated, 0 per injected response token (all 1 without a response_mask)."""
        return self.response_mask if self.response_mask is not None else (1,) * len(self.token_ids)

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
        if self.response_mask is not None:
            d["response_mask"] = list(self.response_mask)
        if self.top_k_ids is not None:
            d["top_k_ids"] = self.top_k_ids.tolist()
            d["top_k_logprobs"] = json_safe(self.top_k_logprobs.tolist())
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Rollout:
        """The inverse of `to_dict`; a missing key is an InputError naming it."""
        _require(d, "rollout", ("request_id", "sample_index", "prompt_ids", "token_ids", "logprobs",
                                "finish_reason", "backend"))
        sampling = d.get("sampling")
        return cls(
            request_id=d["request_id"], sample_index=d["sample_index"], prompt_ids=d["prompt_ids"],
            token_ids=d["token_ids"], logprobs=_json_logprobs(d["logprobs"]),
            finish_reason=d["finish_reason"],
            backend=d["backend"], logprobs_mode=d.get("logprobs_mode", "processed"),
            routed_experts=d.get("routed_experts"), meta=d.get("meta", {}),
            sampling=None if sampling is None else SamplingParams.from_dict(sampling),
            response_mask=None if d.get("response_mask") is None else tuple(d["response_mask"]),
            top_k_ids=d.get("top_k_ids"), top_k_logprobs=_json_rows(d.get("top_k_logprobs")),
        )


def _json_rows(rows: Any) -> Any:
    return [_json_logprobs(row) for row in rows] if isinstance(rows, list) else rows


def _json_logprobs(values: Any) -> Any:
    """Logprobs read from JSON: the strings parity writes for non-finite floats become floats."""
    return [json_float(v) for v in values] if isinstance(values, list) else values


#: one sequence to score: (prompt token ids, response token ids).
Pair = tuple[tuple[int, ...], tuple[int, ...]]
#: what every scoring entry point takes (`train_forward`, `Backend.score`, attribution):
#: Rollouts or (prompt_ids, response_ids) pairs, freely mixed.
Sequences = Sequence[Rollout | tuple[Sequence[int], Sequence[int]]]


def as_pairs(sequences: Sequences) -> list[Pair]:
    """Rollouts or (prompt_ids, response_ids) pairs -> (prompt, response) tuples of ints; every prompt
    non-empty, every id >= 0.
    """
    if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Sequence):
        raise InputError(f"sequences must be a list of parity.Rollout or (prompt_ids, response_ids) pairs, "
                         f"got {type(sequences).__name__}")
    pairs = []
    for i, item in enumerate(sequences):
        if isinstance(item, Rollout):
            pair = (item.prompt_ids, item.token_ids)
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            pair = (check_token_ids(item[0], f"sequences[{i}] prompt_ids", InputError),
                    check_token_ids(item[1], f"sequences[{i}] response_ids", InputError))
        else:
            raise InputError(f"sequences[{i}] must be a parity.Rollout or a (prompt_ids, response_ids) "
                             f"pair, got {type(item).__name__}")
        if not pair[0]:
            raise InputError(f"sequences[{i}]: prompt_ids is empty; give at least one prompt token")
        pairs.append(pair)
    return pairs


# -- the type checks of every field above ---------------------------------------------------------


def check_int(value: Any, field: str, *, low: int, hint: str = "",
            error: type[ConfigError] | type[InputError] = ConfigError) -> int:
    """`value` as an int if it is an integer (NumPy's too, never a bool) >= `low`, else `error`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise error(f"{field} must be an integer >= {low}{' ' + hint if hint else ''}, got {value!r}")
    return int(value)


def check_real(value: Any, field: str, hint: str) -> float:
    """`value` if it is a finite real number (NumPy's become Python floats; never a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ConfigError(f"{field} must be a finite number {hint}, got {value!r}")
    return value if type(value) in (int, float) else float(value)


def float32_meant(value: Any) -> Any:
    """A float that is exactly a float32 (a float32 Parquet column's, or `np.float32(0.7)`'s,
    0.699999988079071) as the decimal that float32 stands for (0.7): else it is not the 0.7 given or
    recorded elsewhere. Anything else as is (a double's 0.7 is no float32; a float32's 0.5 is 0.5
    either way)."""
    if isinstance(value, float) and math.isfinite(value) and float(np.float32(value)) == value:
        return float(str(np.float32(value)))
    return value


#: the narrow float dtypes whose scalars `scalar_meant` reads as the decimal meant -> significand bits.
NARROW_FLOATS: dict[str, int] = {"float32": 24, "float16": 11, "bfloat16": 8}


def scalar_meant(value: Any) -> Any:
    """A NumPy or torch scalar as a Python number: one of a narrow float dtype (`NARROW_FLOATS`: a
    bfloat16 0.7 holds 0.69921875) as the shortest decimal that rounds to it in that dtype (0.7), the
    dtype telling that no more digits were kept; anything else as `.item()` gives it (or as is). By the
    dtype only: a Python float 0.69921875 is no bfloat16 and stays (`float32_meant` reads float32's).
    """
    if not hasattr(value, "item"):
        return value
    number = value.item()
    bits = NARROW_FLOATS.get(str(getattr(value, "dtype", "")).removeprefix("torch."))
    if not isinstance(number, float) or bits is None or not math.isfinite(number) or number == 0:
        return number
    for digits in range(1, 18):  # float16 and bfloat16 subnormals are no sampling values: normal rounding
        text = float(f"{number:.{digits}g}")
        mantissa, exponent = math.frexp(text)
        if math.ldexp(round(mantissa * 2 ** bits), exponent - bits) == number:  # round half to even
            return text
    return number


def top_k_off(value: Any) -> Any:
    """A top_k as parity reads it, from a dump row, a trainer's batch or a monitored step alike: an
    integer (NumPy's too) as a Python int, -1 (vLLM's and verl's "off") as parity's 0. Anything else as
    is, for its reader to refuse: a float too (-1.0, 50.0: top_k is an integer everywhere,
    `SamplingParams` included)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return value
    return 0 if int(value) == -1 else int(value)


def check_id(value: Any, field: str) -> str:
    """A request id: a string, or an integer (written as a string)."""
    if isinstance(value, bool) or not isinstance(value, (str, numbers.Integral)):
        raise InputError(f"{field} must be a string, got {value!r}")
    return str(value)


def _require(d: Any, what: str, keys: tuple[str, ...]) -> None:
    if not isinstance(d, dict):
        raise InputError(f"a {what} must be a JSON object, got {type(d).__name__}")
    missing = [k for k in keys if k not in d]
    if missing:
        raise InputError(f"{what}: missing field {missing[0]!r}")
