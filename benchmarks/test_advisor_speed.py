"""Speed of the correction advisor: the whole default grid (48 corrections) evaluated on 10
million valid tokens, with the residual bias's 200-resample bootstrap, and the recommendation.

Run: .venv/bin/python -m pytest benchmarks/test_advisor_speed.py --benchmark-enable
The medians go in docs/PERF.md ("Correction advisor"); the aim is under 10 s on 2 CPU cores.
"""

from __future__ import annotations

import numpy as np
import pytest

from parity.advisor import Tokens, advise, default_grid
from parity.advisor.evaluate import evaluate

BATCH, SEQ = 40_000, 250


@pytest.fixture(scope="module")
def arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 logprobs [40000, 250] (10M valid tokens), bf16-like drift plus rare spikes."""
    rng = np.random.default_rng(0)
    rollout = np.log(rng.uniform(1e-6, 1.0, (BATCH, SEQ))).astype(np.float32)
    drift = rng.normal(0.0, 0.05, (BATCH, SEQ))
    spikes = rng.random((BATCH, SEQ)) < 1e-3
    drift[spikes] = rng.choice([-3.0, 3.0], int(spikes.sum()))
    return (rollout + drift).astype(np.float32), rollout, np.ones((BATCH, SEQ), bool)


def test_evaluate_grid_10m_tokens(benchmark, arrays):
    tok = Tokens.from_arrays(*arrays)
    grid = default_grid()
    ev = benchmark.pedantic(evaluate, args=(tok, grid), rounds=3, iterations=1)
    assert ev.drift.tokens == BATCH * SEQ and len(ev.candidates) == len(grid)


def test_advise_10m_tokens(benchmark, arrays):
    advice = benchmark.pedantic(advise, args=arrays, rounds=3, iterations=1)
    assert advice.name.startswith("icepop")
