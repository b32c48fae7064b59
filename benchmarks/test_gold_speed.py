"""Speed of the gold forward (`parity.engine.gold`) on one CPU core, and on CUDA where there is one.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest benchmarks/test_gold_speed.py --benchmark-enable \
         --benchmark-timer=time.process_time
(the CPU time is what one idle core takes; on a shared machine the wall time is inflated). The
medians go in docs/PERF.md ("Gold forward"); the aim is 10,000 tokens of tiny-llama under 10 s on one
core. `extra_info` holds each run's tokens and its FLOP rate, 2 x parameters x tokens / seconds,
the figure `parity.engine.gold.GOLD_FLOPS` is set from. The SmolLM2 rows set the rate (a model with
full-width GEMMs); the tiny ones show the floor of per-call overhead. The bf16 training forward
(parity's invariant kernels) on the same tokens is timed beside it for the ratio.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("PARITY_CACHE", os.path.join(os.path.dirname(__file__), "..", ".venv", "parity-cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from parity.engine import train_forward
from parity.engine.gold import gold_logprobs, gold_model
from parity.models import parameter_count, resolve_model

#: (model, sequences, prompt tokens, response tokens): 64 x (32 + 125) = 10,048 tokens of tiny-llama;
#: 8 x (64 + 128) = 1,536 tokens of SmolLM2.
WORKLOADS = {"tiny-llama": (64, 32, 125), "smollm2-135m-instruct": (8, 64, 128)}


def pairs_of(model: str) -> list[tuple[list[int], list[int]]]:
    count, prompt, response = WORKLOADS[model]
    rng = np.random.default_rng(0)
    return [(rng.integers(3, 500, prompt).tolist(), rng.integers(3, 500, response).tolist())
            for _ in range(count)]


def _record(benchmark, model: str, pairs) -> None:
    tokens = sum(len(p) + len(r) for p, r in pairs)
    params = parameter_count(resolve_model(model))
    benchmark.extra_info.update(tokens=tokens, parameters=params)
    if benchmark.stats is not None:
        benchmark.extra_info["flops_per_s"] = 2.0 * params * tokens / benchmark.stats.stats.median


@pytest.mark.parametrize("model", list(WORKLOADS))
def test_gold_cpu(benchmark, model):
    pairs = pairs_of(model)
    gold_model(model, dtype="float64", device="cpu")  # loading is not the forward
    out = benchmark.pedantic(gold_logprobs, args=(model, pairs), rounds=3, iterations=1)
    assert sum(len(x) for x in out) == sum(len(r) for _, r in pairs)
    _record(benchmark, model, pairs)


@pytest.mark.parametrize("model", list(WORKLOADS))
def test_bf16_training_forward_cpu(benchmark, model):
    pairs = pairs_of(model)
    train_forward(model, pairs[:1], dtype="bfloat16")
    benchmark.pedantic(train_forward, args=(model, pairs), kwargs={"dtype": "bfloat16"}, rounds=3,
                       iterations=1)
    _record(benchmark, model, pairs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")
@pytest.mark.parametrize("model", list(WORKLOADS))
def test_gold_cuda(benchmark, model):
    """float32 without TF32 on the GPU; the rate sets `GOLD_FLOPS["cuda"]`."""
    pairs = pairs_of(model) * 8

    def run():
        out = gold_logprobs(model, pairs, device="cuda")
        torch.cuda.synchronize()
        return out

    run()
    benchmark.pedantic(run, rounds=5, iterations=1)
    _record(benchmark, model, pairs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")
@pytest.mark.parametrize("model", list(WORKLOADS))
def test_bf16_training_forward_cuda(benchmark, model):
    pairs = pairs_of(model) * 8

    def run():
        out = train_forward(model, pairs, dtype="bfloat16", device="cuda")
        torch.cuda.synchronize()
        return out

    run()
    benchmark.pedantic(run, rounds=5, iterations=1)
    _record(benchmark, model, pairs)
