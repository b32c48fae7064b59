"""Speed of the full-distribution drift metrics (`parity.drift.distribution.position_drift` and its
summary) over 10 million positions at k = 20, from float32 inputs as engines return them.

Run on one core:
    OPENBLAS_NUM_THREADS=1 taskset -c 0 .venv/bin/python benchmarks/distribution_speed.py [positions]
Prints a table (median of 3 rounds after a warm-up): wall seconds and the process's CPU seconds
(what one dedicated core would take, where the machine is shared); the result goes in
docs/DISTRIBUTION.md ("Cost").
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
        probs = -np.sort(-rng.random((rows, K)), axis=1)
        engine[part] = np.log(probs / probs.sum(axis=1, keepdims=True) * 0.8)
        trainer[part] = engine[part] + rng.normal(0.0, 0.01, size=(rows, K)).astype(np.float32)
    view = TrainerView(at_engine=trainer, top_ids=np.broadcast_to(np.arange(K), (positions, K)),
                       top_logprobs=engine, entropy=np.ones(positions),
                       sampled_rank=np.zeros(positions, dtype=np.int64))
    return engine, view


def main(positions: int) -> None:
    engine, view = inputs(positions)
    wall, cpu = [], []
    for _ in range(4):
        start, start_cpu = time.perf_counter(), time.process_time()
        summarize_distribution(position_drift(engine, view), K)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    print(f"| positions | k | wall s, median of 3 | CPU s, median of 3 | machine |\n|---|---|---|---|---|\n"
          f"| {positions:,} | {K} | {statistics.median(wall[1:]):.2f} | {statistics.median(cpu[1:]):.2f} | "
          f"{platform.processor() or platform.machine()}, numpy {np.__version__} |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000_000)
