"""Batch-invariant CPU kernels built from stock torch ops whose results cannot depend on the batch.

What breaks invariance in stock CPU torch (docs/DESIGN.md) and the fix: GEMM kernel choice
follows shape and threads, so every matmul is a batch of fixed-shape float32 problems
(`cpu_gemm`); threaded reductions have no fixed order, so sums are a `tree_sum` or a ones-vector
GEMM; transcendental ops round differently in the vector body and scalar tail, so `pointwise`
feeds aligned one-thread pieces. +, -, *, / are correctly rounded everywhere. Thread settings are
never changed. tests/test_kernels.py proves each property.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import threading
from collections.abc import Callable, Sequence

import torch

from parity.core.errors import ConfigError
from parity.kernels import cpu_bf16, cpu_gemm
from parity.kernels.cpu_gemm import TILE

#: pointwise inputs are padded to a multiple of this many elements (2 x the widest vector, 32 lanes).
POINTWISE_ALIGN = 64
#: largest piece a pointwise op sees: half of ATen's GRAIN_SIZE (32768 elements), below which
#: TensorIterator runs an op on one thread (MKL's vector-math exp and log may still split a piece;
#: they round every element alike, docs/PERF.md).
POINTWISE_CHUNK = 16384
#: glibc heap settings of a process running the CPU kernels (`keep_freed_memory`): allocations below
#: the first come from the heap, and up to the second of freed heap stays mapped.
HEAP_MMAP_THRESHOLD, HEAP_TRIM_THRESHOLD = 32 << 20, 256 << 20


#: the environment variable that picks ATen's CPU kernels, and what `torch.backends.cpu.get_cpu_capability`
#: names for each value ATen reads (lower case exactly; "default" is "NO AVX" on x86).
CAPABILITY_ENV = "ATEN_CPU_CAPABILITY"
CAPABILITY_NAMES: dict[str, tuple[str, ...]] = {
    "default": ("DEFAULT", "NO AVX"), "avx2": ("AVX2",), "avx512": ("AVX512",), "vsx": ("VSX",),
    "zvector": ("Z VECTOR", "ZVECTOR"), "sve256": ("SVE256",)}


def check_capability() -> None:
    """ConfigError where `CAPABILITY_ENV` is set to a value ATen did not take: it ignores an unknown
    one (a warning only) and runs its own pick, whose vector kernels round other bits than those asked
    for (an "avx2" stand-in for another host would silently be this host)."""
    wanted = os.environ.get(CAPABILITY_ENV)
    if not wanted:  # unset, or set empty: ATen's own pick, as asked
        return
    running = torch.backends.cpu.get_cpu_capability()
    if running not in CAPABILITY_NAMES.get(wanted, ()):
        raise ConfigError(f"{CAPABILITY_ENV}={wanted!r}: ATen ignored it and runs its {running} kernels; "
                          f"set it to one of {list(CAPABILITY_NAMES)} that this CPU and torch build "
                          "support (lower case, as ATen reads it) or unset it")


@functools.cache
def keep_freed_memory() -> bool:
    """Fix glibc's heap thresholds at HEAP_MMAP_THRESHOLD and HEAP_TRIM_THRESHOLD for this process
    (`mallopt`; nothing where the C library has none) and return whether both took. glibc otherwise
    returns a freed heap top above twice its adaptive mmap threshold (at most 64 MB) to the kernel,
    and the kernels' temporaries of several MB, made and freed every step, come back as fresh pages:
    220k-520k page faults per generate call of benchmarks/cpu_engine.py (docs/PERF.md)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(mallopt(m_mmap_threshold, HEAP_MMAP_THRESHOLD)) and bool(
        mallopt(m_trim_threshold, HEAP_TRIM_THRESHOLD))


#: this thread's scratch buffers: name -> (flat buffer, the shape and layout of its last use).
_SCRATCH = threading.local()


def scratch(name: str, shape: tuple[int, ...], device: torch.device, layout: tuple = (),
            dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, bool]:
    """(buffer, fresh): this thread's scratch `name` of `dtype` viewed as `shape`, kept between calls
    (fresh pages otherwise; grown when too small); `fresh` unless its last use had this shape and
    `layout`, whose padding the caller then wrote and which it still holds."""
    numel = math.prod(shape)
    key = (shape, str(device), dtype, *layout)
    kept = getattr(_SCRATCH, name, None)
    if kept is not None and kept[1] == key:
        return kept[0][:numel].view(shape), False
    if kept is None or kept[0].numel() < numel or kept[0].device != device or kept[0].dtype != dtype:
        with torch.inference_mode(False):  # a normal tensor: written in and out of inference mode
            kept = (torch.empty(numel, dtype=dtype, device=device), key)
    setattr(_SCRATCH, name, (kept[0], key))
    return kept[0][:numel].view(shape), True


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` for an elementwise `fn`, every element through the vector body: zero-padded to
    POINTWISE_ALIGN, in pieces of at most POINTWISE_CHUNK (below ATen's grain size: one thread).
    """
    flat = x.reshape(-1).contiguous()
    n = flat.numel()
    pad = (-n) % POINTWISE_ALIGN
    if n + pad <= POINTWISE_CHUNK:
        return fn(torch.cat([flat, flat.new_zeros(pad)]) if pad else flat)[:n].view(x.shape)
    # views of x up to the piece that holds the padding, which alone is copied
    unpadded = (n + pad - 1) // POINTWISE_CHUNK * POINTWISE_CHUNK if pad else n
    pieces = list(flat[:unpadded].split(POINTWISE_CHUNK))
    if pad:
        pieces.append(torch.cat([flat[unpadded:], flat.new_zeros(pad)]))
    return torch.cat([fn(piece) for piece in pieces])[:n].view(x.shape)


def pointwise_(fn_: Callable[[Sequence[torch.Tensor]], object], flat: torch.Tensor) -> torch.Tensor:
    """An elementwise op in place on a flat tensor already padded to POINTWISE_ALIGN (no copy), every
    element through the vector body: `fn_` (an ATen foreach op, `torch._foreach_exp_`) gets the whole
    buffer where `rounds_alike` proved that safe, else its pieces of at most POINTWISE_CHUNK (one op
    each, one Python call); returns `flat`."""
    if flat.dim() != 1 or not flat.is_contiguous() or flat.numel() % POINTWISE_ALIGN:
        raise ValueError(f"pointwise_ needs a flat contiguous tensor of a multiple of {POINTWISE_ALIGN} "
                         f"elements, got shape {tuple(flat.shape)}")
    if rounds_alike(fn_, flat.dtype):
        fn_([flat])  # one op: the pieces' fork-joins cost ~10 us each on two threads
    else:
        fn_(flat.split(POINTWISE_CHUNK))
    return flat


#: integer views for comparing bits (NaN payloads included, -0.0 apart from +0.0). No 16-bit types: an
#: op on them rounds a float32 result, and a tail one float32 ulp apart changes it in ~2^-15 of the
#: elements, too few for a probe to see (bfloat16 SiLU passed one here yet rounds its tail apart).
_BITS = {torch.float64: torch.int64, torch.float32: torch.int32}


def rounds_alike(fn_: Callable[[Sequence[torch.Tensor]], object], dtype: torch.dtype) -> bool:
    """Whether foreach op `fn_` gives every element of `dtype` the same bits over one whole buffer, on
    the process's threads, as in 7-element pieces at two alignments and in POINTWISE_CHUNK pieces: a
    probe of 3 chunks + 61 values over 2^-30 .. 2^30, both signs, run once per thread count. MKL's
    vector math (exp, log, rsqrt in float32 and float64) passes on the hosts measured; ops with a
    scalar tail (sigmoid, SiLU) fail and keep their pieces (docs/PERF.md)."""
    return dtype in _BITS and _proven_alike(fn_, dtype, torch.get_num_threads())


@functools.cache
def _proven_alike(fn_: Callable[[Sequence[torch.Tensor]], object], dtype: torch.dtype, threads: int) -> bool:
    """`rounds_alike`'s probe, on `threads` threads (the process's: part of the cache key)."""
    gen = torch.Generator().manual_seed(0)
    n = 3 * POINTWISE_CHUNK + 61
    magnitude = torch.exp2(torch.rand(n, generator=gen, dtype=torch.float64) * 60 - 30)
    sign = torch.randint(0, 2, (n,), generator=gen) * 2 - 1
    probe = (magnitude * sign).to(dtype)

    def bits(split: Callable[[torch.Tensor], Sequence[torch.Tensor]]) -> torch.Tensor:
        out = probe.clone()
        fn_(split(out))
        return out.view(_BITS[dtype])

    bits(lambda x: [x])  # a first call, discarded: 2 of ~450 fresh processes failed the probe without it
    whole = bits(lambda x: [x])
    return all(torch.equal(whole, bits(split)) for split in (
        lambda x: x.split(7), lambda x: [x[:3], *x[3:].split(7)], lambda x: x.split(POINTWISE_CHUNK)))


def tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False, overwrite: bool = False) -> torch.Tensor:
    """Sum over `dim` by a fixed pairwise tree over x zero-padded to a power of two: the first level
    adds the upper part onto the lower and 0 to the rest (x + 0 == x, but -0.0 + 0 == +0.0, as the
    padding gave), the next levels halve in place, in x itself if `overwrite` (no temporary; the
    result is then never a view of x)."""
    dim = dim % x.dim()
    n = x.shape[dim]
    if n <= 2:  # nothing to pad or to halve in place
        if n == 2:
            total = x.narrow(dim, 0, 1) + x.narrow(dim, 1, 1)
        elif n == 1:
            total = x.clone() if overwrite else x
        else:
            total = x.new_zeros([*x.shape[:dim], 1, *x.shape[dim + 1:]])
        return total if keepdim else total.squeeze(dim)
    if overwrite:
        adds, last = tree_steps(x, dim)
    else:  # the first level into a new buffer, the halvings there
        half = 1 << (n - 1).bit_length() - 1
        paired = n - half
        y = x.new_empty([*x.shape[:dim], half, *x.shape[dim + 1:]])
        torch.add(x.narrow(dim, 0, paired), x.narrow(dim, half, paired), out=y.narrow(dim, 0, paired))
        if paired < half:
            torch.add(x.narrow(dim, paired, half - paired), 0, out=y.narrow(dim, paired, half - paired))
        adds, last = tree_steps(y, dim)
    for into, term in adds:
        into.add_(0 if term is None else term)
    total = last[0] + last[1]
    return total if keepdim else total.squeeze(dim)


def tree_steps(x: torch.Tensor, dim: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor | None]],
                                                   tuple[torch.Tensor, torch.Tensor]]:
    """`tree_sum(x, dim, overwrite=True)` (x.shape[dim] >= 2) as views of x: the in-place adds in
    order, (into, term; None: + 0), and the last pair, whose sum is the total. Views kept by a caller
    that sums the same buffer again (the attention's blocks, layer after layer)."""
    n = x.shape[dim]
    adds: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    if n > 2:
        half = 1 << (n - 1).bit_length() - 1
        paired = n - half
        y = x.narrow(dim, 0, half)
        adds.append((y.narrow(dim, 0, paired), x.narrow(dim, half, paired)))
        if paired < half:
            adds.append((y.narrow(dim, paired, half - paired), None))
        while half > 2:
            half //= 2
            adds.append((y.narrow(dim, 0, half), y.narrow(dim, half, half)))
    return adds, (x.narrow(dim, 0, 1), x.narrow(dim, 1, 1))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias) -> [..., N], each row independent: fixed [TILE, K]
    problems, bf16 on AMX or AVX-512 BF16 where proven (`cpu_bf16`), else float32
    (`cpu_gemm.matmul`), rounded once.
    """
    if x.dtype == torch.bfloat16 and x.numel():
        out = cpu_bf16.linear(x, weight, bias)
        if out is not None:
            return out
    k = x.shape[-1]
    n_out = weight.shape[0]
    rows = x.reshape(-1, k)
    if rows.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], n_out)
    if bias is None:
        return cpu_gemm.matmul(rows, weight, x.dtype).reshape(*x.shape[:-1], n_out)
    # A separate elementwise add in float32: a fused addmm would round differently per kernel.
    out = cpu_gemm.matmul(rows, weight) + bias
    return out.to(x.dtype).reshape(*x.shape[:-1], n_out)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm with a fixed-order mean: sums of squares as a ones-column GEMM (`cpu_gemm.row_sums`),
    1 / sqrt(mean + eps) over a zero-padded `pointwise_` buffer."""
    k = x.shape[-1]
    xf = x.to(torch.float32)
    sums = cpu_gemm.row_sums((xf * xf).reshape(-1, k))
    m = sums.shape[0]
    rstd = sums.new_zeros(m + (-m) % POINTWISE_ALIGN)
    torch.div(sums.view(-1), k, out=rstd[:m]).add_(eps)
    pointwise_(torch._foreach_rsqrt_, rstd)
    # the float32 product rounded once to x's dtype, as (xf * rstd).to(dtype)
    normed = torch.mul(xf, rstd[:m].view(*x.shape[:-1], 1), out=torch.empty_like(x))
    return weight * normed


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + delta), residual + delta): the two ops as they are (one pass only on CUDA)."""
    total = residual + delta
    return rms_norm(total, weight, eps), total


def _exp_shifted(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e, max): e = exp(x - max) [..., V] over the last dim, in a buffer zero-padded to POINTWISE_ALIGN
    (`pointwise_`: every element in the vector body)."""
    n = x.numel()
    flat = torch.empty(n + (-n) % POINTWISE_ALIGN, dtype=x.dtype, device=x.device)
    flat[n:].zero_()
    e = flat[:n].view(x.shape)
    top = x.amax(-1, keepdim=True)
    torch.sub(x, top, out=e)
    pointwise_(torch._foreach_exp_, flat)
    return e, top


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim; masked (-inf) entries give exact zeros."""
    e, _ = _exp_shifted(x)
    return e.div_(tree_sum(e, -1, keepdim=True))


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the last dim: (x - max) - log(sum(exp(x - max)))."""
    e, top = _exp_shifted(x)
    total = tree_sum(e, -1, keepdim=True, overwrite=True)
    # x - max again into the same buffer: the same bits as keeping it, one buffer fewer
    return torch.sub(x, top, out=e).sub_(pointwise(torch.log, total))


def cumsum(x: torch.Tensor) -> torch.Tensor:
    """Inclusive cumsum over the last dim [..., V] in x's dtype: ATen's CPU scan is already per-row
    float64 front to back, rounded once (a bitwise test holds it to that).
    """
    return torch.cumsum(x, dim=-1)


def activation(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """An elementwise activation module/function applied position-independently."""
    return pointwise(fn, x)


def gated(fn: Callable[[torch.Tensor], torch.Tensor], gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """fn(gate) * up: the activation position-independently, the product exact-rounded per element."""
    return pointwise(fn, gate) * up


def topk(scores: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) [..., k], ties to the lower index (stable sort; `torch.topk` leaves tie order
    unspecified); values renormalized if `normalize`.
    """
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    values, indices = values[..., :k], indices[..., :k]
    if normalize:
        values = values / tree_sum(values, -1, keepdim=True)
    return values, indices


def experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
            act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """SwiGLU experts as one grouped GEMM with a fixed combine order: hidden [N, H] -> [N, H].

    top_k_index, top_k_weights [N, k]; gate_up_proj [E, 2I, H]; down_proj [E, H, I]. Each expert's
    rows are packed into [TILE, H] tiles of one float32 bmm (`cpu_gemm.bmm`), so a row meets the same
    problem whatever else was routed; a token's k slots are summed in slot order.
    """
    n, k = top_k_index.shape
    num_experts = gate_up_proj.shape[0]
    flat = top_k_index.reshape(-1)
    order = torch.sort(flat, stable=True).indices  # (token, slot) rows grouped by expert
    counts = torch.bincount(flat, minlength=num_experts)
    tiles_per_expert = (counts + TILE - 1) // TILE
    start = torch.cumsum(counts, 0) - counts
    tile_start = torch.cumsum(tiles_per_expert, 0) - tiles_per_expert
    expert_sorted = flat[order]
    rank = torch.arange(flat.numel()) - start[expert_sorted]
    dest = tile_start[expert_sorted] * TILE + rank  # row of each routed (token, slot) in the tiles
    tile_expert = torch.repeat_interleave(torch.arange(num_experts), tiles_per_expert)
    rows = hidden.new_zeros(tile_expert.numel() * TILE, hidden.shape[-1])
    rows[dest] = hidden[order // k]
    # Float32 products rounded to the model's dtype, as HF's expert GEMMs round their outputs.
    tiles = rows.view(-1, TILE, hidden.shape[-1]).to(torch.float32)
    gate_up = cpu_gemm.bmm(tiles, cpu_gemm.float32(gate_up_proj)[tile_expert].transpose(1, 2))
    gate, up = gate_up.to(hidden.dtype).chunk(2, dim=-1)
    inner = (act(gate) * up).to(torch.float32)
    out = cpu_gemm.bmm(inner, cpu_gemm.float32(down_proj)[tile_expert].transpose(1, 2))
    out = out.to(hidden.dtype).view(-1, hidden.shape[-1])
    slots = hidden.new_zeros(n * k, hidden.shape[-1])
    # Same dtype promotion as HF: the weights may be fp32 (Mixtral) while `out` is bf16.
    slots[order] = (out[dest] * top_k_weights.reshape(-1)[order].unsqueeze(1)).to(hidden.dtype)
    slots = slots.view(n, k, -1)
    combined = slots[:, 0]
    for j in range(1, k):
        combined = combined + slots[:, j]
    return combined


def rotary(forward: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
           x: torch.Tensor, position_ids: torch.Tensor, max_positions: int,
           tables: dict[tuple[torch.dtype, str], tuple[torch.Tensor, torch.Tensor]],
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, L, D] gathered from a per-(dtype, device) table of the model's own rotary over every
    position, so a position's row never depends on the call (vector body vs scalar tail).
    """
    key = (x.dtype, str(x.device))
    if key not in tables:
        everything = torch.arange(max_positions, device=x.device).unsqueeze(0)
        cos, sin = forward(x, everything)
        tables[key] = (cos[0], sin[0])
    cos, sin = tables[key]
    return cos[position_ids], sin[position_ids]


def apply_rotary(native: Callable[..., tuple[torch.Tensor, torch.Tensor]], q: torch.Tensor,
                 k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own rotation: multiplies and adds are exact IEEE operations in every CPU code path
    (vector body or scalar tail alike), so stock is invariant here."""
    return native(q, k, cos, sin, unsqueeze_dim)

