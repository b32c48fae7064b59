"""The `Backend` contract every adapter implements, and what is the same for every backend, once.

Samples are expanded to single-sample jobs seeded by `sample_seed` (backends derive child seeds
differently); the stop set, EOS included, is sent explicitly; `score` takes and returns what
`parity.engine.train_forward` does; logprobs reported in another definition than parity's processed
one (`parity.engine.sampler.processed_logprobs`) are converted here and the conversion recorded.
"""

from __future__ import annotations

import abc
import inspect
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from parity.core.errors import AdapterError, BackendError, ConfigError, InputError, UnsupportedError
from parity.core.schema import LOGPROBS_MODES
from parity.core.strict import check_choice, check_dtype
from parity.core.types import Pair, Request, Rollout, SamplingParams, Sequences, as_pairs
from parity.models import resolve_model
from parity.models.checkpoints import eos_token_ids
from parity.models.lora import LoraSpec, check_adapter

if TYPE_CHECKING:
    import torch

#: an engine's top-k per response token: (ids `[tokens][k]`, logprobs `[tokens][k]`), descending.
TopKRows = tuple[list[list[int]], list[list[float]]]


def greedy_top_k(token_ids: Sequence[int], ids: list[list[int]]) -> TopKRows:
    """Top-k rows of the greedy point mass: the sampled token at 0.0, the engine's other ids at -inf."""
    rows = [[token, *[t for t in row if t != token][:len(row) - 1]] for token, row in zip(token_ids, ids)]
    return rows, [[0.0] + [float("-inf")] * (len(row) - 1) for row in rows]


#: per-sample seeds are drawn from a 31-bit range: every backend accepts a non-negative int32.
_SEED_RANGE = 2**31 - 1


def sample_seed(seed: int, sample_index: int) -> int:
    """The seed of sample `sample_index` of a request with seed `seed`: a hash of the pair, not seed + i,
    so requests with adjacent seeds never share samples."""
    state = np.random.SeedSequence([seed, sample_index]).generate_state(1, dtype=np.uint64)[0]
    return int(state % _SEED_RANGE)


@dataclass(frozen=True)
class SampleJob:
    """One sample of one request: what a backend is asked to produce as a single sequence."""

    request: Request
    sample_index: int
    seed: int

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling


def expand_samples(requests: Sequence[Request]) -> list[SampleJob]:
    """Requests -> single-sample jobs, ordered by request then sample index (the rollout order)."""
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise InputError(f"request_id must be unique within a batch; repeated: {dup}")
    for r in requests:
        if r.turns:
            raise InputError(f"request {r.request_id!r} is a multi-turn trajectory; this backend runs it "
                             "turn by turn through parity.backends.turns.generate(backend, requests)")
    return [SampleJob(r, i, sample_seed(r.sampling.seed, i)) for r in requests for i in range(r.sampling.n)]


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


def stop_set(sampling: SamplingParams, eos_ids: Iterable[int]) -> tuple[int, ...]:
    """Token ids that end a sample: the request's stop ids, plus EOS unless `ignore_eos` (which
    skips EOS only, as in vLLM and SGLang)."""
    eos = () if sampling.ignore_eos else tuple(eos_ids)
    return tuple(dict.fromkeys([*sampling.stop_token_ids, *eos]))


def finish_reason(token_ids: Sequence[int], stops: Sequence[int]) -> str:
    """"stop" if the last token is a stop token, else "length"."""
    return "stop" if token_ids and token_ids[-1] in stops else "length"


def score_sampling(logprobs_mode: str, temperature: float, top_k: int, top_p: float) -> SamplingParams:
    """The logprob definition asked of `score`, checked."""
    check_choice(logprobs_mode, LOGPROBS_MODES, "logprobs_mode")
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, logprobs_mode=logprobs_mode)


def processed_from_raw(raw: torch.Tensor, *, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """parity's processed logprobs `[N, V]` from raw logits or raw logprobs `[N, V]` (softmax ignores
    a per-row shift, so either gives the same result)."""
    # the engine's sampler (torch) only when converting: `import parity.backends` stays light
    from parity.engine.sampler import RowParams, processed_logprobs

    n = raw.shape[0]
    return processed_logprobs(raw.float(), RowParams.of([float(temperature)] * n, [top_k] * n,
                                                        [float(top_p)] * n))


def greedy_processed(logprobs: Sequence[float]) -> list[float]:
    """Processed logprobs of greedy tokens: 0 each (vLLM and HF report raw ones under greedy)."""
    return [0.0] * len(logprobs)


def checked_scores(backend: str, pairs: Sequence[Pair], scores: Sequence[Any]) -> list[Any]:
    """`scores`, one 1-D tensor of len(response) per pair, else BackendError naming `backend` and the
    sequence: a short or long row would otherwise surface later as the user's mistake ("give one
    logprob per generated token") or as a shape error far from its cause."""
    scores = list(scores)
    if len(scores) != len(pairs):
        raise BackendError(f"backend {backend!r} scored {len(scores)} sequences for the {len(pairs)} given; "
                           "a backend bug, not the input's")
    for i, ((_, response), row) in enumerate(zip(pairs, scores)):
        shape = tuple(getattr(row, "shape", ()))
        if shape != (len(response),):
            raise BackendError(f"backend {backend!r} scored sequence {i} ({len(response)} response tokens) "
                               f"with a tensor of shape {list(shape)}; expected [{len(response)}]: a backend "
                               "bug, not the input's")
    return scores


class Backend(abc.ABC):
    """One inference backend behind parity's normalized interface; a context manager.

    Subclasses set `name`, implement `generate`, `_score` and `close`, and fill `meta` with the
    version and every setting that affects numerics; each `Rollout` carries a copy of it.
    """

    name: ClassVar[str]
    #: the logprob modes `score` can report; a backend whose prompt logprobs are raw only says so.
    score_modes: ClassVar[tuple[str, ...]] = LOGPROBS_MODES
    #: whether `generate` runs multi-turn trajectories itself (continuing each in place); others
    #: get them turn by turn from `parity.backends.turns.generate`.
    native_turns: ClassVar[bool] = False
    #: whether `generate_uncached` keeps a request from reading the prefix cache.
    bypasses_prefix_cache: ClassVar[bool] = False
    #: set by `parity.backends.shared_backend` on the backends it shares (their state is not theirs to
    #: change: `load_adapter` refuses).
    shared: bool = False

    @classmethod
    def option_names(cls) -> list[str]:
        """The options `get_backend` accepts: the keyword-only parameters of `__init__` but dtype."""
        params = inspect.signature(cls.__init__).parameters.values()
        return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name != "dtype"]

    def __init__(self, model: str | Path, *, dtype: str = "bfloat16") -> None:
        self.model_path = resolve_model(model)
        #: the checkpoint directory, resolved at start: a relative `model_path` names another one once
        #: the working directory changes
        self.model_dir = self.model_path.resolve()
        self.dtype = check_dtype(dtype)
        self.eos_ids = eos_token_ids(self.model_path)
        self.meta: dict[str, Any] = {"backend": self.name, "dtype": dtype, "model": str(self.model_path)}

    @abc.abstractmethod
    def generate(self, requests: Sequence[Request]) -> list[Rollout]:
        """Sample every request; rollouts ordered by request, then sample index."""

    @property
    def has_prefix_cache(self) -> bool:
        """Whether this engine keeps a prefix cache a request may read (meta "enable_prefix_caching")."""
        return bool(self.meta.get("enable_prefix_caching"))

    def generate_uncached(self, requests: Sequence[Request]) -> list[Rollout]:
        """`generate` with every prompt prefilled from its first token (UnsupportedError where a
        prefix cache cannot be bypassed)."""
        if self.has_prefix_cache:
            raise UnsupportedError(f"backend {self.name!r} cannot keep a request from reading its prefix "
                                   "cache")
        return self.generate(requests)

    def score(self, sequences: Sequences, *, logprobs_mode: str = "raw", temperature: float = 1.0,
              top_k: int = 0, top_p: float = 1.0) -> list[torch.Tensor]:
        """Teacher-forced logprobs of each sequence's response tokens, float32 `[len(response)]`.

        sequences: Rollouts or (prompt_ids, response_ids) pairs (as `train_forward` takes).
        """
        sampling = score_sampling(logprobs_mode, temperature, top_k, top_p)
        if logprobs_mode not in self.score_modes:
            raise ConfigError(f"backend {self.name!r}: prompt logprobs are {' or '.join(self.score_modes)} "
                              f"only; score with logprobs_mode={self.score_modes[0]!r}")
        pairs = as_pairs(sequences)
        return checked_scores(self.name, pairs, self._score(pairs, sampling))

    @abc.abstractmethod
    def _score(self, pairs: list[Pair], sampling: SamplingParams) -> list[torch.Tensor]:
        """`score` on checked pairs; `sampling` holds the logprob definition."""

    def check_lora(self, lora: str | os.PathLike[str] | None) -> LoraSpec | None:
        """The adapter `lora` checked against the model before the engine starts, recorded in
        `meta["lora"]`; None stays None."""
        if lora is None:
            return None
        spec = check_adapter(lora, self.model_path)
        self.meta["lora"] = spec.to_dict()
        return spec

    def load_adapter(self, lora: str | os.PathLike[str]) -> LoraSpec:
        """Apply LoRA adapter `lora` from the next call on (an RL step's new adapter), recorded in
        `meta["lora"]`; returns its spec. Refused on a shared backend: a swap would hand its other
        callers an adapter they did not ask for."""
        if "lora" not in self.meta:
            raise AdapterError(f"backend {self.name!r} was started without a LoRA adapter; start it with "
                               "lora= to swap adapters at run time")
        if self.shared:
            raise ConfigError(f"this {self.name!r} backend is shared (parity.backends.shared_backend) under "
                              "the adapter it started with; swap adapters on a backend of your own "
                              "(get_backend)")
        spec = check_adapter(lora, self.model_path)
        self._load_adapter(spec)
        self.meta["lora"] = spec.to_dict()
        return spec

    def _load_adapter(self, spec: LoraSpec) -> None:
        """`load_adapter` on a checked adapter; backends that apply adapters implement it."""
        raise BackendError(f"backend {self.name!r} cannot swap LoRA adapters at run time")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights (HF parameter names) into the running backend."""
        raise BackendError(f"backend {self.name!r} has no weight-update API; "
                           "start a new backend on the updated checkpoint instead")

    def weight_checksums(self) -> dict[str, str | None]:
        """A digest of every weight tensor the engine holds, by its own name (what a weight push is
        verified by); None for a tensor it cannot show (vLLM-CPU's GEMM-packed weights)."""
        raise UnsupportedError(f"backend {self.name!r} cannot report the weights it holds")

    def expected_checksums(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
        """What `weight_checksums()` returns once `update_weights(named_tensors)` has loaded them."""
        raise UnsupportedError(f"backend {self.name!r} cannot say which weights a push should leave")

    @classmethod
    def weight_sync_missing(cls) -> str | None:
        """Why this adapter cannot push and verify weights, or None; read off the class."""
        if cls.update_weights is Backend.update_weights:
            return f"backend {cls.name!r} has no weight-update API"
        if (cls.weight_checksums is Backend.weight_checksums
                or cls.expected_checksums is Backend.expected_checksums):
            return (f"backend {cls.name!r} cannot report the weights it holds (no weight checksums), so a "
                    "weight push could not be verified")
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Release the engine; the backend is unusable afterwards."""

    @property
    def alive(self) -> bool:
        """False once the engine has died and every later call would fail (`shared_backend` then
        replaces it)."""
        return True

    def rollout(self, job: SampleJob, token_ids: Sequence[int], logprobs: Sequence[float],
                finish: str, routed_experts: np.ndarray | None = None,
                top_k: TopKRows | None = None, **extra_meta: Any) -> Rollout:
        """A `Rollout` for `job` stamped with this backend's name, mode, meta and the request's sampling."""
        fields = {} if top_k is None else {"top_k_ids": np.array(top_k[0], dtype=np.int64),
                                            "top_k_logprobs": np.array(top_k[1], dtype=np.float64)}
        return Rollout(
            request_id=job.request.request_id, sample_index=job.sample_index,
            prompt_ids=job.request.prompt_ids, token_ids=tuple(token_ids), logprobs=tuple(logprobs),
            finish_reason=finish, backend=self.name, logprobs_mode=job.sampling.logprobs_mode,
            routed_experts=routed_experts, meta={**self.meta, "sample_seed": job.seed, **extra_meta},
            sampling=job.sampling, **fields,
        )

    @classmethod
    def check_requests(cls, requests: Sequence[Request], options: dict[str, Any]) -> None:
        """ConfigError for a request this backend, started with `options`, would refuse: called before
        it starts, so a refusal costs no engine start. Nothing to check by default."""
        return

    @classmethod
    def check_probe(cls, requests: Sequence[Request], capture: Sequence[int], kinds: Sequence[str],
                    options: dict[str, Any]) -> None:
        """What this backend's engine probe would refuse, started with `options`, for the samples
        `capture` and stage kinds `kinds`: called before it starts. Nothing by default."""
        return

    @classmethod
    def top_k_limit(cls, options: dict[str, Any]) -> int | None:
        """The most top-k logprobs per position with `options`: None for no limit, 0 for none."""
        return 0

    def finished(self, job: SampleJob, token_ids: Sequence[int], logprobs: Sequence[float],
                 routed_experts: np.ndarray | None = None, top_k: TopKRows | None = None,
                 **extra_meta: Any) -> Rollout:
        """The `Rollout` of one finished sample, normalized alike for every backend: greedy processed
        logprobs become the point mass (recorded in meta); the finish reason is parity's stop set's."""
        if job.sampling.temperature == 0 and job.sampling.logprobs_mode == "processed":
            logprobs = greedy_processed(logprobs)
            if top_k is not None:
                top_k = greedy_top_k(token_ids, top_k[0])
            extra_meta["greedy_conversion"] = f"{self.name} logprobs under greedy -> point mass (0.0)"
        finish = finish_reason(token_ids, stop_set(job.sampling, self.eos_ids))
        return self.rollout(job, token_ids, logprobs, finish, routed_experts, top_k, **extra_meta)

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model={str(self.model_path)!r}, dtype={self.dtype!r})"
