"""Batch-invariant linear layer on CUDA: a persistent Triton matmul with one tile plan per weight.

Row-invariant by construction: the tile plan is a function of (dtype, N, K), never M; no
split-K (one program accumulates its K chunks in ascending order in fp32); bias added before the
single rounding; fp32 multiplies in IEEE, never TF32. TMA + wgmma, persistent grouped grid; it
trails cuBLAS at decode sizes. A bias-free shape that passed the load-time probe
(`parity.kernels.probe`) runs on cuBLASLt without split-K, in a process set up for it
(`cublaslt_ready`); the choice never depends on M. `route` says which and why (`parity kernels`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from parity.core.errors import ConfigError, InputError
from parity.kernels.probe import Verdict, VerdictCache, cache_path, fingerprint, probe_rows
from parity.kernels.triton.mma import mma

#: process environment that disables cuBLASLt's split-K (no workspace to reduce partial sums in).
CUBLASLT_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}
#: (dtype, N, K) -> the load-time probe's verdict for cuBLASLt without split-K in this process.
_verdicts: dict[tuple[torch.dtype, int, int], Verdict] = {}


def cublaslt_ready() -> bool:
    """Whether this process runs cuBLASLt with split-K disabled (see the module docstring)."""
    return all(os.environ.get(key) == value for key, value in CUBLASLT_ENV.items()) and (
        torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
    )


def configure_cublaslt() -> None:
    """Set this process up for the cuBLASLt route (`CUBLASLT_ENV`, cuBLASLt preferred), as an engine
    process would be; the workspace variables only take effect before CUDA starts."""
    changed = any(os.environ.get(key) != value for key, value in CUBLASLT_ENV.items())
    if changed and torch.cuda.is_initialized():
        raise ConfigError(f"configure_cublaslt: CUDA already started without {CUBLASLT_ENV}; set them in the "
                          "environment before the process starts")
    os.environ.update(CUBLASLT_ENV)
    torch.backends.cuda.preferred_blas_library("cublaslt")


def prepare(shapes: Iterable[tuple[torch.dtype, int, int]], device: torch.device) -> None:
    """Probe each bias-free weight shape (dtype, N, K) for cuBLASLt row invariance (cached on disk);
    nothing in a process not set up for cuBLASLt. Call outside CUDA-graph capture.
    """
    if not cublaslt_ready():
        return
    todo = sorted({s for s in shapes if s[0] in (torch.bfloat16, torch.float16)} - set(_verdicts), key=str)
    if not todo:
        return
    cache = VerdictCache(cache_path())
    fp = fingerprint(device, CUBLASLT_ENV)
    for dtype, n, k in todo:
        verdict = cache.get(fp, dtype, n, k)
        if verdict is None:
            with torch.cuda.device(device):
                verdict = probe_rows(F.linear, dtype, n, k, device)
            cache.put(fp, verdict, dtype)
        _verdicts[(dtype, n, k)] = verdict


def forget_verdicts(shapes: Iterable[tuple[torch.dtype, int, int]]) -> None:
    """Drop this process's verdicts for `shapes` (dtype, N, K): the next `prepare` reads them from the
    on-disk cache again (or probes), as a fresh process would; until then they take the Triton kernel."""
    for shape in shapes:
        _verdicts.pop(shape, None)


def route(dtype: torch.dtype, n: int, k: int, has_bias: bool) -> tuple[str, str]:
    """(path, why) of a CUDA linear with weight [n, k] in `dtype`: "cublaslt" or "triton"."""
    if has_bias:
        return "triton", "has a bias (the probe covers bias-free products only)"
    if not cublaslt_ready():
        return "triton", (f"process not set up for cuBLASLt without split-K (set {CUBLASLT_ENV} before CUDA "
                          "starts, then torch.backends.cuda.preferred_blas_library('cublaslt'))")
    verdict = _verdicts.get((dtype, n, k))
    if verdict is None:
        return "triton", "not probed in this process (probes run when a model loads on CUDA)"
    return ("cublaslt" if verdict.invariant else "triton"), verdict.reason()


@dataclass(frozen=True)
class TileConfig:
    """One fixed launch plan: tile sizes, L2 grouping, pipeline depth and warps."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_stages: int
    num_warps: int


def tile_config(dtype: torch.dtype, n: int, k: int) -> TileConfig:
    """The one tile plan for a weight [n, k] in `dtype`; M is deliberately not an argument. bf16/fp16:
    128x128x64, four TMA stages (N 64 for n <= 64); fp32: smaller tiles (IEEE FMA, no wgmma).
    """
    if dtype in (torch.bfloat16, torch.float16):
        block_n = 64 if n <= 64 else 128
        return TileConfig(block_m=128, block_n=block_n, block_k=64, group_m=8, num_stages=4, num_warps=8)
    if dtype == torch.float32:
        return TileConfig(block_m=64, block_n=64, block_k=32, group_m=8, num_stages=3, num_warps=4)
    raise InputError(f"linear: dtype {dtype} is not supported by the CUDA kernel; use bf16, fp16 or fp32")


@triton.jit(do_not_specialize=["M"])
def _linear_persistent_kernel(
    x_desc,
    w_desc,
    out_desc,
    bias_ptr,
    M,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Persistent loop over output tiles; each tile is one full-K fp32 accumulation (no split-K)."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_group = GROUP_M * num_pid_n
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        # Grouped order: GROUP_M row-tiles share each weight column-tile while it sits in L2.
        group = tile // tiles_per_group
        first_m = group * GROUP_M
        group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % tiles_per_group) % group_size
        pid_n = (tile % tiles_per_group) // group_size
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(k_tiles):
            a = x_desc.load([off_m, kt * BLOCK_K])
            b = w_desc.load([off_n, kt * BLOCK_K])
            acc = mma(a, b.T, acc)
        if HAS_BIAS:
            offs_n = off_n + tl.arange(0, BLOCK_N)
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        out_desc.store([off_m, off_n], acc.to(out_desc.dtype))


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device`: the program count of the persistent kernels."""
    if device.type != "cuda":  # the Triton CPU interpreter: any fixed count does
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N], row-invariant (Triton, or a probed
    cuBLASLt shape). TMA needs K * itemsize and N * itemsize multiples of 16.
    """
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise InputError(f"linear: x {x.dtype}, weight {weight.dtype} and bias must share one dtype")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise InputError(f"linear: x has {x.shape[-1]} features but weight [N, K] has K={k}")
    elt = x.element_size()
    if (k * elt) % 16 or (n * elt) % 16:
        raise InputError(f"linear: K={k} and N={n} must be multiples of {16 // elt} for TMA row alignment")
    if bias is None and x.is_cuda and cublaslt_ready():
        verdict = _verdicts.get((x.dtype, n, k))
        if verdict is not None and verdict.invariant:
            return F.linear(x, weight)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    out = launch(x2, weight, bias, tile_config(x.dtype, n, k))
    return out.reshape(*lead, n)


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: TileConfig) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias) with an explicit plan (tests use it to vary the plan)."""
    x = x if x.is_contiguous() else x.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    m, n = x.shape[0], w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    x_desc = TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k])
    out_desc = TensorDescriptor.from_tensor(out, [cfg.block_m, cfg.block_n])
    num_tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    _linear_persistent_kernel[(min(num_sms(x.device), num_tiles),)](
        x_desc,
        w_desc,
        out_desc,
        bias if bias is not None else out,
        m,
        n,
        w.shape[1],
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        num_stages=cfg.num_stages,
        num_warps=cfg.num_warps,
    )
    return out
