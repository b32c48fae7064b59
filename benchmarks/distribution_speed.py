"""Speed of the full-distribution drift metrics (`parity.drift.distribution.position_drift` and its
summary) over 10 million positions at k = 20, from float32 inputs as engines return them.

Run on one core: taskset -c 0 .venv/bin/python benchmarks/distribution_speed.py [positions]
Prints a table (median of 3 rounds after a warm-up); the result goes in docs/DISTRIBUTION.md ("Cost").
The aim is under 5 s for 10M positions on one CPU core.
"""

from __future__ import annotations

import platform
import statistics
import sys
import time

import numpy as np

from parity.drift.distribution import TrainerView, position_drift, summarize_distribution

K = 20


def inputs(positions: int) -> tuple[np.ndarray, TrainerView]:
    """Engine top-20 logprobs [positions, 20] float32 (descending, 0.8 of the mass) and the trainer's
    at the same ids with ~0.01 nats of drift; the trainer's own top-k is the engine's."""
    rng = np.random.default_rng(0)
    engine = np.empty((positions, K), dtype=np.float32)
    trainer = np.empty((positions, K), dtype=np.float32)
    for start in range(0, positions, 1_000_000):
        part = slice(start, min(positions, start + 1_000_000))
        rows = part.stop - part.start
        engine[part] = np.log(-np.sort(-rng.dirichlet(np.ones(K), size=rows), axis=1) * 0.8)
        trainer[part] = engine[part] + rng.normal(0.0, 0.01, size=(rows, K)).astype(np.float32)
    view = TrainerView(at_engine=trainer, top_ids=np.broadcast_to(np.arange(K), (positions, K)),
                       top_logprobs=engine, entropy=np.ones(positions),
                       sampled_rank=np.zeros(positions, dtype=np.int64))
    return engine, view


def main(positions: int) -> None:
    engine, view = inputs(positions)
    times = []
    for _ in range(4):
        start = time.perf_counter()
        summarize_distribution(position_drift(engine, view), K)
        times.append(time.perf_counter() - start)
    print(f"| positions | k | median s (3 rounds) | min s | machine |\n|---|---|---|---|---|\n"
          f"| {positions:,} | {K} | {statistics.median(times[1:]):.2f} | {min(times[1:]):.2f} | "
          f"{platform.processor() or platform.machine()}, numpy {np.__version__} |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000_000)
