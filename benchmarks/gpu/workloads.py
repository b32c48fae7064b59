"""The models, requests and engine variants the sections run, and one generate call timed.

Models are shaped like real ones (`parity.models.shaped`) with random bf16 weights, built on the
GPU; requests are random prompt ids sampled at temperature 1 with EOS ignored, so every request
produces exactly its `max_tokens`.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.results import Throughput
from parity.core.schema import REDUCTION_GROUPS
from parity.core.types import Request, SamplingParams
from parity.engine import ReferenceEngine
from parity.models import shaped
from parity.models.loading import LoadedModel

#: the end-to-end variants: transformers generate, and the engine with each kernel set.
E2E_VARIANTS = ("hf", "invariant", "invariant-steady", "native", "baseline")
#: the kernel families the "baseline" (b') variant keeps on parity's fused Triton kernels: row-wise and
#: elementwise ops whose invariance costs nothing (torch has no fused kernel HF models call for them),
#: while matmul (default cuBLAS), attention (flash over the cache) and MoE stay stock.
BASELINE_FAMILIES = ("rmsnorm", "pointwise", "rotary")


def qwen3_config(layers: int, max_positions: int = 1024) -> Any:
    """The Qwen3-1.7B-shaped model of the e2e and parity sections."""
    return shaped.shaped_config("qwen3-1.7b", layers, max_position_embeddings=max_positions)


def moe_config(layers: int) -> Any:
    """The Qwen3-30B-A3B-shaped model of the moe_e2e section (`layers` of its 48)."""
    return shaped.shaped_config("qwen3-30b-a3b", layers, max_position_embeddings=1024)


def build_moe_model(folder: Path, layers: int, distinct: int = 0) -> tuple[torch.nn.Module, Path]:
    """The `moe_config(layers)` model with random bf16 weights built in GPU memory (no checkpoint
    written), and the folder under `folder` holding its config, for `adopt_model`. distinct > 0:
    only that many layers' experts are built, the later layers' experts being theirs (`share_experts`)."""
    config = moe_config(layers)
    where = folder / "qwen3-30b-a3b-shaped"
    where.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(where)
    model = shaped.build_random_model(moe_config(distinct or layers), device="cuda", dtype="bfloat16")
    return share_experts(model, layers), where


def share_experts(model: torch.nn.Module, layers: int) -> torch.nn.Module:
    """`model` (a HF MoE causal LM) grown to `layers` decoder layers: layer j >= its count is a copy
    of layer j mod count with its own attention, router and norms (the same values) and that layer's
    expert tensors themselves. A stand-in for a model too large for the card: each layer still reads
    its experts from device memory (1.21 GB a layer at the Qwen3-30B-A3B shape against a 50 MB L2),
    so a step moves the bytes of `layers` distinct layers."""
    decoder = model.model.layers
    count = len(decoder)
    for j in range(count, layers):
        source = decoder[j % count]
        experts = source.mlp.experts
        # the memo keeps these objects themselves: the experts' tensors and the one shared config
        keep = (experts.gate_up_proj, experts.down_proj, model.config)
        layer = copy.deepcopy(source, {id(x): x for x in keep})
        layer.self_attn.layer_idx = j
        decoder.append(layer)
    model.config.num_hidden_layers = layers
    return model


def shared_note(layers: int, distinct: int) -> str:
    """The workload's words for `share_experts` ("" when every layer's experts are its own)."""
    if not distinct or distinct >= layers:
        return ""
    return f"; layers {distinct}-{layers - 1} reuse the experts of layers 0-{distinct - 1} (share_experts)"


def save_random_model(config: Any, path: Path) -> Path:
    """A randomly initialized bf16 model built on the GPU and saved as a local HF checkpoint."""
    return shaped.save_random_model(config, path, device="cuda", dtype="bfloat16")


def requests_for(vocab: int, count: int, prompt_len: int, max_tokens: int, n: int = 1,
                 seed: int = 0) -> list[Request]:
    """`count` random prompts of `prompt_len` ids, sampled at temperature 1 for max_tokens (EOS ignored)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (count, prompt_len), generator=g).tolist()
    return [
        Request(
            prompt_ids=p,
            sampling=SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, seed=i, ignore_eos=True),
            request_id=str(i),
        )
        for i, p in enumerate(prompts)
    ]


def plan_constants(variant: str) -> dict[str, int]:
    """Attention module constants of an "invariant@PLAN" variant (PLAN: a name in
    `attention.CANDIDATES`, run for every step, long or short); {} for a plain variant."""
    from parity.kernels.triton.attention import CANDIDATES

    if "@" not in variant:
        return {}
    plan = next(c for c in CANDIDATES if c.name == variant.split("@", 1)[1])
    return {"BLOCK_M": plan.block_m, "BLOCK_N": plan.block_n, "NUM_WARPS": plan.num_warps,
            "NUM_STAGES": plan.num_stages, "PROGRAMS_PER_SM": plan.programs_per_sm, "LONG_STEP_TOKENS": 2**62}


def engine_kernels(variant: str) -> str | tuple[str, ...]:
    """The engine's `kernels=` for an engine variant ("invariant-steady": the invariant kernels with
    steps run one by one, `overlap=False`)."""
    return BASELINE_FAMILIES if variant == "baseline" else variant.split("@")[0].removesuffix("-steady")


def variant_choices() -> list[str]:
    """E2E variants: hf, invariant, native, baseline, or invariant@PLAN (the invariant engine under
    another attention plan of `attention.CANDIDATES`)."""
    from parity.kernels.triton.attention import CANDIDATES

    return [*E2E_VARIANTS, *(f"invariant@{c.name}" for c in CANDIDATES)]


def engine_tok_s(model: Path | LoadedModel, kernels: str | tuple[str, ...], reqs: list[Request],
                 chunk_size: int, budget: int, record_routes: bool = False,
                 tensor_parallel_size: int | None = None,
                 reduction_groups: int = REDUCTION_GROUPS, repeats: int = 1, overlap: bool | None = None
                 ) -> Throughput:
    """Output tok/s of ReferenceEngine.generate over reqs, `repeats` timed calls (the median kept).
    Before the first, `warm_up` prepares every shape the workload uses (the KV cache at its length,
    every step graph, the eager prefill sizes) and its seconds are the cold-start figure; a small
    generate then compiles the sampler."""
    with ReferenceEngine(model, dtype="bfloat16", device="cuda", kernels=kernels, max_num_seqs=len(reqs),
                         chunk_size=chunk_size, max_num_batched_tokens=budget,
                         record_routes=record_routes, tensor_parallel_size=tensor_parallel_size,
                         reduction_groups=reduction_groups, overlap=overlap) as engine:
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.warm_up(max(len(r.prompt_ids) + r.sampling.max_tokens for r in reqs))
        engine.generate(requests_for(151936, 4, 16, 4, seed=9))
        torch.cuda.synchronize()
        cold = time.perf_counter() - start
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            rollouts = engine.generate(reqs)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            produced = sum(len(r.token_ids) for r in rollouts)
            runs.append((produced / seconds, seconds))
    rates = sorted(rate for rate, _ in runs)
    median_rate, median_seconds = sorted(runs)[len(runs) // 2]
    return Throughput(seconds=median_seconds, output_tokens=produced, output_tok_s=median_rate,
                      step_graphs=rollouts[0].meta["step_graphs"], cold_start_s=cold,
                      runs_tok_s=[rate for rate, _ in runs], spread=(rates[-1] - rates[0]) / median_rate)


def hf_generate_tok_s(model: Path | torch.nn.Module, reqs: list[Request], prompt_len: int,
                      max_tokens: int) -> Throughput:
    """Output tok/s of stock transformers `generate` (SDPA, sampling at temperature 1, no top-k/p) on a
    checkpoint path or an unpatched model already on the GPU."""
    from transformers import AutoModelForCausalLM

    if isinstance(model, torch.nn.Module):
        hf = model.eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, attn_implementation="sdpa")
        hf = hf.cuda().eval()
    ids = torch.tensor([list(r.prompt_ids) for r in reqs], device="cuda")
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    hf.generate(ids[:4, :16], max_new_tokens=4, min_new_tokens=4, **kwargs)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                      min_new_tokens=max_tokens, **kwargs)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    produced = (out.shape[1] - prompt_len) * len(reqs)
    del hf, out
    torch.cuda.empty_cache()
    return Throughput(seconds=seconds, output_tokens=produced, output_tok_s=produced / seconds)
