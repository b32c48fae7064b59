"""Overhead of `parity.Monitor.log` on a 1M-token training step: 4,096 x 256 float32 logprobs.

Run: OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python -m pytest benchmarks/test_monitor_speed.py \
    --benchmark-enable (add --benchmark-timer=time.process_time for CPU time). The medians go in
docs/PERF.md ("Monitor"); the aim is under 50 ms a step without the advisor and under 500 ms with
it, on one CPU core. `test_log_step_with_the_defaults` is a run as users leave it on: the page
redrawn every 10 steps and the advisor every 10, both in background threads, torch bounded to one
thread inside `log` (the issue-50 target: <= 100 ms wall a step on a 2-core machine); run it with
`taskset -c 0,1` and without OMP_NUM_THREADS.

What one `log` does: check the arrays, compute the step's record (summary, verl rollout_corr/*
under token TIS 2, drift by position, the 10 worst tokens; with the advisor its recommendation
too), and commit it to the SQLite store. The page is never drawn here (`render_every=0`): it is
drawn in a background thread, off the step's critical path.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch

import parity
from parity.correction.config import CorrectionConfig
from parity.drift.token_arrays import token_arrays
from parity.monitor.summary import step_record

BATCH, SEQ = 4096, 256


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def arrays(padded: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 rollout / trainer logprobs with bf16-like drift (σ = 0.05 nats) and rare ±3-nat
    spikes; every slot valid (1M tokens), or right-padded to lengths uniform in 1..256 (~0.5M)."""
    rng = np.random.default_rng(0)
    rollout = np.log(rng.uniform(1e-6, 1.0, (BATCH, SEQ))).astype(np.float32)
    drift = rng.normal(0.0, 0.05, (BATCH, SEQ))
    spikes = rng.random((BATCH, SEQ)) < 1e-3
    drift[spikes] = rng.choice([-3.0, 3.0], int(spikes.sum()))
    trainer = np.minimum(rollout + drift, 0.0).astype(np.float32)
    if not padded:
        return rollout, trainer, np.ones((BATCH, SEQ), bool)
    lengths = rng.integers(1, SEQ + 1, BATCH)
    return rollout, trainer, np.arange(SEQ)[None, :] < lengths[:, None]


@pytest.mark.parametrize("padded", [False, True], ids=["1M-tokens", "padded"])
@pytest.mark.parametrize("advice", [False, True], ids=["no-advisor", "advisor"])
def test_log_step(benchmark, tmp_path, padded, advice):
    rollout, trainer, mask = arrays(padded)
    responses = np.zeros((BATCH, SEQ), np.int64)
    steps = itertools.count()
    with parity.Monitor(tmp_path, render_every=0, advice_every=1 if advice else 0,
                        advice_in_background=False) as monitor:
        def log():
            monitor.log(next(steps), rollout_log_probs=rollout, old_log_probs=trainer, response_mask=mask,
                        responses=responses, sampling={"temperature": 1.0})

        benchmark.pedantic(log, rounds=7 if advice else 15, warmup_rounds=1, iterations=1)


def test_log_step_with_the_defaults(benchmark, tmp_path):
    """`Monitor(out_dir)` as it comes: 30 logged steps (3 page redraws, 3 background
    recommendations); each round is one `log`, after 1 s of the trainer's own step (not timed:
    a 1M-token RL step takes far longer), which the background work overlaps."""
    rollout, trainer, mask = arrays(False)
    responses = np.zeros((BATCH, SEQ), np.int64)
    steps = itertools.count()
    with parity.Monitor(tmp_path) as monitor:
        def log():
            monitor.log(next(steps), rollout_log_probs=rollout, old_log_probs=trainer, response_mask=mask,
                        responses=responses, sampling={"temperature": 1.0})

        benchmark.pedantic(log, setup=lambda: time.sleep(1.0), rounds=30, warmup_rounds=1, iterations=1)


def test_step_record_alone(benchmark):
    """The record alone (no store, arrays checked once beforehand): what the metrics cost."""
    rollout, trainer, mask = arrays(False)
    tok = token_arrays(trainer, rollout, mask)
    config = CorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)
    kwargs = {"correction": config, "responses": None, "advice": False}
    benchmark.pedantic(step_record, args=(tok,), kwargs=kwargs, rounds=15, warmup_rounds=1)
