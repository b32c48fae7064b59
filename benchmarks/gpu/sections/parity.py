"""The parity section: reference-engine rollouts vs `train_forward(kernels="invariant")` on CUDA, bit for bit.

Over several batch compositions (dense and MoE, bf16; the default engine, which replays CUDA graphs
for dense models, the eager engine, and a tiny token budget), with the native-kernel negative
control; then the sampling grid (temperature x top_p x top_k, `parity.engine.selfcheck`) on
random-weight models with vocabularies 32,000 and 151,936, dense and MoE, counting differing
tokens per setting, and once with torch's CUDA cumsum as the top-p prefix sum (the old defect, a
negative control).
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.gpu.records import failure
from benchmarks.gpu.results import (
    CompositionCheck,
    Failure,
    GridCheck,
    LayoutCheck,
    ParityCheck,
    ParitySection,
)
from benchmarks.gpu.run import Run
from benchmarks.gpu.workloads import qwen3_config, requests_for, save_random_model
from parity.engine import ReferenceEngine, train_forward
from parity.engine.selfcheck import sampling_grid_check
from parity.kernels import switch
from parity.models import shaped

#: engine settings of the parity section: (max_num_seqs, chunk_size, max_num_batched_tokens, graphs).
#: graphs None is the default (CUDA graphs for dense models), False the eager engine; a budget of 6
#: splits prefill steps further.
COMPOSITIONS = [(12, 64, 8192, None), (3, 5, 8192, None), (5, 7, 8192, False), (4, 9, 6, None)]
#: models of the sampling-grid check: (label, shape, layers, vocab); None shape = a built-in checkpoint.
GRID_MODELS = [("tiny-qwen3", None, 0, 0), ("tiny-qwen3-moe", None, 0, 0),
               ("qwen3-1024-v32000", "qwen3-1024", 2, 32000), ("qwen3-1024-v151936", "qwen3-1024", 2, 151936),
               ("qwen3-1.7b-v32000", "qwen3-1.7b", 2, 32000), ("qwen3-1.7b-v151936", "qwen3-1.7b", 2, 151936),
               ("moe-64x8-v32000", "moe-64x8", 2, 32000)]


def parity_check(model: Any, vocab: int, kernels: str) -> ParityCheck:
    """Rollouts under several batch compositions vs train_forward under several layouts, bit for bit."""
    reqs = requests_for(vocab, 6, 13, 20, n=2, seed=1)
    compositions = []
    first_tokens = None
    for max_num_seqs, chunk_size, budget, graphs in COMPOSITIONS:
        with ReferenceEngine(model, dtype="bfloat16", device="cuda", kernels=kernels,
                             max_num_seqs=max_num_seqs, chunk_size=chunk_size, max_num_batched_tokens=budget,
                             graphs=graphs) as engine:
            rollouts = engine.generate(reqs)
        got = [torch.tensor(r.logprobs, dtype=torch.float32) for r in rollouts]
        tokens = [r.token_ids for r in rollouts]
        if first_tokens is None:
            first_tokens = tokens
        layouts = {}
        for layout, micro_batch_size in [("right", None), ("left", 5), ("packed", 4)]:
            train = train_forward(model, rollouts, dtype="bfloat16", device="cuda", kernels=kernels,
                                  layout=layout, micro_batch_size=micro_batch_size).logprobs
            layouts[layout] = LayoutCheck(
                bitwise_equal=all(torch.equal(a, b.cpu()) for a, b in zip(got, train)),
                max_abs_diff=max(float((a - b.cpu()).abs().max()) for a, b in zip(got, train)))
        compositions.append(CompositionCheck(
            max_num_seqs=max_num_seqs, chunk_size=chunk_size, max_num_batched_tokens=budget,
            step_graphs=rollouts[0].meta["step_graphs"],
            tokens_equal_first_composition=tokens == first_tokens, train=layouts))
    return ParityCheck(kernels=kernels, compositions=compositions,
                       all_bitwise_equal=all(t.bitwise_equal for c in compositions for t in c.train.values()))


def grid_check(model: str, kernels: str) -> GridCheck:
    """Differing tokens per (temperature, top_p, top_k) setting: engine rollouts (24 requests x
    n=2 x 24 tokens per setting, max_num_seqs 8, chunk 32) vs train_forward, bf16."""
    checks = sampling_grid_check(model, device="cuda", dtype="bfloat16", kernels=kernels)
    return GridCheck(settings=checks, tokens=sum(c.tokens for c in checks),
                     differing=sum(c.differing for c in checks),
                     max_abs_diff=max(c.max_abs_diff for c in checks))


def stock_scan_check(model: str) -> GridCheck | Failure:
    """The old top-p defect as a negative control: torch's CUDA cumsum as the prefix sum."""
    try:
        with switch.replaced("softmax", "cumsum", "cuda", lambda x: torch.cumsum(x, -1)):
            return grid_check(model, "invariant")
    except Exception:
        return failure()


def measure(run: Run) -> ParitySection:
    """Bitwise parity per (model, kernels), then the sampling grid per model (see the module doc)."""
    checks: dict[str, ParityCheck | Failure] = {}
    small = save_random_model(qwen3_config(2), run.tmp / "qwen3-shaped-2l")
    for name, model, vocab in [("tiny-qwen3", "tiny-qwen3", 512), ("tiny-qwen3-moe", "tiny-qwen3-moe", 512),
                               ("qwen3-1.7b-shaped-2-layers", str(small), 151936)]:
        for kernels in ("invariant", "native"):
            try:
                checks[f"{name}/{kernels}"] = parity_check(model, vocab, kernels)
            except Exception:
                checks[f"{name}/{kernels}"] = failure()
    grid: dict[str, GridCheck | Failure] = {}
    for label, shape, layers, vocab in GRID_MODELS:
        model = label if shape is None else str(shaped.save_random_model(
            shaped.shaped_config(shape, layers, vocab_size=vocab), run.tmp / label, device="cuda"))
        for kernels in ("invariant", "native") if label == "qwen3-1.7b-v151936" else ("invariant",):
            try:
                grid[f"{label}/{kernels}"] = grid_check(model, kernels)
            except Exception:
                grid[f"{label}/{kernels}"] = failure()
        if label == "qwen3-1024-v151936":
            grid[f"{label}/stock-cuda-scan"] = stock_scan_check(model)
    return ParitySection(checks=checks, sampling_grid=grid)
