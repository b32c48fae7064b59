"""Fixed-shape float32 GEMMs on CPU, each run by the BLAS library's single-threaded kernel.

What the library (MKL, x86) does that would make a row's bits depend on the batch, measured on
the development machine and proven absent by the bitwise tests in tests/test_kernels.py on
whatever CPU runs them:

- Its kernel and blocking depend on the problem's shape: rows of an [M, K] x [K, N] product
  differ between small and larger M. Every product here has one shape per weight:
  [TILE, K] x [K, width], rows in tiles of TILE (zero rows pad the last tile), the weight's
  columns in blocks of `width` (zero columns pad the last block).
- A single product called with two or more threads may be split across them in a way that
  changes its bits; in a `bmm` of two or more problems each problem runs the sequential kernel
  on one thread, whatever the thread count (seen on [6, 64] x [64, 32] and [32, 576] x
  [576, 1]). So every product is one problem of a `bmm` of at least two (`bmm`; `matmul`
  makes the weight's column blocks its batch).
- Problems whose rows are not whole 64-byte multiples round differently by their place in the
  batch (seen on [2, 32] x [32, 33]): column blocks are multiples of 16 float32 columns, so
  every problem starts at a multiple of 64 bytes from the batch's start.

bf16/fp16 operands are multiplied as float32 copies: the products of bf16 values are exact in
float32 and the sums accumulate in float32, as a bf16 GEMM's do, with one rounding at the end;
on a CPU without native bf16 dot products (AVX2) the float32 GEMM is ~9x faster than the bf16
one (docs/PERF.md). The float32 copy of a weight is cached with the weight.
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


def _cached(store: WeakIdKeyDictionary, weight: torch.Tensor, make: Callable[[], torch.Tensor]
            ) -> torch.Tensor:
    """make() for `weight`, made once per weight and version and dropped with the weight.

    An in-place update through autograd-visible ops (`param.copy_`, `load_state_dict`: the
    version counter moves) or a new storage makes a fresh copy; writing through `.data`
    bypasses the version counter and is not seen.
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
    return _cached(_float32, weight, lambda: weight.detach().to(torch.float32))


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

    return _cached(_blocked, weight, make)


def bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """torch.bmm of a [P, M, K] and b [P, K, N] (float32), run as a batch of at least two problems: a
    lone problem is computed twice (see the module docstring). `out`: a contiguous [P, M, N] float32
    tensor starting on a 64-byte boundary to write the result to."""
    if a.shape[0] == 1:
        lone = torch.bmm(a.expand(2, -1, -1), b.expand(2, -1, -1))[:1]
        return lone if out is None else out.copy_(lone)
    return torch.bmm(a, b) if out is None else torch.bmm(a, b, out=out)


def _tiles(rows: torch.Tensor) -> torch.Tensor:
    """rows [M, K] as float32 tiles [ceil(M / TILE), TILE, K], zero rows padding the last tile.

    Rows that fill whole tiles are used as they are (float32) or as their float32 copy when that
    is contiguous and starts on a 64-byte boundary (operand alignment is one of the things MKL's
    rounding depends on, see the module docstring); anything else is copied into a fresh,
    aligned, zero-padded buffer.
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
    """rows [M, K] (any float dtype, taken as float32) times column blocks [blocks, K, width] ->
    [M, blocks * width], each float32 result rounded once to `dtype`.

    Each output entry comes from one [TILE, K] x [K, width] problem in a batch of at least two:
    the column blocks for each tile, or the tiles for each column block, whichever loop is
    shorter (the same problems either way). Each batch's result goes to its place in the output
    in one copy that also rounds it to `dtype`.
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
    same fixed-shape GEMM problems (two blocks of COLUMN_ALIGN columns)."""
    return _tiled(rows, _ones_column(rows.shape[1], rows.device))[:, :1]


@functools.lru_cache(maxsize=64)
def _ones_column(k: int, device: torch.device) -> torch.Tensor:
    """Column blocks [2, k, COLUMN_ALIGN] of a weight whose first column is ones, the rest zeros."""
    with torch.inference_mode(False):
        ones = torch.zeros(2, k, COLUMN_ALIGN, device=device)
        ones[0, :, 0] = 1
    return ones
