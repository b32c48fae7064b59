"""Fixed-shape float32 GEMMs on CPU, each run by the BLAS library's single-threaded kernel.

What MKL does that would tie a row's bits to the batch (tests/test_kernels.py proves it absent):
kernel and blocking follow the shape, so products are [TILE, K] x [K, width] with zero padding; a
lone product may split across threads, so every product is one problem of a `bmm` of two or more
(one thread each); rows not 64-byte aligned round by their place, so column blocks are multiples
of 16 float32. bf16/fp16 are multiplied as cached float32 copies (exact products, float32 sums,
one rounding; ~9x a bf16 GEMM on AVX2, docs/PERF.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

#: rows per GEMM tile.
TILE = 32
#: widest column block of a weight; a weight has an even number (>= 2) of blocks, so the two
#: threads of a 2-core machine get equal shares of a one-tile (decode) product.
COLUMN_BLOCK = 256
#: column blocks are multiples of this many columns (64 bytes of float32).
COLUMN_ALIGN = 16

#: weight -> ((version, data pointer), float32 copy) for `float32` and `weight_blocks`.
_float32: WeakIdKeyDictionary = WeakIdKeyDictionary()
_blocked: WeakIdKeyDictionary = WeakIdKeyDictionary()


def per_version(store: WeakIdKeyDictionary, weight: torch.Tensor, make: Callable[[], torch.Tensor]
                ) -> torch.Tensor:
    """make() once per weight and version, dropped with the weight (writes through `.data` skip the
    version counter and are not seen).
    """
    key = (weight._version, weight.data_ptr())
    cached = store.get(weight)
    if cached is None or cached[0] != key:
        # A normal tensor even when made under inference_mode, so autograd code may use it too.
        with torch.inference_mode(False):
            cached = (key, make())
        store[weight] = cached
    return cached[1]


def float32(weight: torch.Tensor) -> torch.Tensor:
    """`weight` itself if float32, else its cached float32 copy (4 bytes per parameter)."""
    if weight.dtype == torch.float32:
        return weight
    return per_version(_float32, weight, lambda: weight.detach().to(torch.float32))


def column_split(n: int) -> tuple[int, int]:
    """(blocks, width) for a weight of n output columns: an even number >= 2 of blocks of `width`
    columns (a multiple of COLUMN_ALIGN); an exact split of n when a near one exists."""
    blocks = max(2, -(-n // COLUMN_BLOCK))
    blocks += blocks % 2
    for candidate in range(blocks, 2 * blocks + 1, 2):
        if n % candidate == 0 and (n // candidate) % COLUMN_ALIGN == 0:
            return candidate, n // candidate
    return blocks, -(-n // (blocks * COLUMN_ALIGN)) * COLUMN_ALIGN


def weight_blocks(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] as float32 column blocks [blocks, K, width] (`column_split(N)`): a view of a
    float32 weight that splits exactly, else a cached float32 copy with zero columns padding the
    last block (4 bytes per parameter for a bf16/fp16 model)."""
    n, k = weight.shape
    blocks, width = column_split(n)
    if weight.dtype == torch.float32 and blocks * width == n:
        return weight.view(blocks, width, k).transpose(1, 2)

    def make() -> torch.Tensor:
        padded = weight.new_zeros(blocks * width, k, dtype=torch.float32)
        padded[:n] = weight.detach()
        return padded.view(blocks, width, k).transpose(1, 2)

    return per_version(_blocked, weight, make)


def bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """torch.bmm of a [P, M, K] and b [P, K, N] (float32), run as a batch of at least two problems: a
    lone problem is computed twice (see the module docstring). `out`: a contiguous [P, M, N] float32
    tensor starting on a 64-byte boundary to write the result to."""
    if a.shape[0] == 1:
        lone = torch.bmm(a.expand(2, -1, -1), b.expand(2, -1, -1))[:1]
        return lone if out is None else out.copy_(lone)
    return torch.bmm(a, b) if out is None else torch.bmm(a, b, out=out)


def _tiles(rows: torch.Tensor) -> torch.Tensor:
    """rows [M, K] as float32 tiles [ceil(M / TILE), TILE, K], zero-padded; copied unless already whole,
    contiguous and 64-byte aligned (MKL's rounding depends on alignment).
    """
    m, k = rows.shape
    tiles = -(-m // TILE)
    if m == tiles * TILE:
        whole = rows.to(torch.float32)
        if whole.is_contiguous() and whole.data_ptr() % 64 == 0:
            return whole.view(tiles, TILE, k)
    padded = torch.empty(tiles * TILE, k, dtype=torch.float32, device=rows.device)
    padded[:m] = rows
    padded[m:] = 0
    return padded.view(tiles, TILE, k)


def _tiled(rows: torch.Tensor, blocked: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """rows [M, K] times column blocks [blocks, K, width] -> [M, blocks * width], rounded once to
    `dtype`: each entry from one [TILE, K] x [K, width] problem in a batch of at least two.
    """
    m = rows.shape[0]
    a = _tiles(rows)
    tiles, _, k = a.shape
    blocks, _, width = blocked.shape
    out = torch.empty(tiles, TILE, blocks, width, dtype=dtype, device=rows.device)
    if tiles <= blocks:
        for i in range(tiles):
            out[i].copy_(torch.bmm(a[i:i + 1].expand(blocks, TILE, k), blocked).transpose(0, 1))
    else:
        for j in range(blocks):
            out[:, :, j].copy_(torch.bmm(a, blocked[j:j + 1].expand(tiles, k, width)))
    out = out.view(tiles * TILE, blocks * width)
    return out if tiles * TILE == m else out[:m]


def matmul(rows: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """rows [M, K] (taken as float32) @ weight [N, K].T -> [M, N], accumulated in float32 and rounded
    once to `dtype`; each row independent of the others."""
    out = _tiled(rows, weight_blocks(weight), dtype)
    return out if out.shape[1] == weight.shape[0] else out[:, :weight.shape[0]]


def row_sums(rows: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim of rows [M, K] float32 -> [M, 1]: the product with a ones column in the
    fixed-shape GEMM problems [TILE, K] x [K, COLUMN_ALIGN] (a lone tile taken twice, against the
    ones block and a zero block: a lone problem may split across threads)."""
    a = _tiles(rows)
    tiles, _, k = a.shape
    ones = _ones_column(k, rows.device)
    if tiles == 1:
        sums = torch.bmm(a.expand(2, TILE, k), ones)[0]
    else:
        sums = torch.bmm(a, ones[:1].expand(tiles, k, COLUMN_ALIGN)).view(tiles * TILE, COLUMN_ALIGN)
    return sums[:rows.shape[0], :1]


@functools.lru_cache(maxsize=64)
def _ones_column(k: int, device: torch.device) -> torch.Tensor:
    """Column blocks [2, k, COLUMN_ALIGN] of a weight whose first column is ones, the rest zeros."""
    with torch.inference_mode(False):
        ones = torch.zeros(2, k, COLUMN_ALIGN, device=device)
        ones[0, :, 0] = 1
    return ones
