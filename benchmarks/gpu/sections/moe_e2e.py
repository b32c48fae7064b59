"""The moe_e2e section: output tok/s on a Qwen3-30B-A3B-shaped bf16 model with random weights.

`--moe-layers` of its 48 layers, built on the GPU in memory (48 layers are ~61 GB: more than the
lent machine's disk holds; `--moe-distinct-layers N` builds N layers' experts and lets the later
layers reuse them, for a card without room for all 48): hf generate first, on the unpatched model
(`--moe-hf-tokens` output tokens), then the engine with each `--moe-variants` kernel set, with and
without route recording (inside the CUDA graphs when the kernels allow graphs), `--e2e-repeats`
timed calls each ("invariant-steady": steps run one by one).
"""

from __future__ import annotations

import gc
import time

import torch

from benchmarks.gpu.records import failure
from benchmarks.gpu.results import E2EWorkload, Failure, MoESection, Throughput
from benchmarks.gpu.run import Run
from benchmarks.gpu.workloads import (
    build_moe_model,
    engine_kernels,
    engine_tok_s,
    hf_generate_tok_s,
    requests_for,
    shared_note,
)
from parity.kernels.triton.matmul import cublaslt_ready
from parity.models.loading import adopt_model


def measure(run: Run) -> MoESection:
    """See the module docstring."""
    args = run.args
    count, prompt_len, max_tokens = args.moe
    hf_tokens = args.moe_hf_tokens or max_tokens
    workload = E2EWorkload(
        requests=count, prompt_tokens=prompt_len, output_tokens=max_tokens,
        model=f"Qwen3-30B-A3B-shaped, {args.moe_layers} of 48 layers, 128 experts, top-8, bf16, "
              "random weights built in GPU memory" + shared_note(args.moe_layers, args.moe_distinct_layers),
        engine_chunk_size=prompt_len, engine_max_num_batched_tokens=args.max_batched_tokens,
        matmul_path="cuBLASLt without split-K where probed" if cublaslt_ready() else "Triton")
    start = time.perf_counter()
    hf, where = build_moe_model(run.tmp, args.moe_layers, args.moe_distinct_layers)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - start
    rows: dict[str, Throughput | Failure] = {}

    def checkpoint() -> None:
        run.checkpoint("moe_e2e", MoESection(workload=workload, hf_generate_output_tokens=hf_tokens,
                                             build_s=build_s, rows=dict(rows)))

    reqs = requests_for(151936, count, prompt_len, max_tokens)
    if "hf" in args.moe_variants:
        try:
            rows["hf_generate"] = hf_generate_tok_s(
                hf, requests_for(151936, count, prompt_len, hf_tokens), prompt_len, hf_tokens)
        except Exception:
            rows["hf_generate"] = failure()
        checkpoint()
    lm = adopt_model(hf, where, "bfloat16", "cuda")
    del hf
    for variant in (v for v in args.moe_variants if v != "hf"):
        for record in (False, True):
            name = f"engine_{variant}{'_routes' if record else ''}"
            try:
                rows[name] = engine_tok_s(lm, engine_kernels(variant), reqs, prompt_len,
                                          args.max_batched_tokens, record_routes=record,
                                          repeats=args.e2e_repeats,
                                          overlap=False if variant.endswith("-steady") else None)
            except Exception:
                rows[name] = failure()
            torch.cuda.empty_cache()
            checkpoint()
    del lm
    gc.collect()
    torch.cuda.empty_cache()
    return MoESection(workload=workload, hf_generate_output_tokens=hf_tokens, build_s=build_s, rows=rows)
