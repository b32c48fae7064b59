"""The tp section: invariant-engine tok/s without tensor parallelism and with it, side by side.

On the Qwen3-1.7B shape at the `--e2e` workload: the whole model in one process, TP=1 (the
canonical K-group layout in one process: its cost over the whole model) for each `--tp-groups`
count of row-parallel K groups (`reduction_groups`), and with two GPUs TP=2 (NCCL) at each even
count, with whether its rollouts equal TP=1's bit for bit (the same count: each count is its own
sum). With one GPU the TP=2 part is skipped, and recorded as skipped.
"""

from __future__ import annotations

import torch

from benchmarks.gpu.records import failure
from benchmarks.gpu.results import Failure, Throughput, TPSection
from benchmarks.gpu.run import Run
from benchmarks.gpu.workloads import engine_tok_s, qwen3_config, requests_for, save_random_model
from parity.core.schema import REDUCTION_GROUPS
from parity.engine import ReferenceEngine


def measure(run: Run) -> TPSection:
    """See the module docstring."""
    args = run.args
    count, prompt_len, max_tokens = args.e2e
    chunk_size = args.chunk_size or prompt_len
    path = run.tmp / "qwen3-1.7b-shaped"
    if not path.exists():
        save_random_model(qwen3_config(28), path)
    reqs = requests_for(151936, count, prompt_len, max_tokens)
    two_gpus = torch.cuda.device_count() >= 2
    workload = (f"{count} seqs x {prompt_len} prompt x {max_tokens} output, Qwen3-1.7B-shaped, 28 layers, "
                "bf16, invariant")
    skipped = None if two_gpus else f"needs two GPUs, {torch.cuda.device_count()} visible"
    rows: dict[str, Throughput | Failure] = {}
    equal: dict[int, bool | Failure] = {}

    def section() -> TPSection:
        return TPSection(workload=workload, reduction_groups=args.tp_groups, rows=dict(rows),
                         tp2_equals_tp1=dict(equal), tp2_skipped=skipped)

    runs: list[tuple[str, int | None, int]] = [("whole_model", None, REDUCTION_GROUPS)]
    for groups in args.tp_groups:
        runs.append((f"tp1_g{groups}", 1, groups))
        if two_gpus and groups % 2 == 0:
            runs.append((f"tp2_g{groups}", 2, groups))
    for label, tp, groups in runs:
        try:
            rows[label] = engine_tok_s(path, "invariant", reqs, chunk_size, args.max_batched_tokens,
                                       tensor_parallel_size=tp, reduction_groups=groups)
        except Exception:
            rows[label] = failure()
        torch.cuda.empty_cache()
        run.checkpoint("tp", section())
    small = requests_for(151936, 8, 24, 16, n=2, seed=3)
    for groups in args.tp_groups if two_gpus else ():
        if groups % 2:
            continue
        try:
            settings = {"dtype": "bfloat16", "device": "cuda", "reduction_groups": groups}
            one = ReferenceEngine(str(path), tensor_parallel_size=1, **settings).generate(small)
            with ReferenceEngine(str(path), tensor_parallel_size=2, max_num_seqs=5, **settings) as engine:
                two = engine.generate(small)
            equal[groups] = all(a.token_ids == b.token_ids and a.logprobs == b.logprobs
                                for a, b in zip(one, two, strict=True))
        except Exception:
            equal[groups] = failure()
    return section()
