"""TensorRT-LLM through its `LLM` API (PyTorch backend), token-id prompts.

`logprobs_mode` is a per-request field (raw by default); versions without it report raw only, and a
processed request is refused there. Prompt logprobs are raw. `LLM` has no public weight update.
Not run here (docs/BACKENDS.md says why); parsing follows TRT-LLM's documented output formats.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from parity.backends.base import Backend, SampleJob, expand_samples, stop_set
from parity.core.errors import BackendError, ConfigError
from parity.core.types import Pair, Request, Rollout, SamplingParams

#: parity logprobs_mode -> TRT-LLM `SamplingParams.logprobs_mode`.
TRTLLM_LOGPROBS_MODE = {"raw": "raw_logprobs", "processed": "processed_logprobs"}


def translate_sampling(job: SampleJob, eos_ids: Sequence[int], *, has_logprobs_mode: bool) -> dict[str, Any]:
    """parity sampling for one sample -> keyword arguments of `tensorrt_llm.SamplingParams`."""
    sp = job.sampling
    if sp.logprobs_mode == "processed" and not has_logprobs_mode and sp.temperature > 0:
        raise ConfigError(
            f"request {job.request.request_id!r}: this TensorRT-LLM has no SamplingParams.logprobs_mode "
            "and reports raw logprobs only; use logprobs_mode='raw' or a newer tensorrt-llm")
    stops = stop_set(sp, eos_ids)
    fields: dict[str, Any] = {
        "max_tokens": sp.max_tokens, "temperature": sp.temperature, "top_k": sp.top_k, "top_p": sp.top_p,
        "seed": job.seed, "stop_token_ids": list(stops), "ignore_eos": sp.ignore_eos, "n": 1,
        "end_id": eos_ids[0] if eos_ids and not sp.ignore_eos else -1,
        "logprobs": 1, "detokenize": False,
    }
    if has_logprobs_mode:
        fields["logprobs_mode"] = TRTLLM_LOGPROBS_MODE[sp.logprobs_mode]
    return fields


def _get(obj: Any, name: str) -> Any:
    """A field of a TRT-LLM output object, or of its JSON form (outputs stored as JSON)."""
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def token_logprob(entry: Any, token: int) -> float:
    """One `logprobs` entry: a float, or a dict token_id -> Logprob (object or JSON dict)."""
    if isinstance(entry, (int, float)):
        return float(entry)
    if isinstance(entry, dict):
        value = entry.get(token, entry.get(str(token)))
        if value is None:
            raise BackendError(f"TRT-LLM logprobs entry has no value for the sampled token {token}")
        return float(value if isinstance(value, (int, float)) else _get(value, "logprob"))
    raise BackendError(f"unexpected TRT-LLM logprobs entry {entry!r}")


def parse_completion(completion: Any) -> tuple[list[int], list[float], str | None]:
    """A `CompletionOutput` (or its JSON form) -> (token ids, logprobs, TRT-LLM finish reason)."""
    tokens = [int(t) for t in _get(completion, "token_ids") or []]
    entries = _get(completion, "logprobs") or []
    if len(entries) != len(tokens):
        raise BackendError(f"TRT-LLM returned {len(entries)} logprobs for {len(tokens)} tokens; "
                           "request logprobs=1")
    return tokens, [token_logprob(e, t) for e, t in zip(entries, tokens)], _get(completion, "finish_reason")


def parse_prompt_logprobs(completion: Any, prompt: Sequence[int], response: Sequence[int]) -> list[float]:
    """Raw logprobs of `response` from `prompt_logprobs` over prompt + response (entries from token 1,
    or from token 0 with a null first entry, vLLM's layout)."""
    entries = list(_get(completion, "prompt_logprobs") or [])
    ids = [*prompt, *response]
    if len(entries) == len(ids):
        entries = entries[1:]
    if len(entries) != len(ids) - 1:
        raise BackendError(f"TRT-LLM returned {len(entries)} prompt logprobs for {len(ids)} tokens")
    return [token_logprob(e, t) for e, t in zip(entries[len(prompt) - 1:], response)]


class TRTLLMBackend(Backend):
    """`tensorrt_llm.LLM` on a local HF checkpoint; `engine_kwargs` go to it unchanged."""

    name = "trtllm"
    score_modes = ("raw",)  # TensorRT-LLM's prompt logprobs are raw only

    def __init__(self, model: str | Path, *, dtype: str = "bfloat16",
                 engine_kwargs: Mapping[str, Any] | None = None) -> None:
        super().__init__(model, dtype=dtype)
        engine_kwargs = dict(engine_kwargs or {})
        # tensorrt_llm only where an engine runs: this module (its output parsing) imports without it
        import tensorrt_llm

        self._sampling_cls = tensorrt_llm.SamplingParams
        self.has_logprobs_mode = "logprobs_mode" in {f.name for f in dataclasses.fields(self._sampling_cls)}
        self._llm = tensorrt_llm.LLM(model=str(self.model_path), dtype=dtype, skip_tokenizer_init=True,
                                     **engine_kwargs)
        self.meta.update({
            "backend_version": tensorrt_llm.__version__, "has_logprobs_mode": self.has_logprobs_mode,
            "tensor_parallel_size": engine_kwargs.get("tensor_parallel_size", 1),
            "attention_backend": engine_kwargs.get("attn_backend", "TRTLLM"),
            "batch_invariant": False, "enable_prefix_caching": "see kv_cache_config.enable_block_reuse",
        })

    def generate(self, requests: Sequence[Request]) -> list[Rollout]:
        jobs = expand_samples(requests)
        params = [self._sampling_cls(**translate_sampling(job, self.eos_ids,
                                                          has_logprobs_mode=self.has_logprobs_mode))
                  for job in jobs]
        try:
            outputs = self._llm.generate([list(job.request.prompt_ids) for job in jobs], params,
                                         use_tqdm=False)
        except Exception as e:
            raise BackendError(f"TensorRT-LLM generate failed: {e}") from e
        rollouts = []
        for job, out in zip(jobs, outputs):
            tokens, logprobs, trt_finish = parse_completion(out.outputs[0])
            extra: dict[str, Any] = {"trtllm_finish_reason": trt_finish}
            rollouts.append(self.finished(job, tokens, logprobs, **extra))
        return rollouts

    def _score(self, pairs: list[Pair], sampling: SamplingParams) -> list[torch.Tensor]:
        """Raw teacher-forced logprobs from `prompt_logprobs` (TRT-LLM's are raw only)."""
        params = self._sampling_cls(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False)
        outputs = self._llm.generate([[*p, *r] for p, r in pairs], [params] * len(pairs), use_tqdm=False)
        return [torch.tensor(parse_prompt_logprobs(out.outputs[0], p, r), dtype=torch.float32)
                for (p, r), out in zip(pairs, outputs)]

    def close(self) -> None:
        llm = self.__dict__.pop("_llm", None)
        if llm is not None:
            llm.shutdown()
