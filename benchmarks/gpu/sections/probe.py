"""The probe section: the load-time matmul probe (`parity.kernels.probe`) in a child process set up
for cuBLASLt (and a fresh PARITY_CACHE), over the linear shapes of Qwen3-1.7B, Llama-3.2-1B and
Qwen3-30B-A3B: the route each shape takes, probe time cold and cached, a spot check of row
invariance, TFLOP/s routed vs Triton.
"""

from __future__ import annotations

import os
import subprocess
import time

import torch

from benchmarks.gpu.records import decoded
from benchmarks.gpu.results import Failure, ProbedFamily, ProbeResult, RoutedSpeed
from benchmarks.gpu.run import ROOT, Run, last_json_line, module_command
from benchmarks.gpu.settings import blas_library
from benchmarks.gpu.timing import BENCH_M, matmul_tflops, rows_invariant
from parity.kernels.triton import matmul
from parity.kernels.triton.matmul import CUBLASLT_ENV, cublaslt_ready
from parity.models import shaped

#: model families whose linear shapes the probe section routes (layers: 1, only shapes matter).
PROBE_FAMILIES = ("qwen3-1.7b", "llama-3.2-1b", "qwen3-30b-a3b")


def linear_shapes(shape: str) -> list[tuple[int, int, bool]]:
    """Distinct (N, K, has_bias) of a shaped model's nn.Linear weights (built on the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shaped.shaped_config(shape, 1))
    return sorted({(m.weight.shape[0], m.weight.shape[1], m.bias is not None)
                   for m in model.modules() if isinstance(m, torch.nn.Linear)})


def _family(shapes: list[tuple[int, int, bool]]) -> ProbedFamily:
    """One family's shapes through the probe, cold and then from the on-disk cache."""
    todo = {(torch.bfloat16, n, k) for n, k, bias in shapes if not bias}
    start = time.perf_counter()
    matmul.prepare(todo, torch.device("cuda"))
    cold = time.perf_counter() - start
    matmul.forget_verdicts(todo)
    start = time.perf_counter()
    matmul.prepare(todo, torch.device("cuda"))
    warm = time.perf_counter() - start
    routes = {f"{n}x{k}{'+bias' if bias else ''}": matmul.route(torch.bfloat16, n, k, bias)
              for n, k, bias in shapes}
    spot = [rows_invariant(matmul.linear, n, k) for n, k, bias in shapes if not bias]
    speed = {f"{n}x{k}": RoutedSpeed(routed=matmul_tflops(matmul.linear, n, k, BENCH_M),
                                     triton=matmul_tflops(lambda x, w: matmul.launch(
                                         x, w, None, matmul.tile_config(x.dtype, *w.shape)), n, k, BENCH_M))
             for n, k, bias in shapes if not bias and n * k <= 8192 * 8192 and n > 256}
    return ProbedFamily(probe_cold_s=cold, probe_cached_s=warm, routes=routes, spot_check=spot,
                        tflops_graph=speed)


def probe_child() -> ProbeResult:
    """In a child process started with CUBLASLT_ENV (and a fresh PARITY_CACHE): the load-time probe over
    each family's shapes, cold and from the cache, the routes it chose, a spot check of row
    invariance on other random data, and TFLOP/s of the routed linear vs the Triton kernel."""
    env = {k: os.environ.get(k) for k in CUBLASLT_ENV}
    with blas_library("cublaslt"):
        ready = cublaslt_ready()
        families = {family: _family(linear_shapes(family)) for family in PROBE_FAMILIES}
    return ProbeResult(env=env, cublaslt_ready=ready, families=families)


def measure(run: Run) -> ProbeResult | Failure:
    """See the module docstring."""
    cache = run.tmp / "probe-cache"
    proc = subprocess.run(module_command("--probe-child"), cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **CUBLASLT_ENV, "PARITY_CACHE": str(cache)}, timeout=400)
    printed = last_json_line(proc.stdout)
    return decoded(ProbeResult, printed if printed is not None else {"error": proc.stderr[-3000:]})
