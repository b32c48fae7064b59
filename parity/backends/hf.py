"""Plain `transformers` generate: the "what a naive HF rollout gives you" baseline.

Stock kernels, left-padded batches, HF's samplers. The `GenerationConfig` is built from scratch
and the checkpoint's generation defaults are dropped (HF would apply top_k=50 and fill every unset
field, min_p or no_repeat_ngram_size, from the checkpoint's generation_config.json). HF has one
global RNG per generate call, so each padded batch is seeded with its first sample's seed and
samples depend on their batch: each rollout's meta records that seed as "sample_seed", its batch's
first sample (whose seed it is) as "seed_batch_head" and its row as "seed_batch_row"; the head's meta
alone lists the batch, in row order, as "seed_batch" (meta "seeding"), so a batch's records grow as
its rows do, not as their square. `output_scores` are
processed, `output_logits` raw. LoRA runs through peft's `PeftModel` as a peft trainer runs it
(adapter weights in float32, unmerged).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

from parity.backends.base import Backend, SampleJob, expand_samples, processed_from_raw, stop_set
from parity.core.errors import BackendUnavailableError, ConfigError
from parity.core.types import Pair, Request, Rollout, SamplingParams
from parity.models.checkpoints import check_loaded
from parity.models.lora import LoraSpec


def translate_sampling(sp: SamplingParams, eos_ids: Sequence[int], pad_id: int) -> dict[str, Any]:
    """parity sampling -> `transformers.GenerationConfig` fields (everything explicit)."""
    greedy = sp.temperature == 0
    fields: dict[str, Any] = {
        "max_new_tokens": sp.max_tokens, "min_new_tokens": 0, "do_sample": not greedy,
        "eos_token_id": list(stop_set(sp, eos_ids)), "pad_token_id": pad_id,
        "num_beams": 1, "repetition_penalty": 1.0,
        "output_scores": True, "output_logits": True, "return_dict_in_generate": True,
    }
    if not greedy:
        # Under greedy search HF ignores these (and warns if they are set).
        fields.update(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p)
    return fields


class HFBackend(Backend):
    """`AutoModelForCausalLM.generate` on a local checkpoint; `batch_size` samples per padded call."""

    name = "hf"

    def __init__(self, model: str | Path, *, dtype: str = "bfloat16", device: str = "cpu",
                 attn_implementation: str = "sdpa", batch_size: int = 16, lora: str | None = None) -> None:
        super().__init__(model, dtype=dtype)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"hf option batch_size must be an integer >= 1, got {batch_size!r}")
        spec = self.check_lora(lora)
        if spec is not None and importlib.util.find_spec("peft") is None:
            raise BackendUnavailableError("the hf backend applies LoRA adapters with peft: pip install "
                                          '"parity-harness[lora]" (or pip install peft)')
        self.device = torch.device(device)
        self.batch_size = batch_size
        # checked as the reference engine's `load_model` checks: a tensor missing, left over or of another
        # shape would otherwise run randomly initialised, and the rollouts come from another model
        hf, info = AutoModelForCausalLM.from_pretrained(
            str(self.model_path), dtype=getattr(torch, dtype), attn_implementation=attn_implementation,
            output_loading_info=True, ignore_mismatched_sizes=True,
        )
        check_loaded(model, hf, info)
        self._model = hf.to(self.device).eval()
        # transformers fills every field the config given to `generate` leaves unset from the
        # checkpoint's generation_config.json (min_p, typical_p, no_repeat_ngram_size, ...): parity's
        # sampling must be all that applies, so the model keeps its special ids only
        loaded = self._model.generation_config
        self._model.generation_config = GenerationConfig(**{
            key: getattr(loaded, key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")})
        self._adapters = 0
        if spec is not None:
            from peft import PeftModel  # peft only for an adapter: the hf backend runs without it

            self._model = PeftModel.from_pretrained(self._model, str(spec.path), adapter_name="a0").eval()
        config = self._model.config
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else 0
        self.meta.update({
            "backend_version": transformers.__version__, "torch_version": torch.__version__,
            "device": str(self.device), "attention_backend": attn_implementation,
            "batch_invariant": False, "tensor_parallel_size": 1, "enable_prefix_caching": False,
            "batch_size": batch_size, "padding": "left",
            "generation_defaults": "none: the checkpoint's generation_config.json is not applied",
            "seeding": "per padded batch: torch.manual_seed(sample seed of the batch's first sample); "
                       "meta sample_seed is that seed, seed_batch_head the [request_id, sample_index] of "
                       "the batch's first sample, seed_batch_row the sample's row; the head's meta alone "
                       "holds seed_batch, the batch's [request_id, sample_index] in row order (a sample "
                       "replays only in the same batch)",
        })

    def generate(self, requests: Sequence[Request]) -> list[Rollout]:
        jobs = expand_samples(requests)
        # One generate call serves samples with identical sampling fields (seed aside): HF
        # takes sampling parameters per call, not per row.
        groups: dict[SamplingParams, list[int]] = {}
        for i, job in enumerate(jobs):
            groups.setdefault(job.sampling.replace(seed=0, n=1), []).append(i)
        results: list[Rollout | None] = [None] * len(jobs)
        for members in groups.values():
            for start in range(0, len(members), self.batch_size):
                chunk = members[start:start + self.batch_size]
                for i, rollout in zip(chunk, self._generate_batch([jobs[i] for i in chunk])):
                    results[i] = rollout
        return [r for r in results if r is not None]

    @torch.no_grad()
    def _generate_batch(self, jobs: list[SampleJob]) -> list[Rollout]:
        sp = jobs[0].sampling
        stops = stop_set(sp, self.eos_ids)
        prompts = [list(job.request.prompt_ids) for job in jobs]
        width = max(map(len, prompts))
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        config = GenerationConfig(**translate_sampling(sp, self.eos_ids, self.pad_id))
        # HF samples from torch's global generator; fork it so the caller's RNG state is untouched.
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(jobs[0].seed)
            out = self._model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
        steps = out.scores if sp.logprobs_mode == "processed" else out.logits
        logprobs = torch.stack(steps, dim=1).float().log_softmax(dim=-1)  # [B, steps, V]
        generated = out.sequences[:, width:]
        # one generator drew every row: the seed a rollout records is the batch's, with its company,
        # listed once (in the head's meta): a list in every row would be B^2 entries per batch
        batch = [[job.request.request_id, job.sample_index] for job in jobs]
        rollouts = []
        for row, job in enumerate(jobs):
            tokens = generated[row].tolist()
            # Rows that stopped early are padded by HF; cut after the first stop token.
            end = next((t + 1 for t, tok in enumerate(tokens) if tok in stops), len(tokens))
            tokens = tokens[:end]
            lps = logprobs[row, torch.arange(end), generated[row, :end]].tolist()
            top_k = None
            if sp.top_k_logprobs:
                k = min(sp.top_k_logprobs, logprobs.shape[-1])
                values, ids = torch.topk(logprobs[row, :end], k, dim=-1)
                top_k = (ids.tolist(), values.tolist())
            company = {"seed_batch": batch} if row == 0 else {}
            rollouts.append(self.finished(job, tokens, lps, top_k=top_k, sample_seed=jobs[0].seed,
                                          seed_batch_head=list(batch[0]), seed_batch_row=row, **company))
        return rollouts

    @classmethod
    def top_k_limit(cls, options: dict[str, Any]) -> int | None:
        return None  # the whole distribution is at hand

    @torch.no_grad()
    def _score(self, pairs: list[Pair], sampling: SamplingParams) -> list[torch.Tensor]:
        """Right-padded forwards of `batch_size` sequences; processed mode via `processed_from_raw`."""
        result = []
        for start in range(0, len(pairs), self.batch_size):
            chunk = [[*p, *r] for p, r in pairs[start:start + self.batch_size]]
            width = max(map(len, chunk))
            ids = torch.tensor([s + [self.pad_id] * (width - len(s)) for s in chunk], device=self.device)
            mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in chunk], device=self.device)
            logits = self._model(input_ids=ids, attention_mask=mask).logits.float().cpu()
            for row, (prompt, response) in enumerate(pairs[start:start + self.batch_size]):
                # logits at position t predict token t + 1.
                steps = logits[row, len(prompt) - 1:len(prompt) - 1 + len(response)]
                if sampling.logprobs_mode == "processed":
                    lp = processed_from_raw(steps, temperature=sampling.temperature, top_k=sampling.top_k,
                                            top_p=sampling.top_p)
                else:
                    lp = steps.log_softmax(dim=-1)
                result.append(lp.gather(-1, torch.tensor(response, dtype=torch.long)[:, None])[:, 0])
        return result

    def _load_adapter(self, spec: LoraSpec) -> None:
        """peft's `load_adapter` under a new name, `set_adapter` to it, the previous one deleted."""
        previous = f"a{self._adapters}"
        self._adapters += 1
        name = f"a{self._adapters}"
        self._model.load_adapter(str(spec.path), adapter_name=name)
        self._model.set_adapter(name)
        self._model.delete_adapter(previous)
        self._model.eval()

    def close(self) -> None:
        self.__dict__.pop("_model", None)
