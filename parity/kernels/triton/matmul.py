"""Batch-invariant linear layer on CUDA: a persistent Triton matmul with one tile plan per weight.

Row-invariant by construction: the tile plan is a function of (dtype, N, K); no split-K (one
program accumulates its K chunks in ascending order in fp32); bias added before the single
rounding; fp32 multiplies in IEEE, never TF32. TMA + wgmma, persistent grouped grid. Short steps
(decode) take a latency plan of smaller tiles only for a shape where `prepare` proved, on the
probe's cancelling rows, that it gives the same bits as the plan of long steps. A bias-free shape
that passed the load-time probe (`parity.kernels.probe`) runs on cuBLASLt without split-K, in a
process set up for it (`cublaslt_ready`); that choice never depends on M, and longer products
run there in pieces of at most the probe's rows (`cublaslt_linear`). `route` says which.
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
from parity.kernels.probe import PROBE_MAX_M, Verdict, VerdictCache, cache_path, fingerprint, probe_rows
from parity.kernels.triton.mma import mma

#: process environment that disables cuBLASLt's split-K (no workspace to reduce partial sums in).
CUBLASLT_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}
#: (device, dtype, N, K) -> the load-time probe's verdict for cuBLASLt without split-K in this process.
#: Every proof below is keyed by the device it ran on (`device_key`): another GPU (another model, a
#: MIG slice beside a full card) may choose other kernels, so it proves its own.
_verdicts: dict[tuple[torch.device, torch.dtype, int, int], Verdict] = {}
#: steps of at most this many rows take `decode_config` where it is proven (`prove_plans`).
DECODE_ROWS = 512
#: the widest weight (outputs) that takes `decode_config`.
DECODE_MAX_N = 4096
#: rows the plan proofs slice (both plans meet well below it: the decode plan stops at DECODE_ROWS).
PLAN_PROOF_ROWS = 4096
#: (device, dtype, N, K) -> whether `decode_config` gave `tile_config`'s bits on the probe's rows.
_plans_agree: dict[tuple[torch.device, torch.dtype, int, int], bool] = {}
#: (device, dtype, K, (N0, N1, N2)) -> whether one launch of the three weights (`linear3`) gave each
#: weight's own `linear` bits on the probe's rows.
_groups_agree: dict[tuple[torch.device, torch.dtype, int, tuple[int, ...]], bool] = {}


def device_key(device: torch.device | str) -> torch.device:
    """The device a proof is kept under, with its index ("cuda" alone: the current device). A tensor's
    own device (every linear asks) is returned as it is: a str key would cost ~1.5 us a call."""
    if isinstance(device, torch.device) and (device.index is not None or device.type != "cuda"):
        return device
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _proven(cache: dict, where: torch.device) -> set:
    """The keys of `cache` proven on device `where`, without the device."""
    return {key[1:] for key in cache if key[0] == where}


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
    """Prove the decode plan of each weight shape (dtype, N, K) (`prove_plans`), and probe each for
    cuBLASLt row invariance (cached on disk; not in a process not set up for cuBLASLt). Call outside
    CUDA-graph capture.
    """
    shapes = set(shapes)
    prove_plans(shapes, device)
    if not cublaslt_ready():
        return
    where = device_key(device)
    todo = sorted({s for s in shapes if s[0] in (torch.bfloat16, torch.float16)} - _proven(_verdicts, where),
                  key=str)
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
        _verdicts[(where, dtype, n, k)] = verdict


def prove_plans(shapes: Iterable[tuple[torch.dtype, int, int]], device: torch.device) -> None:
    """For each shape with a `decode_config` not yet proven in this process: whether the linear that takes
    `decode_config` up to DECODE_ROWS rows and `tile_config` above is row-invariant on the probe's
    cancelling rows (slices of 1..PLAN_PROOF_ROWS rows: both plans meet), where any other
    summation order shows."""
    if torch.device(device).type != "cuda":
        return  # the CPU interpreter runs neither plan for speed
    where = device_key(device)
    todo = sorted({s for s in shapes if decode_config(*s) is not None} - _proven(_plans_agree, where),
                  key=str)
    for dtype, n, k in todo:
        with torch.cuda.device(device):
            verdict = probe_rows(_by_rows, dtype, n, k, device, max_m=PLAN_PROOF_ROWS)
        _plans_agree[(where, dtype, n, k)] = verdict.invariant


def prove_groups(groups: Iterable[tuple[torch.dtype, int, tuple[int, ...]]], device: torch.device) -> None:
    """For each group of three weights (dtype, K, (N0, N1, N2)) not yet proven in this process (q/k/v
    of one layer): whether the product of their stacked weight that takes `linear3` up to DECODE_ROWS
    rows and each weight's own `linear` above is row-invariant on the probe's cancelling rows (slices
    of 1..PLAN_PROOF_ROWS rows): then `linear3` gives each weight the bits of its `linear`."""
    if torch.device(device).type != "cuda":
        return
    where = device_key(device)
    for dtype, k, ns in sorted(set(groups) - _proven(_groups_agree, where), key=str):
        if dtype not in (torch.bfloat16, torch.float16) or k % 8 or any(n % 8 for n in ns):
            _groups_agree[(where, dtype, k, ns)] = False  # the decode plans' dtypes; `linear`'s 16-byte rows
            continue
        prove_plans([(dtype, n, k) for n in ns], device)
        with torch.cuda.device(device):
            verdict = probe_rows(functools.partial(_by_group, ns), dtype, sum(ns), k, device,
                                 max_m=PLAN_PROOF_ROWS)
        _groups_agree[(where, dtype, k, ns)] = verdict.invariant


def _by_group(ns: tuple[int, ...], x: torch.Tensor, stacked: torch.Tensor) -> torch.Tensor:
    """The product of `prove_groups`: one `launch3` of the stacked weight's parts up to DECODE_ROWS
    rows, each part's `linear` above, unconditionally."""
    parts = stacked.split(ns)
    if x.shape[0] <= DECODE_ROWS:
        return torch.cat(launch3(x, parts, GROUP_PLAN), dim=1)
    return torch.cat([linear(x, w) for w in parts], dim=1)


def _by_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The linear of `prove_plans`: each plan by x's row count, unconditionally."""
    return launch(x, weight, None, _by_row_count(x.dtype, *weight.shape, x.shape[0]))


def forget_verdicts(shapes: Iterable[tuple[torch.dtype, int, int]]) -> None:
    """Drop this process's verdicts for `shapes` (dtype, N, K), on every device: the next `prepare`
    reads them from the on-disk cache again (or probes), as a fresh process would; until then they
    take the Triton kernel."""
    shapes = set(shapes)
    for key in [key for key in _verdicts if key[1:] in shapes]:
        del _verdicts[key]


def _misaligned(dtype: torch.dtype, n: int, k: int) -> str | None:
    """Why `linear` refuses weight [n, k] in `dtype` (TMA rows of 16 bytes), or None where it runs it."""
    elt = dtype.itemsize
    if (k * elt) % 16 or (n * elt) % 16:
        return f"K={k} and N={n} must be multiples of {16 // elt} for TMA row alignment"
    return None


def route(dtype: torch.dtype, n: int, k: int, has_bias: bool,
          device: torch.device | str = "cuda") -> tuple[str, str]:
    """(path, why) of a linear with weight [n, k] in `dtype` on CUDA `device` (default: the current one):
    "cublaslt", "triton", or "refused" for a weight `linear` raises InputError on (as a run with the
    matmul family on does)."""
    misaligned = _misaligned(dtype, n, k)
    if misaligned:
        return "refused", (f"{misaligned}: the invariant linear raises InputError on it; run with the matmul "
                           "family off (stock F.linear, not batch-invariant)")
    if has_bias:
        return "triton", "has a bias (the probe covers bias-free products only)"
    if not cublaslt_ready():
        return "triton", (f"process not set up for cuBLASLt without split-K (set {CUBLASLT_ENV} before CUDA "
                          "starts, then torch.backends.cuda.preferred_blas_library('cublaslt'))")
    verdict = _verdicts.get((device_key(device), dtype, n, k))
    if verdict is None:
        return "triton", "not probed on this device in this process (probes run when a model loads on CUDA)"
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


def decode_config(dtype: torch.dtype, n: int, k: int) -> TileConfig | None:
    """The latency plan of short steps, or None: 64x64 tiles over 128-wide K chunks, six TMA stages,
    one warpgroup, for bf16/fp16 weights of at most DECODE_MAX_N outputs, whose 128x128 tiles leave
    most SMs idle at decode sizes (on H100 at 256 rows: 1.7-1.8x faster for N 1024-2048; for
    N 6144 and the lm_head 0.94x and 0.74x, so not there)."""
    if dtype in (torch.bfloat16, torch.float16) and n <= DECODE_MAX_N:
        return TileConfig(block_m=64, block_n=64, block_k=128, group_m=8, num_stages=6, num_warps=4)
    return None


#: the plan of a grouped launch (`linear3`): at 256 rows q/k/v of Qwen3-1.7B are one wave of 128
#: tiles on an H100's 132 SMs, 12.1 us against 17.3 us for three launches of the decode plan.
GROUP_PLAN = TileConfig(block_m=64, block_n=128, block_k=128, group_m=1, num_stages=4, num_warps=4)


def _by_row_count(dtype: torch.dtype, n: int, k: int, m: int) -> TileConfig:
    """`decode_config` for m <= DECODE_ROWS where the shape has one, else `tile_config`."""
    short = decode_config(dtype, n, k) if m <= DECODE_ROWS else None
    return short or tile_config(dtype, n, k)


def plan_for(dtype: torch.dtype, n: int, k: int, m: int, device: torch.device | str) -> TileConfig:
    """The plan of an [m, k] x [k, n] product on `device`: by its row count (`_by_row_count`) where
    proven there."""
    if _plans_agree.get((device_key(device), dtype, n, k), False):
        return _by_row_count(dtype, n, k, m)
    return tile_config(dtype, n, k)


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


def _on_cublaslt(dtype: torch.dtype, n: int, k: int, device: torch.device | str) -> bool:
    """Whether a bias-free [n, k] product on `device` takes the probed cuBLASLt route in this process."""
    if not cublaslt_ready():
        return False
    verdict = _verdicts.get((device_key(device), dtype, n, k))
    return verdict is not None and verdict.invariant


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N], row-invariant (Triton, or a probed
    cuBLASLt shape). TMA needs K * itemsize and N * itemsize multiples of 16.
    """
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise InputError(f"linear: x {x.dtype}, weight {weight.dtype} and bias must share one dtype")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise InputError(f"linear: x has {x.shape[-1]} features but weight [N, K] has K={k}")
    misaligned = _misaligned(x.dtype, n, k)
    if misaligned:
        raise InputError(f"linear: {misaligned}")
    if bias is None and x.is_cuda and _on_cublaslt(x.dtype, n, k, x.device):
        return cublaslt_linear(x, weight)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    out = launch(x2, weight, bias, plan_for(x.dtype, n, k, x2.shape[0], x.device))
    return out.reshape(*lead, n)


def cublaslt_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear of x [..., K] in pieces of at most PROBE_MAX_M rows: the probe proved row counts up to
    it, while a longer product (a training batch, a step of the engine's 8192-token budget) could
    take a kernel it never saw. Each piece starts at a multiple of PROBE_MAX_M rows, so its pointer
    alignment is the probe's offset 0."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] <= PROBE_MAX_M:
        return F.linear(x, weight)
    out = torch.cat([F.linear(part, weight) for part in x2.split(PROBE_MAX_M)])
    return out.reshape(*x.shape[:-1], weight.shape[0])


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


@triton.jit(do_not_specialize=["M"])
def _linear3_kernel(x_ptr, w0, w1, w2, o0, o1, o2, M, N0, N1, N2, K, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Persistent loop over the output tiles of three weights [N_i, K] of one input x [M, K], weight by
    weight; each tile is one full-K fp32 accumulation, as `_linear_persistent_kernel`. Pointer loads,
    not TMA: the weight is a scalar choice per tile, so one loop (and one set of buffers) serves all."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    end0 = num_pid_m * tl.cdiv(N0, BLOCK_N)
    end1 = end0 + num_pid_m * tl.cdiv(N1, BLOCK_N)
    num_tiles = end1 + num_pid_m * tl.cdiv(N2, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        first = tile < end0
        second = (tile >= end0) & (tile < end1)
        local = tl.where(first, tile, tl.where(second, tile - end0, tile - end1))
        n = tl.where(first, N0, tl.where(second, N1, N2))
        w = tl.where(first, w0, tl.where(second, w1, w2))
        out = tl.where(first, o0, tl.where(second, o1, o2))
        rm = (local % num_pid_m) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (local // num_pid_m) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            # entries out of range load as zeros, as TMA fills them: x + 0 * w leaves a sum unchanged
            a = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + kk[None, :],
                        mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(w + rn[:, None].to(tl.int64) * K + kk[None, :],
                        mask=(rn[:, None] < n) & (kk[None, :] < K), other=0.0)
            acc = mma(a, b.T, acc)
        tl.store(out + rm[:, None].to(tl.int64) * n + rn[None, :], acc.to(out.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < n))


def linear3(x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> list[torch.Tensor] | None:
    """[x [..., K] @ w.T for w in weights], three bias-free weights [N_i, K] in x's dtype, in one launch,
    where `prove_groups` proved the group and x has at most DECODE_ROWS rows (short steps: three
    launches there each leave most SMs idle); None elsewhere: take `linear` per weight, same bits."""
    k = x.shape[-1]
    key = (device_key(x.device), x.dtype, k, tuple(w.shape[0] for w in weights))
    x2 = x.reshape(-1, k)
    if x2.shape[0] > DECODE_ROWS or not _groups_agree.get(key, False):
        return None
    if any(_on_cublaslt(x.dtype, *w.shape, x.device) for w in weights):
        return None  # a weight on the probed cuBLASLt route keeps that route's bits
    return [out.reshape(*x.shape[:-1], out.shape[1]) for out in launch3(x2, weights, GROUP_PLAN)]


def launch3(x: torch.Tensor, weights: tuple[torch.Tensor, ...], cfg: TileConfig) -> list[torch.Tensor]:
    """x [M, K] @ w.T for three weights [N_i, K] in one launch of plan `cfg`."""
    x = x if x.is_contiguous() else x.contiguous()
    weights = tuple(w if w.is_contiguous() else w.contiguous() for w in weights)
    m = x.shape[0]
    outs = [torch.empty((m, w.shape[0]), dtype=x.dtype, device=x.device) for w in weights]
    if m == 0:
        return outs
    num_tiles = triton.cdiv(m, cfg.block_m) * sum(triton.cdiv(w.shape[0], cfg.block_n) for w in weights)
    _linear3_kernel[(min(num_sms(x.device), num_tiles),)](
        x, *weights, *outs, m, *(w.shape[0] for w in weights), x.shape[1],
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_stages=cfg.num_stages, num_warps=cfg.num_warps,
    )
    return outs
