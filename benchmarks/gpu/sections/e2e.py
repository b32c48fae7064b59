"""The e2e section: output tok/s of each `--e2e-variants` variant side by side in one run.

On a Qwen3-1.7B-shaped bf16 model with random weights (28 layers): "invariant" (the reference
engine with invariant kernels; "invariant@PLAN" under another attention plan; "invariant-steady"
with steps run one by one instead of overlapped), "baseline" (b': the
same engine, scheduler and CUDA graphs with default cuBLAS, torch's flash attention reading the KV
cache in place and stock MoE, keeping only the row-wise/elementwise families `BASELINE_FAMILIES`
on parity's fused kernels: the honest non-invariant baseline), "native" (every family stock: HF's
unfused ops) and "hf" (transformers `generate`). Each engine variant is warmed (`warm_up`: every
shape compiled and captured; its seconds reported as the cold-start figure) and timed
`--e2e-repeats` times in the same engine; the row keeps the median, each run and their spread.
"""

from __future__ import annotations

import torch

from benchmarks.gpu.records import failure
from benchmarks.gpu.results import E2ESection, E2EWorkload, Failure, Throughput
from benchmarks.gpu.run import Run
from benchmarks.gpu.settings import module_constants
from benchmarks.gpu.workloads import (
    engine_kernels,
    engine_tok_s,
    hf_generate_tok_s,
    plan_constants,
    qwen3_config,
    requests_for,
    save_random_model,
)
from parity.kernels.triton import attention as attention_kernels
from parity.kernels.triton.matmul import cublaslt_ready


def measure(run: Run) -> E2ESection:
    """See the module docstring."""
    args = run.args
    count, prompt_len, max_tokens = args.e2e
    chunk_size = args.chunk_size or prompt_len
    workload = E2EWorkload(
        requests=count, prompt_tokens=prompt_len, output_tokens=max_tokens,
        model="Qwen3-1.7B-shaped, 28 layers, bf16, random weights", engine_chunk_size=chunk_size,
        engine_max_num_batched_tokens=args.max_batched_tokens,
        matmul_path="cuBLASLt without split-K where probed" if cublaslt_ready() else "Triton")
    rows: dict[str, Throughput | Failure] = {}
    path = save_random_model(qwen3_config(28), run.tmp / "qwen3-1.7b-shaped")
    reqs = requests_for(151936, count, prompt_len, max_tokens)
    for variant in args.e2e_variants:
        name = "hf_generate" if variant == "hf" else f"engine_{variant}"
        try:
            if variant == "hf":
                rows[name] = hf_generate_tok_s(path, reqs, prompt_len, max_tokens)
            else:
                with module_constants(attention_kernels, **plan_constants(variant)):
                    rows[name] = engine_tok_s(path, engine_kernels(variant), reqs, chunk_size,
                                              args.max_batched_tokens, repeats=args.e2e_repeats,
                                              overlap=False if variant.endswith("-steady") else None)
        except Exception:
            rows[name] = failure()
        torch.cuda.empty_cache()
        run.checkpoint("e2e", E2ESection(workload=workload, rows=dict(rows)))
    return E2ESection(workload=workload, rows=rows)
