"""The step_split section: where the invariant engine's decode steps spend their wall time.

At the `--e2e` workload: host seconds per part of a step over one timed generate (after an
identical warm-up generate) in the scheduler, the graph launch and the sampler launches, the wait
for the device (`Draw.read`: with overlapped steps the host waits there for step N while step N+1
is queued), and each captured CUDA-graph bucket replayed alone (device ms). The sampler rows are
launch time only.
"""

from __future__ import annotations

import time

import torch

from benchmarks.gpu.results import StepSplit
from benchmarks.gpu.run import Run
from benchmarks.gpu.timing import graph_replay_ms, host_timers
from benchmarks.gpu.workloads import qwen3_config, requests_for, save_random_model
from parity.engine import ReferenceEngine, graphs, overlap, sampler, scheduler
from parity.engine import engine as engine_module


def measure(run: Run) -> StepSplit:
    """See the module docstring."""
    count, prompt_len, max_tokens = run.args.e2e
    path = save_random_model(qwen3_config(28), run.tmp / "qwen3-1.7b-shaped")
    reqs = requests_for(151936, count, prompt_len, max_tokens)
    parts = {
        "scheduler.plan": (scheduler.Scheduler, "plan"),
        "scheduler.finish": (scheduler.Scheduler, "finish"),
        "graph step (inputs, copy, replay launch)": (graphs.StepGraphs, "run"),
        "eager step (prefill)": (engine_module.ReferenceEngine, "_eager_forward"),
        "_sample (launches)": (engine_module.ReferenceEngine, "_sample"),
        "Draw.read (wait for the device)": (overlap.Draw, "read"),
        "  lm_head launch": (engine_module.forward, "logits"),
        "  processed_logprobs launch": (sampler, "processed_logprobs"),
        "  sample launch": (sampler, "sample"),
    }
    with ReferenceEngine(str(path), dtype="bfloat16", device="cuda", kernels="invariant", max_num_seqs=count,
                         chunk_size=run.args.chunk_size or prompt_len,
                         max_num_batched_tokens=run.args.max_batched_tokens) as engine:
        engine.generate(reqs)
        with host_timers(parts) as (seconds, calls):
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.generate(reqs)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        buckets = {}
        for (size, _, max_run), bucket in engine._graphs._buckets.items():
            if bucket.graph is not None:
                buckets[f"{size} tokens, max_run {max_run}"] = graph_replay_ms(bucket.graph)
    return StepSplit(workload=f"{count} seqs x {prompt_len} prompt x {max_tokens} output, invariant",
                     wall_s=wall, host_s=seconds, calls=calls, bucket_device_ms=buckets)
