"""What an offline vLLM-CPU engine costs to start and close in a process that has vLLM imported, with
vLLM's engine core in its own processes (the default: a spawned core and a spawned worker, each
importing vLLM) and in this process (its uni executor, `VLLM_ENABLE_V1_MULTIPROCESSING=0`, how the
test suite runs the engines of its `own_engines` tests; docs/PERF.md, test suite round 8).

Run (it starts engines: nothing else on the machine):
    .venv/bin/python -m benchmarks.engine_start [--model tiny-llama] [--repeats 3]

Alternates the two modes, `--repeats` starts each, and prints a Markdown table: median wall seconds
of the start and of the close, and the CPU seconds of this process and its reaped children.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

MODES = {"engine core in its own processes": "1", "engine core in this process": "0"}


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import vllm.envs  # as in a test process: vLLM is imported before the first engine starts

    from parity.backends import get_backend

    seen: dict[str, dict[str, list[float]]] = {m: {"start": [], "close": [], "cpu": []} for m in MODES}
    for _ in range(args.repeats):
        for mode, value in MODES.items():
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = value
            cpu, t0 = cpu_seconds(), time.perf_counter()
            engine = get_backend("vllm", args.model, dtype="bfloat16")
            t1 = time.perf_counter()
            engine.close()
            t2 = time.perf_counter()
            time.sleep(1.0)  # the spawned processes exit and are reaped, so their CPU counts
            vllm.envs.disable_envs_cache()  # an in-process core caches the variables it started with
            seen[mode]["start"].append(t1 - t0)
            seen[mode]["close"].append(t2 - t1)
            seen[mode]["cpu"].append(cpu_seconds() - cpu)
    print(f"| {args.model}, {args.repeats} starts each | start s | close s | CPU s |")
    print("| --- | --- | --- | --- |")
    for mode, figures in seen.items():
        start, close, cpu = (statistics.median(figures[k]) for k in ("start", "close", "cpu"))
        print(f"| {mode} | {start:.2f} | {close:.2f} | {cpu:.1f} |")


if __name__ == "__main__":
    main()
