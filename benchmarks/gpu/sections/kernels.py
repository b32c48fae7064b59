"""The kernels section: row invariance of each matmul path, and each Triton kernel against torch.

The Triton linear at Qwen3-1.7B weight shapes over many M, the same probe for cuBLASLt with split-K
disabled (in a child process with its environment) and for default cuBLAS (the negative control);
matmul TFLOP/s vs cuBLAS at M in `BENCH_M`, eager and from CUDA-graph replay, with the host launch
cost; attention decode/prefill vs SDPA (the shipped tiles and, for the record, other sizes);
RMSNorm and log-softmax vs torch.
"""

from __future__ import annotations

import os
import subprocess

import torch
import torch.nn.functional as F

from benchmarks.gpu.records import decoded
from benchmarks.gpu.results import (
    AttentionTiming,
    CublasLtProbe,
    KernelsResult,
    KernelTiming,
    MatmulComparison,
)
from benchmarks.gpu.run import ROOT, Run, last_json_line, module_command
from benchmarks.gpu.settings import blas_library, module_constants
from benchmarks.gpu.timing import BENCH_M, bench, matmul_tflops, rows_invariant
from parity.kernels.triton import attention as attention_kernels
from parity.kernels.triton import matmul, rmsnorm, softmax
from parity.kernels.triton.matmul import CUBLASLT_ENV

#: Qwen3-1.7B linear weights [N, K]: q, k/v, o, gate/up, down, lm_head.
QWEN3_LINEARS = [(2048, 2048), (1024, 2048), (6144, 2048), (2048, 6144), (151936, 2048)]
#: the weights whose speed is measured: the MLP's up (gate/up) and down projections.
SPEED_LINEARS = [(6144, 2048), (2048, 6144)]


def cublaslt_child() -> CublasLtProbe:
    """Run in a child process started with CUBLASLT_ENV: row invariance and speed of cuBLASLt, no split-K."""
    with blas_library("cublaslt"):
        return CublasLtProbe(
            env={k: os.environ.get(k) for k in CUBLASLT_ENV},
            invariance=[rows_invariant(F.linear, n, k) for n, k in QWEN3_LINEARS],
            tflops={f"{n}x{k}": matmul_tflops(F.linear, n, k, BENCH_M) for n, k in SPEED_LINEARS},
        )


def _attention() -> dict[str, AttentionTiming]:
    """Decode (256 seqs at context 512) and prefill (256 x 256 tokens) at Qwen3-1.7B heads: SDPA on
    contiguous K/V, the shipped tiles (BLOCK_M query rows, BLOCK_N keys) and other tile sizes."""
    hq, hkv, d, cap = 16, 8, 128, 1024
    kc = torch.randn(256, hkv, cap, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(256, hkv, cap, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(256, hq, d, device="cuda", dtype=torch.bfloat16)
    qp = torch.randn(256 * 256, hq, d, device="cuda", dtype=torch.bfloat16)
    cases = {
        "decode_256x512": (q, torch.arange(256, device="cuda"), torch.full((256,), 511, device="cuda")),
        "prefill_256x256": (qp, torch.arange(256, device="cuda").repeat_interleave(256),
                            torch.arange(256, device="cuda").repeat(256)),
    }
    kd, vd = kc[:, :, :512].contiguous(), vc[:, :, :512].contiguous()
    qs = qp.view(256, 256, hq, d).transpose(1, 2).contiguous()
    ks, vs = kc[:, :, :256].contiguous(), vc[:, :, :256].contiguous()
    sdpa = {
        "decode_256x512": bench(
            lambda: F.scaled_dot_product_attention(q[:, :, None], kd, vd, enable_gqa=True)),
        "prefill_256x256": bench(
            lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)),
    }
    timings: dict[str, AttentionTiming] = {}
    shipped = (attention_kernels.BLOCK_M, attention_kernels.BLOCK_N)
    for name, (query, slots, pos) in cases.items():
        times = {}
        for block_m, block_n in (shipped, (16, 32), (16, 64), (64, 32)):
            with module_constants(attention_kernels, BLOCK_M=block_m, BLOCK_N=block_n):
                times[f"m{block_m}_n{block_n}"] = bench(
                    lambda q=query, s=slots, p=pos: attention_kernels.attention(q, kc, vc, s, p, d**-0.5))
        triton_ms = times[f"m{shipped[0]}_n{shipped[1]}"]
        timings[name] = AttentionTiming(sdpa_ms=sdpa[name], triton_ms=triton_ms,
                                        ratio_sdpa_over_triton=sdpa[name] / triton_ms, tiles=times)
    return timings


def measure(run: Run) -> KernelsResult:
    """See the module docstring."""
    triton_invariance = [rows_invariant(matmul.linear, n, k) for n, k in QWEN3_LINEARS]
    cublas_default_invariance = [rows_invariant(F.linear, n, k) for n, k in QWEN3_LINEARS]
    probe = subprocess.run(module_command("--cublaslt-probe"), cwd=ROOT, env={**os.environ, **CUBLASLT_ENV},
                           capture_output=True, text=True, timeout=300)
    printed = last_json_line(probe.stdout)
    cublaslt = decoded(CublasLtProbe, printed if printed is not None else {"error": probe.stderr[-3000:]})

    # matmul: the shipped plan vs default cuBLAS (cuBLASLt without split-K: the probe above)
    speed = {f"{n}x{k}": MatmulComparison(cublas=matmul_tflops(F.linear, n, k, BENCH_M),
                                          triton=matmul_tflops(matmul.linear, n, k, BENCH_M),
                                          plan=vars(matmul.tile_config(torch.bfloat16, n, k)))
             for n, k in SPEED_LINEARS}
    attention = _attention()

    x = torch.randn(65536, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)

    def hf_rms(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    logits = torch.randn(256, 151936, device="cuda") * 4
    return KernelsResult(
        triton_invariance=triton_invariance,
        cublas_default_invariance=cublas_default_invariance,
        cublaslt_nosplitk=cublaslt,
        matmul=speed,
        attention=attention,
        rmsnorm_65536x2048=KernelTiming(
            triton_ms=bench(lambda: rmsnorm.rms_norm(x, w, 1e-6)), torch_ms=bench(lambda: hf_rms(x)),
            max_abs_diff=float((rmsnorm.rms_norm(x, w, 1e-6).float() - hf_rms(x).float()).abs().max())),
        log_softmax_256x151936_fp32=KernelTiming(
            triton_ms=bench(lambda: softmax.log_softmax(logits)),
            torch_ms=bench(lambda: torch.log_softmax(logits, -1)),
            max_abs_diff=float((softmax.log_softmax(logits) - torch.log_softmax(logits, -1)).abs().max())),
    )
