"""The profile section: torch.profiler over one generate of the invariant engine.

At the e2e workload's shapes: `--e2e` requests and prompt lengths with 64 output tokens (prefill,
then decode steps at contexts past the prompt); the device-time table ($OUT/profile.txt) and
device-busy vs wall seconds (the gap is host time the GPU waits for).
"""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu.results import ProfileResult
from benchmarks.gpu.run import Run
from benchmarks.gpu.workloads import qwen3_config, requests_for, save_random_model
from parity.engine import ReferenceEngine


def measure(run: Run) -> ProfileResult:
    """See the module docstring."""
    count, prompt_len, _ = run.args.e2e
    path = save_random_model(qwen3_config(28), run.tmp / "qwen3-1.7b-shaped")
    reqs = requests_for(151936, count, prompt_len, 64)
    with ReferenceEngine(str(path), dtype="bfloat16", device="cuda", kernels="invariant", max_num_seqs=count,
                         chunk_size=prompt_len, max_num_batched_tokens=run.args.max_batched_tokens) as engine:
        engine.generate(reqs)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            engine.generate(reqs)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
    events = prof.key_averages()
    (run.args.out / "profile.txt").write_text(events.table(sort_by="self_device_time_total", row_limit=40))
    busy = sum(e.self_device_time_total for e in events) / 1e6
    return ProfileResult(workload=f"{count} seqs x {prompt_len} prompt x 64 output, invariant",
                         wall_s=seconds, gpu_busy_s=busy, steps=65)
