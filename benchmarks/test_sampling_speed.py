"""Speed of the sampler's Gumbel-max draw on CPU: the batch-invariant kernel (family "pointwise" on)
and the stock draw (off), at a tiny model's step (16 rows x 512) and a 49k-vocabulary step (32 x
49,152, SmolLM2's vocabulary).

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest benchmarks/test_sampling_speed.py --benchmark-enable
The medians go in docs/PERF.md ("Issue 33"); the stock draw should cost about what the kernel does,
so native-kernel engine rows are not slowed by a slower sampler.
"""

from __future__ import annotations

import pytest
import torch

from parity.kernels import cpu_sampling, sampling


@pytest.mark.parametrize("rows,vocab", [(16, 512), (32, 49152)], ids=["16x512", "32x49152"])
@pytest.mark.parametrize("draw", [cpu_sampling.gumbel_argmax, sampling.gumbel_argmax],
                         ids=["kernel", "stock"])
def test_gumbel_draw(benchmark, draw, rows: int, vocab: int) -> None:
    g = torch.Generator().manual_seed(0)
    scores = torch.log_softmax(torch.randn(rows, vocab, generator=g), dim=-1)
    state = torch.randint(0, 2**32, (rows,), generator=g)
    noisy = torch.ones(rows, dtype=torch.bool)
    benchmark.pedantic(draw, args=(scores, state, noisy), rounds=25, warmup_rounds=2, iterations=1)
