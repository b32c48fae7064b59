"""The RL loop end to end: how long its steps take, what memory it holds, and whether its claims held.

Run from the repository root:

    # CPU, issue 36 requirement 6: 20 steps of tiny-llama on the reference engine and vLLM-CPU (bf16)
    python3 -m benchmarks.loop --model tiny-llama --backends reference,vllm --steps 20
    # H200, requirement 4: 200 steps of the trained SmolLM2-135M, reference engine on the GPU
    python3 -m benchmarks.loop --model smollm2-135m-instruct --device cuda --steps 200 --lr 1e-5
    # H200: a Qwen3-1.7B-shaped model (random weights, all 28 layers, bf16, fp32 master weights)
    python3 -m benchmarks.loop --shape qwen3-1.7b --layers 28 --dtype bfloat16 --device cuda --steps 200
    # H200, vLLM's weights pushed in GPU memory by CUDA IPC instead of a file reload (needs Ray importable)
    python3 -m benchmarks.loop --shape qwen3-1024 --layers 12 --dtype bfloat16 --device cuda \
        --backends reference,vllm --option vllm.weight_transfer=ipc

It prints `parity loop`'s line per step and backend, then a summary table: the wall time of the
whole run and of the engine starts, the median and total step time per backend (its generate, the
training forward on its rollouts, and its weight push with the digest check), the update's
median time, the peak resident memory of this process and of its engine processes, and the claims:
reference rollouts equal to the training forward bit for bit at every step, every backend verified
in sync at every step, the policy's KL from step 0 at the last step.

A shaped model has random weights, which never write a number: its run rewards the share of
response tokens whose id is even (a dense, verifiable stand-in for the arithmetic check) so that
GRPO has reward variance to learn from and the policy moves. Its checkpoint is generated once
under $PARITY_CACHE/shaped/ with the byte-level tokenizer of the built-in checkpoints (prompts
encode within any vocabulary).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import psutil

from parity.backends import parse_option
from parity.core.types import Rollout
from parity.loop import loop
from parity.loop.command import format_row, header
from parity.runtime.frame import sigterm_interrupts

# before any engine loads (the loop imports vLLM only when it starts a vLLM backend)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def even_token_share(rollout: Rollout) -> float:
    """The shaped models' reward: the share of response tokens with an even id."""
    return sum(t % 2 == 0 for t in rollout.token_ids) / max(len(rollout.token_ids), 1)


def shaped_checkpoint(shape: str, layers: int, dtype: str, device: str) -> Path:
    """A random-weight checkpoint of `shape` with `layers` layers (made once, seeded), with the
    built-in checkpoints' tokenizer."""
    from parity.models import builtin_path
    from parity.models.checkpoints import cache_dir
    from parity.models.shaped import save_random_model, shaped_config

    path = cache_dir() / "shaped" / f"{shape}-{layers}l-{dtype}-loop"
    if not (path / "config.json").is_file():
        save_random_model(shaped_config(shape, layers), path, device=device, dtype=dtype)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(builtin_path("tiny-llama") / name, path / name)
    return path


def _children_rss() -> float:
    """RSS of this process's child processes (vLLM's engine core and workers), MiB."""
    total = 0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # a child that ended meanwhile
            total += child.memory_info().rss
    return total / 2**20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.loop", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama", help="checkpoint (ignored with --shape)")
    p.add_argument("--shape", help="a parity.models.shaped shape with random weights, e.g. qwen3-1.7b")
    p.add_argument("--layers", type=int, default=28, help="layers of the --shape model (default: 28)")
    p.add_argument("--backends", default="reference")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--correction", default="none")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's dtype (default: bfloat16)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--lora-rank", type=int, help="train and push only a LoRA adapter of this rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads of the trainer and the reference engine (default: 1: on a "
                        "shared 2-core machine, OpenMP teams waiting on descheduled threads stall ops)")
    p.add_argument("--option", action="append", default=[], metavar="BACKEND.KEY=VALUE",
                   help="a backend option, e.g. vllm.weight_transfer=ipc (repeatable)")
    p.add_argument("--json", type=Path, help="write the loop's record here")
    p.add_argument("--html", type=Path, help="write the loop's page here")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    options: dict[str, dict[str, object]] = {}
    for item in args.option:
        backend, dot, rest = item.partition(".")
        if not dot:
            p.error(f"--option {item!r}: expected BACKEND.KEY=VALUE, e.g. vllm.weight_transfer=ipc")
        key, value = parse_option(rest)
        options.setdefault(backend, {})[key] = value
    model, reward = args.model, None
    if args.shape:
        model = str(shaped_checkpoint(args.shape, args.layers, args.dtype, args.device))
        reward = even_token_share
    marks: dict[str, float] = {}

    def progress(rows: list[dict]) -> None:
        marks.setdefault("first_step", time.perf_counter())
        marks["engines_rss"] = max(marks.get("engines_rss", 0.0), _children_rss())
        print("\n".join(format_row(r) for r in rows), flush=True)

    print(header(), flush=True)
    began = time.perf_counter()
    with sigterm_interrupts():  # a `timeout` that stops the run leaves its record "interrupted"
        record = loop(model, backends, steps=args.steps, reward=reward, lr=args.lr,
                      correction=args.correction, seed=args.seed, n=args.n, max_tokens=args.max_tokens,
                      prompts=args.prompts, dtype=args.dtype, device=args.device,
                      micro_batch_size=args.micro_batch_size,
                      backend_dtypes={"vllm": args.vllm_dtype} if "vllm" in backends else None,
                      backend_options=options, lora_rank=args.lora_rank, json=args.json, html=args.html,
                      progress=progress)
    wall = time.perf_counter() - began
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(f"\nmodel {model}, backends {backends}, {args.steps} steps, {args.prompts} prompts x n={args.n} x "
          f"{args.max_tokens} tokens, trainer {args.dtype} on {args.device} ({args.threads} threads), "
          f"lr {args.lr}, correction {args.correction}, lora rank {args.lora_rank}, options {options}")
    print(f"wall {wall:.1f} s (starts and step 0: {marks.get('first_step', began) - began:.1f} s); "
          f"peak RSS: this process {peak:.0f} MiB, engine processes {marks.get('engines_rss', 0.0):.0f} MiB "
          "(the most seen after any step)")
    print(f"{'backend':<12} {'median step s':>13} {'total s':>8} {'bitwise every step':>18} "
          f"{'in sync every step':>18} {'max |dlogp|':>11} {'reward first->last':>19}")
    for name in backends:
        rows = record.rows(name)
        seconds = [r["seconds"] for r in rows]
        print(f"{name:<12} {statistics.median(seconds):>13.3f} {sum(seconds):>8.1f} "
              f"{all(r['bitwise'] for r in rows)!s:>18} {all(r['weights_in_sync'] for r in rows)!s:>18} "
              f"{max(r['max_abs_logprob_diff'] for r in rows):>11.3g} "
              f"{rows[0]['reward_mean']:>8.4f} -> {rows[-1]['reward_mean']:.4f}")
    updates = [u["seconds"] for u in record.updates]
    print(f"update: median {statistics.median(updates):.3f} s, total {sum(updates):.1f} s; policy KL from "
          f"step 0 at the last step: {record.steps[-1]['policy_kl_from_start']:.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
