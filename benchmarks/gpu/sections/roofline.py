"""The roofline section: each end-to-end row of this run against its workload's lower bound from
shapes (`benchmarks.roofline`), at the copy bandwidth and matmul peak measured here.
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.gpu.results import (
    E2ESection,
    MoESection,
    ProbedSection,
    RooflineResult,
    RooflineRow,
    Throughput,
)
from benchmarks.gpu.run import Run
from benchmarks.gpu.timing import bench
from benchmarks.gpu.workloads import moe_config, qwen3_config
from benchmarks.roofline import ModelShape, bound


def model_shape(config: Any) -> ModelShape:
    """`benchmarks.roofline.ModelShape` of a transformers config (parameters counted on the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())  # a tied lm_head is the embedding, counted once
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    embed = model.get_input_embeddings().weight.numel()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return ModelShape(dense_params=total - experts - (0 if tied else embed), expert_params=experts,
                      experts=int(getattr(config, "num_experts", 0) or 0),
                      top_k=int(getattr(config, "num_experts_per_tok", 0) or 0),
                      layers=config.num_hidden_layers, q_heads=config.num_attention_heads,
                      kv_heads=config.num_key_value_heads,
                      head_dim=getattr(config, "head_dim", None)
                      or config.hidden_size // config.num_attention_heads)


#: datasheet (HBM bytes/s, dense bf16 FLOP/s) of the SXM cards the device tool lends, by name part
NOMINAL = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12)}


def measured_peaks() -> dict[str, float]:
    """Copy bandwidth (bytes/s, read + write of a 4 GiB buffer) and dense bf16 matmul peak (FLOP/s,
    8192^3 on default cuBLAS), measured here."""
    buffers = [torch.empty(2**31, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    copy_ms = bench(lambda: buffers[1].copy_(buffers[0]))
    buffers.clear()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = bench(lambda: a @ a)
    name = torch.cuda.get_device_name()
    nominal = next((v for card, v in NOMINAL.items() if card in name), (float("nan"), float("nan")))
    return {"copy_bytes_s": 2 * 2**32 / copy_ms * 1e3, "matmul_flop_s": 2 * 8192**3 / mm_ms * 1e3,
            "nominal_hbm_bytes_s": nominal[0], "nominal_bf16_flop_s": nominal[1]}


def e2e_rows(results: dict[str, Any]) -> dict[str, tuple[str, Throughput]]:
    """Every finished end-to-end row of this run, by label -> (which workload, its result)."""
    probed = results.get("probed")
    probed = probed if isinstance(probed, ProbedSection) else None
    rows: dict[str, tuple[str, Throughput]] = {}
    for prefix, source, workload in (("dense", results.get("e2e"), "dense"),
                                     ("dense[probed]", probed and probed.e2e, "dense"),
                                     ("moe", results.get("moe_e2e"), "moe"),
                                     ("moe[probed]", probed and probed.moe_e2e, "moe")):
        if isinstance(source, (E2ESection, MoESection)):
            for name, value in source.rows.items():
                if isinstance(value, Throughput):
                    rows[f"{prefix} {name}"] = (workload, value)
    return rows


def measure(run: Run) -> RooflineResult:
    """See the module docstring."""
    args = run.args
    peaks = measured_peaks()
    shapes = {"dense": (model_shape(qwen3_config(28)), args.e2e),
              "moe": (model_shape(moe_config(args.moe_layers)), args.moe)}
    bounds = {name: bound(shape, *workload, bandwidth=peaks["copy_bytes_s"], flops=peaks["matmul_flop_s"])
              for name, (shape, workload) in shapes.items()}
    rows = {label: RooflineRow(output_tok_s=v.output_tok_s, bound_tok_s=bounds[w].output_tok_s,
                               fraction_of_bound=v.output_tok_s / bounds[w].output_tok_s)
            for label, (w, v) in e2e_rows(run.results).items()}
    return RooflineResult(peaks=peaks, shapes={k: v[0] for k, v in shapes.items()}, bounds=bounds, rows=rows)
