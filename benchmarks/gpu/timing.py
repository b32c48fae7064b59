"""How the sections time and probe: CUDA events, graph replay, host launch cost, row invariance.

Every timing is a median of several runs on the device (CUDA events), with the L2 flushed or the
inputs rotated so repeated calls do not all hit the same cache lines; `graph_ms` removes the host
launch cost, `host_us` measures only it, and `host_timers` splits a generate's host time by part.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from benchmarks.gpu.results import MatmulSpeed, RowInvariance

#: batch sizes M at which row invariance is checked (a row's bits must not depend on M).
INVARIANCE_M = [1, 2, 3, 7, 16, 31, 64, 100, 255, 256, 1000, 2047, 4096]
#: batch sizes M at which matmul speed is measured (decode, small and large prefill).
BENCH_M = [1, 16, 256, 4096]


def bench(fn: Callable[[], Any]) -> float:
    """Median milliseconds of fn (triton's do_bench: CUDA events, L2 flushed between runs)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def rotating(fn: Callable[..., Any], arg_sets: list[tuple]) -> Callable[[], Any]:
    """fn over several input sets in turn, so repeated calls do not all hit the same L2 lines."""
    cycle = itertools.cycle(arg_sets)
    return lambda: fn(*next(cycle))


def graph_replay_ms(graph: torch.cuda.CUDAGraph, repeats: int = 10) -> float:
    """Device ms of one replay of an already captured graph (mean of `repeats`)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def graph_ms(fn: Callable[..., Any], arg_sets: list[tuple]) -> float:
    """Median device milliseconds per call of fn, replayed from one CUDA graph over all arg sets
    (no host launch cost: the kernel's own time)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for args in arg_sets:
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in arg_sets:
            fn(*args)
    graph.replay()
    times = sorted(graph_replay_ms(graph) / len(arg_sets) for _ in range(7))
    return times[len(times) // 2]


def host_us(fn: Callable[..., Any], args: tuple) -> float:
    """Host microseconds to enqueue one call (the launch overhead a decode step pays per linear)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        fn(*args)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / 200 * 1e6


def matmul_tflops(linear: Callable[..., torch.Tensor], n: int, k: int, ms: list[int]) -> MatmulSpeed:
    """TFLOP/s of linear at each M, eager (do_bench) and from a CUDA graph, rotating over 4 weight
    copies (4 x a 2048x6144 weight > L2), plus the host launch cost."""
    eager, graph, host = {}, {}, {}
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(4)]
    for m in ms:
        sets = list(zip([torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)], weights))
        flop = 2 * m * n * k
        eager[m] = flop / bench(rotating(linear, sets)) / 1e9
        graph[m] = flop / graph_ms(linear, sets) / 1e9
        host[m] = host_us(linear, sets[0])
    return MatmulSpeed(eager=eager, graph=graph, host_us=host)


def rows_invariant(linear: Callable[..., torch.Tensor], n: int, k: int) -> RowInvariance:
    """Whether linear(x[:m]) == linear(x)[:m] bitwise for every m in INVARIANCE_M."""
    g = torch.Generator("cuda").manual_seed(n * 7 + k)
    x = torch.randn(max(INVARIANCE_M), k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(torch.bfloat16)
    full = linear(x, w)
    differing = [m for m in INVARIANCE_M if not torch.equal(linear(x[:m], w), full[:m])]
    return RowInvariance(shape=[n, k], invariant=not differing, differing_m=differing)


@contextmanager
def host_timers(parts: dict[str, tuple[Any, str]]) -> Iterator[tuple[dict[str, float], dict[str, int]]]:
    """Wrap each method `owner.name` of `parts` (label -> (owner, name)) to add its host seconds and
    calls under its label; the originals are put back on exit."""
    seconds: dict[str, float] = dict.fromkeys(parts, 0.0)
    calls: dict[str, int] = dict.fromkeys(parts, 0)
    originals = {label: getattr(owner, name) for label, (owner, name) in parts.items()}

    def timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - start
                calls[label] += 1
        return wrapper

    try:
        for label, (owner, name) in parts.items():
            setattr(owner, name, timed(label, originals[label]))
        yield seconds, calls
    finally:
        for label, (owner, name) in parts.items():
            setattr(owner, name, originals[label])
