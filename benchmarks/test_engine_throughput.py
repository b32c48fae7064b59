"""Reference engine output tokens/s with invariant vs native (stock torch) kernels on tiny models.

Run: .venv/bin/python -m pytest benchmarks/test_engine_throughput.py --benchmark-enable
Output tokens/s = tokens generated / median seconds of one `generate` call (in extra_info); the
invariant/native ratio goes in docs/PERF.md ("Reference engine (CPU)"); aim: >= 0.5.
Both run at torch's default intra-op thread count and at one thread; the ratio is taken per
thread setting.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("PARITY_CACHE", os.path.join(os.path.dirname(__file__), "..", ".venv", "parity-cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from parity import Request, SamplingParams
from parity.engine import ReferenceEngine

#: 16 requests x 32-token prompts x 32 output tokens, all running at once (one batch of 16).
REQUESTS = [Request(tuple(3 + (7 * i + j) % 500 for j in range(32)),
                    SamplingParams(max_tokens=32, seed=i, ignore_eos=True), request_id=str(i))
            for i in range(16)]
OUTPUT_TOKENS = sum(r.sampling.max_tokens for r in REQUESTS)


@pytest.fixture
def threads(request):
    """Intra-op threads for the run (None = torch's default), restored afterwards."""
    before = torch.get_num_threads()
    if request.param is not None:
        torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize(("kernels", "threads"),
                         [("invariant", None), ("native", None), ("invariant", 1), ("native", 1)],
                         indirect=["threads"],
                         ids=["invariant", "native", "invariant-1thread", "native-1thread"])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3-moe"])
def test_engine_output_tokens_per_second(benchmark, model, kernels, threads):
    engine = ReferenceEngine(model, kernels=kernels, max_num_seqs=16, chunk_size=64)
    engine.generate(REQUESTS[:2])  # warm the KV cache, rotary tables and thread pool
    rollouts = benchmark.pedantic(engine.generate, args=(REQUESTS,), rounds=5, iterations=1, warmup_rounds=1)
    assert sum(len(r.token_ids) for r in rollouts) == OUTPUT_TOKENS
    if benchmark.stats is not None:
        benchmark.extra_info["output_tokens_per_s"] = OUTPUT_TOKENS / benchmark.stats.stats.median
