"""Requests/s and output tokens/s through vLLM's server (`vllm-server`) vs the offline engine (`vllm`).

Run: .venv/bin/python benchmarks/server_throughput.py [--model tiny-llama] [--requests 256]
     [--max-tokens 64] [--repeats 3] [--concurrency 64] [--server-args "--skip-tokenizer-init"]

Both engines start on the same checkpoint and dtype with the same engine settings (parity's
defaults for each backend), then the same workload (random byte-token prompts of 8-48 tokens,
temperature 1.0, `ignore_eos`, so every request yields exactly `--max-tokens` tokens) runs through
each in turn, `--repeats` times, alternating, so both see the same machine load. What is timed is
one `generate` call: for the offline engine a single `LLM.generate` over every request; for the
server every request in flight at once up to `--concurrency`, over HTTP on loopback, with parity's
JSON parsing. Prints a Markdown table of medians and the server/offline ratio (docs/PERF.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from parity.backends import get_backend
from parity.core.types import Request, SamplingParams


def workload(count: int, max_tokens: int, seed: int = 0) -> list[Request]:
    """`count` prompts of 8-48 random byte tokens, one sample each, exactly `max_tokens` out."""
    rng = np.random.Generator(np.random.PCG64(seed))
    sampling = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    return [Request(tuple(int(t) for t in rng.integers(3, 259, size=int(rng.integers(8, 49)))),
                    sampling.replace(seed=i), f"q{i}") for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--server-args", default="", help="extra `vllm serve` flags for the server")
    args = parser.parse_args()

    requests = workload(args.requests, args.max_tokens)
    starts, engines = {}, {}
    server_options = {"concurrency": args.concurrency, "server_args": args.server_args}
    for name, options in (("vllm", {}), ("vllm-server", server_options)):
        t0 = time.perf_counter()
        engines[name] = get_backend(name, args.model, dtype=args.dtype, **options)
        starts[name] = time.perf_counter() - t0
    try:
        for engine in engines.values():
            engine.generate(requests[:8])  # warm-up
        seconds: dict[str, list[float]] = {name: [] for name in engines}
        tokens: dict[str, int] = {}
        for _ in range(args.repeats):
            for name, engine in engines.items():
                t0 = time.perf_counter()
                rollouts = engine.generate(requests)
                seconds[name].append(time.perf_counter() - t0)
                tokens[name] = sum(len(r.token_ids) for r in rollouts)
    finally:
        for engine in engines.values():
            engine.close()

    print(f"model {args.model} {args.dtype}; {args.requests} requests x {args.max_tokens} output tokens; "
          f"server concurrency {args.concurrency}, server args {args.server_args!r}; "
          f"median of {args.repeats}\n")
    print("| backend | start (s) | median s | requests/s | output tokens/s |")
    print("| --- | --- | --- | --- | --- |")
    rates = {}
    for name in engines:
        median = statistics.median(seconds[name])
        rates[name] = (args.requests / median, tokens[name] / median)
        requests_s, tokens_s = rates[name]
        print(f"| `{name}` | {starts[name]:.1f} | {median:.2f} | {requests_s:.1f} | {tokens_s:.0f} |")
    ratio = rates["vllm-server"][1] / rates["vllm"][1]
    print(f"\nvllm-server / vllm output tokens/s: {ratio:.2f}; all times "
          f"{ {name: [round(s, 2) for s in v] for name, v in seconds.items()} }")


if __name__ == "__main__":
    main()
