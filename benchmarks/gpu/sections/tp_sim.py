"""The tp_sim section: TP=2 on one GPU, simulated: one rank's work measured, the exchange modelled.

With one GPU the tp section cannot run two ranks. Here rank 0's shard of a 2-way group
(`shard_model`) runs in this process with a loopback exchange (`LoopbackComm`: a gather returns
the rank's own part repeated, so the shapes, copies and kernels are a real rank's and the numbers
are not), under the engine's CUDA graphs, as a rank would run if its collectives were captured too
(today's TP=2 steps run eagerly). Device counters inside each collective add up the bytes the rank
would receive from its peer and the collectives it would make; being device ops they are captured
in the graphs and count every replay. The projection per group count:

    TP=2 seconds = rank seconds + received bytes / link bandwidth + collectives x latency

at the link figures of `LINKS` (assumptions, not measurements: one H200's NVLink 4 is 450 GB/s
per direction; NCCL reaches less on mid-sized messages and pays a few microseconds per call).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from benchmarks.gpu.records import failure
from benchmarks.gpu.results import Failure, TPSimRow, TPSimSection
from benchmarks.gpu.run import Run
from benchmarks.gpu.workloads import qwen3_config, requests_for, save_random_model
from parity.engine import ReferenceEngine
from parity.parallel import Comm, shard_model

#: (name, bytes per second one rank receives, seconds per collective): the projection's link figures.
LINKS: tuple[tuple[str, float, float], ...] = (("nvlink_best", 450e9, 5e-6), ("nvlink_nccl", 300e9, 10e-6),
                                               ("nvlink_slow", 150e9, 20e-6))


@dataclass(frozen=True)
class LoopbackComm(Comm):
    """Rank `rank` of `size` with no peers: collectives return this rank's part in every peer's
    place; `counts` [2] int64 on the device adds (bytes received from peers, collectives)."""

    counts: torch.Tensor | None = None

    def _count(self, x: torch.Tensor) -> None:
        assert self.counts is not None
        self.counts[0].add_((self.size - 1) * x.numel() * x.element_size())
        self.counts[1].add_(1)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self._count(x)
        return x.unsqueeze(0).expand(self.size, *x.shape).contiguous()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._count(x)
        return x.contiguous()


def simulate(path: str, groups: int, reqs: list, chunk_size: int, budget: int, device: str = "cuda",
             dtype: str = "bfloat16") -> TPSimRow:
    """Time rank 0 of a 2-way shard of `path` on `reqs` (after a warm-up) and project TP=2."""
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    comm = LoopbackComm(0, 2, counts)
    shard = shard_model(path, comm, dtype=dtype, device=device, reduction_groups=groups)
    # the engine runs a sharded model in-process only as a rank of a group; handed as a whole model
    # it keeps its CUDA graphs, which is the point of the simulation
    rank = dataclasses.replace(shard, tensor_parallel_size=None, reduction_groups=None)
    with ReferenceEngine(rank, dtype=dtype, device=device, max_num_seqs=len(reqs), chunk_size=chunk_size,
                         max_num_batched_tokens=budget) as engine:
        engine.warm_up(max(len(r.prompt_ids) + r.sampling.max_tokens for r in reqs))
        engine.generate(requests_for(shard.vocab_size, 4, 16, 4, seed=9))
        _sync(device)
        counts.zero_()
        start = time.perf_counter()
        rollouts = engine.generate(reqs)
        _sync(device)
        seconds = time.perf_counter() - start
    received, collectives = (int(v) for v in counts.tolist())
    tokens = sum(len(r.token_ids) for r in rollouts)
    projected = {name: tokens / (seconds + received / rate + collectives * latency)
                 for name, rate, latency in LINKS}
    return TPSimRow(groups=groups, rank_seconds=seconds, output_tokens=tokens, received_bytes=received,
                    collectives=collectives, step_graphs=rollouts[0].meta["step_graphs"],
                    projected_tp2_tok_s=projected)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def measure(run: Run) -> TPSimSection:
    """See the module docstring: one row per `--tp-groups` count that 2 divides."""
    args = run.args
    count, prompt_len, max_tokens = args.e2e
    path = run.tmp / "qwen3-1.7b-shaped"
    if not path.exists():
        save_random_model(qwen3_config(28), path)
    reqs = requests_for(151936, count, prompt_len, max_tokens)
    rows: dict[str, TPSimRow | Failure] = {}
    for groups in (g for g in args.tp_groups if g % 2 == 0):
        try:
            rows[f"g{groups}"] = simulate(str(path), groups, reqs, args.chunk_size or prompt_len,
                                          args.max_batched_tokens)
        except Exception:
            rows[f"g{groups}"] = failure()
        torch.cuda.empty_cache()
        run.checkpoint("tp_sim", TPSimSection(workload=f"{count} x {prompt_len} x {max_tokens}, Qwen3-1.7B "
                                              "shape, 28 layers, bf16", links=list(LINKS), rows=dict(rows)))
    return TPSimSection(workload=f"{count} x {prompt_len} x {max_tokens}, Qwen3-1.7B shape, 28 layers, bf16",
                        links=list(LINKS), rows=rows)
