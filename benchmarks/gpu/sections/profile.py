"""The profile section: torch.profiler over one generate of the invariant engine.

At the e2e workload's shapes: `--e2e` requests and prompt lengths with `--profile-tokens` output
tokens (prefill, then decode steps at contexts past the prompt); `--profile-model moe`: the MoE
shape of `--moe` and `--moe-layers` instead, its routes recorded; the device-time table
($OUT/profile.txt), device-busy vs wall seconds, the seconds the device idled between kernels (host
time the GPU waited for, or launch latency inside a graph: split by gap size and by the kernel
pair around the gap) and the heaviest kernels by name.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu.results import ProfileResult
from benchmarks.gpu.run import Run
from benchmarks.gpu.workloads import (
    build_moe_model,
    qwen3_config,
    requests_for,
    save_random_model,
    shared_note,
)
from parity.engine import ReferenceEngine
from parity.models.loading import LoadedModel, adopt_model

#: kernels named in the result, heaviest first.
TOP_KERNELS = 8


def measure(run: Run) -> ProfileResult:
    """See the module docstring."""
    moe = run.args.profile_model == "moe"
    count, prompt_len, _ = run.args.moe if moe else run.args.e2e
    model = _moe_model(run) if moe else _dense_model(run)
    tokens = run.args.profile_tokens
    reqs = requests_for(151936, count, prompt_len, tokens)
    with ReferenceEngine(model, dtype="bfloat16", device="cuda", kernels="invariant", max_num_seqs=count,
                         chunk_size=prompt_len, max_num_batched_tokens=run.args.max_batched_tokens,
                         record_routes=moe) as engine:
        engine.generate(reqs)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            engine.generate(reqs)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
    events = prof.key_averages()
    (run.args.out / "profile.txt").write_text(events.table(sort_by="self_device_time_total", row_limit=40))
    busy = sum(e.self_device_time_total for e in events) / 1e6
    top = sorted(((e.self_device_time_total / 1e6, e.key) for e in events), reverse=True)[:TOP_KERNELS]
    shape = (f"MoE x{run.args.moe_layers}{shared_note(run.args.moe_layers, run.args.moe_distinct_layers)}, "
             "routes recorded") if moe else "dense"
    return ProfileResult(workload=f"{shape}, {count} seqs x {prompt_len} prompt x {tokens} output, invariant",
                         wall_s=seconds, gpu_busy_s=busy, steps=tokens + 1, **_idle(prof),
                         top_kernels={name[:60]: round(s, 4) for s, name in top})


def _dense_model(run: Run) -> str:
    """The dense shape of the e2e section, saved once in the run's folder."""
    return str(save_random_model(qwen3_config(28), run.tmp / "qwen3-1.7b-shaped"))


def _moe_model(run: Run) -> LoadedModel:
    """The MoE shape of the moe_e2e section, built in GPU memory (no checkpoint written)."""
    hf, where = build_moe_model(run.tmp, run.args.moe_layers, run.args.moe_distinct_layers)
    return adopt_model(hf, where, "bfloat16", "cuda")


#: gap sizes (us) the idle seconds are split by: launch latency inside a graph is a few us, a host
#: stall longer; GAP_LABELS[i] names the gaps below GAP_EDGES[i], the last those past them all.
GAP_EDGES = (5, 50, 1000)
GAP_LABELS = (*(f"< {edge} us" for edge in GAP_EDGES), f">= {GAP_EDGES[-1]} us")


def _idle(prof: profile) -> dict:
    """Seconds between the device's kernels and copies (their intervals merged), first to last:
    `idle_s`, `idle_by_gap` (by gap size in us) and `idle_top` (the kernel pairs around the most)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    by_gap = dict.fromkeys(GAP_LABELS, 0.0)
    by_pair: Counter[str] = Counter()
    reach, before = None, ""
    for start, end, name in spans:
        if reach is not None and start > reach:
            gap = start - reach
            by_gap[GAP_LABELS[bisect.bisect_right(GAP_EDGES, gap)]] += gap / 1e6
            by_pair[f"{before[:28]} -> {name[:28]}"] += gap / 1e6
        if reach is None or end >= reach:
            reach, before = end, name
    return {"idle_s": sum(by_gap.values()), "idle_by_gap": {k: round(v, 4) for k, v in by_gap.items()},
            "idle_top": {k: round(v, 4) for k, v in by_pair.most_common(TOP_KERNELS)}}
