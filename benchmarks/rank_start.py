"""What a CPU tensor-parallel group costs to start: the reference engine at TP 2 and 4, its ranks
forked by the caller's zygote (`parity.parallel.zygote`). The first group of a process starts the
zygote (one import of torch, transformers and parity's engine: what every rank paid when ranks were
fresh interpreters, docs/PERF.md test suite round 10); every later group forks from it.

Run (nothing else on the machine):
    .venv/bin/python -m benchmarks.rank_start [--model tiny-llama] [--repeats 3]

Each degree runs in a fresh child process (its first group is a cold start); prints a Markdown
table: wall seconds of the first start and the median of the later ones, and the CPU seconds of
each (this process's and those of every process under it, read before the close).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from benchmarks.engine_start import descendants_cpu_seconds, own_cpu_seconds


def measure(model: str, tp: int, repeats: int) -> list[tuple[float, float]]:
    """(start wall s, start CPU s) of `repeats` + 1 TP=`tp` engine starts in this process."""
    from parity.backends import get_backend

    seen = []
    for _ in range(repeats + 1):
        cpu, t0 = own_cpu_seconds() + descendants_cpu_seconds(), time.perf_counter()
        engine = get_backend("reference", model, tensor_parallel_size=tp)
        seen.append((time.perf_counter() - t0, own_cpu_seconds() + descendants_cpu_seconds() - cpu))
        engine.close()
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tp", type=int, help=argparse.SUPPRESS)  # one degree, in a child
    args = parser.parse_args()
    if args.tp:
        print(json.dumps(measure(args.model, args.tp, args.repeats)))
        return
    print(f"| {args.model}, reference engine | first start s | its CPU s | later starts s (median of "
          f"{args.repeats}) | their CPU s |")
    print("| --- | --- | --- | --- | --- |")
    for tp in (2, 4):
        done = subprocess.run([sys.executable, "-m", "benchmarks.rank_start", "--model", args.model,
                               "--repeats", str(args.repeats), "--tp", str(tp)],
                              capture_output=True, text=True, check=True)
        (first, first_cpu), *later = json.loads(done.stdout.splitlines()[-1])
        print(f"| TP={tp} | {first:.2f} | {first_cpu:.1f} | {statistics.median(t for t, _ in later):.2f} | "
              f"{statistics.median(c for _, c in later):.1f} |")


if __name__ == "__main__":
    main()
