"""Batch-invariant causal attention over the slot KV cache on CPU, as two fixed-shape GEMMs per KV block.

Every score and every weighted value comes out of a BLAS product of one fixed shape, whatever
the batch, the chunk or the span, so the library runs the same code on every token:

- Tokens are grouped into tiles of QUERY_TILE tokens of one sequence slot (`query_tiles`: a
  prefill chunk of L tokens fills L / QUERY_TILE tiles, a decode token has a tile of its own).
  A tile's operand for one KV head is [QUERY_TILE * G, D]: its tokens' G = Hq / Hkv query
  heads of that KV head (padding rows are zeros at position 0).
- The cache is read in KEY_BLOCK-position blocks. Scores are [QUERY_TILE * G, D] x
  [D, KEY_BLOCK] products; weighted values are [QUERY_TILE * G, KEY_BLOCK] x
  [KEY_BLOCK, D + 1] products whose last column of values is all ones, so the same product
  also gives the block's softmax mass.
- Keys after a token's position get score -inf and exp gives them exact zeros; the max is
  order-free; the per-block products are summed over blocks by `tree_sum`, which whole blocks
  of zeros (a longer span) leave unchanged.

K/V are gathered once per tile (not once per token) and converted to float32 on the way.
Everything a step's layers share (the tiles, the mask) is computed once per step: `_plan`
keeps the last plan and reuses it while slots, positions and span are equal (checked by value).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parity.kernels.cpu import pointwise, tree_sum
from parity.kernels.switch import register

#: cached positions per attention block: the key width of every attention GEMM (fixed here, not
#: taken from the cache, so that caches of any block size give the same bits).
KEY_BLOCK = 32
#: tokens of one sequence per query tile: every attention GEMM has QUERY_TILE x G rows.
QUERY_TILE = 2
#: float32 K/V elements one chunk of tiles gathers (bounds memory only; tiles never interact).
CHUNK_ELEMENTS = 1 << 22


def query_tiles(slots: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cut each run of consecutive tokens with the same slot into tiles of `size` tokens.

    slots [T] int64 -> (tile [T], row [T], tile_slot [n_tiles]): token i is row `row[i]` of tile
    `tile[i]`, whose tokens all belong to slot `tile_slot[tile[i]]`; the last tile of a run is
    padded.
    """
    t = slots.numel()
    starts = torch.ones(t, dtype=torch.bool, device=slots.device)
    starts[1:] = slots[1:] != slots[:-1]
    first = torch.nonzero(starts).squeeze(1)
    run = torch.cumsum(starts, 0) - 1
    offset = torch.arange(t, device=slots.device) - first[run]
    lengths = torch.diff(first, append=first.new_tensor([t]))
    per_run = (lengths + size - 1) // size
    base = torch.cumsum(per_run, 0) - per_run
    return base[run] + offset // size, offset % size, slots[first].repeat_interleave(per_run)


@dataclass(frozen=True, eq=False)
class _Plan:
    """What every layer of a step shares: tiles, the causal mask, the chunks of tiles.

    tile, row [T]; tile_slot [n]; alone: every tile holds one token, in token order (a decode
    step with QUERY_TILE 1), so no token needs moving; mask [n, 1, blocks, rows, KEY_BLOCK]
    (True: hidden key); chunks: (lo, hi) tile ranges.
    """

    slots: torch.Tensor
    positions: torch.Tensor
    span: int
    shape: tuple[int, int, int]
    tile: torch.Tensor
    row: torch.Tensor
    tile_slot: torch.Tensor
    alone: bool
    mask: torch.Tensor
    chunks: tuple[tuple[int, int], ...]

    @property
    def blocks(self) -> int:
        return self.mask.shape[2]


_last_plan: _Plan | None = None


def _plan(slots: torch.Tensor, positions: torch.Tensor, span: int, hkv: int, g: int, d: int) -> _Plan:
    """The plan for these tokens: the last one if slots, positions, span and heads are equal."""
    global _last_plan
    shape = (hkv, g, d)
    last = _last_plan
    if (last is not None and last.span == span and last.shape == shape and last.slots.shape == slots.shape
            and torch.equal(last.slots, slots) and torch.equal(last.positions, positions)):
        return last
    tile, row, tile_slot = query_tiles(slots, QUERY_TILE)
    n = tile_slot.numel()
    blocks = -(-span // KEY_BLOCK)
    # Padding rows sit at position 0: one visible key, so finite scores; their outputs are dropped.
    row_position = positions.new_zeros(n, QUERY_TILE)
    row_position[tile, row] = positions
    row_position = row_position.repeat_interleave(g, dim=1).view(n, 1, 1, QUERY_TILE * g, 1)
    key_position = torch.arange(blocks * KEY_BLOCK, device=slots.device).view(1, 1, blocks, 1, KEY_BLOCK)
    step = max(1, CHUNK_ELEMENTS // (hkv * blocks * KEY_BLOCK * (d + 1)))
    plan = _Plan(slots=slots.clone(), positions=positions.clone(), span=span, shape=shape, tile=tile,
                 row=row, tile_slot=tile_slot, alone=QUERY_TILE == 1 and n == slots.numel(),
                 mask=key_position > row_position,
                 chunks=tuple((lo, min(n, lo + step)) for lo in range(0, n, step)))
    _last_plan = plan
    return plan


def _gather(cache: torch.Tensor, slots: torch.Tensor, width: int, ones: bool) -> torch.Tensor:
    """Cached positions [0, width) of `slots` as float32 [c, Hkv, width, D (+ 1)]: zeros past the
    cache's capacity; with `ones` an extra last column of ones."""
    _, hkv, capacity, d = cache.shape
    have = min(capacity, width)
    out = torch.empty(slots.numel(), hkv, width, d + ones, dtype=torch.float32, device=cache.device)
    out[:, :, :have, :d] = cache[:, :, :have].index_select(0, slots)
    if have < width:
        out[:, :, have:, :d] = 0
    if ones:
        out[..., d] = 1
    return out


def attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
              positions: torch.Tensor, span: int, scaling: float) -> torch.Tensor:
    """Causal attention of each query token over its own sequence's cached K/V.

    query [T, Hq, D]; k_cache, v_cache [S, Hkv, C, D] (S sequence slots, C cached positions);
    slots, positions [T] (int64): the slot and absolute position of each query token; `span`:
    how many cached positions to read (> every position). Returns [T, Hq, D] in the query
    dtype; the math runs in float32. A token's result does not depend on `span`, on the other
    tokens, or on whether it came in a full forward, a prefill chunk or a decode step.
    """
    _, hq, d = query.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    rows = QUERY_TILE * g
    plan = _plan(slots, positions, span, hkv, g, d)
    n, blocks = plan.tile_slot.numel(), plan.blocks
    width = blocks * KEY_BLOCK
    if plan.alone:
        q = query.to(torch.float32)
    else:
        q = query.new_zeros(n, QUERY_TILE, hq, d, dtype=torch.float32)
        q[plan.tile, plan.row] = query.to(torch.float32)
    # Row r of a tile's operand: token r // G of the tile, query head r % G of the KV head.
    q = q.view(n, QUERY_TILE, hkv, g, d).transpose(1, 2).reshape(n, hkv, 1, rows, d)
    out = torch.empty(n, hkv, rows, d + 1, dtype=torch.float32, device=query.device)
    for lo, hi in plan.chunks:
        c = hi - lo
        keys = _gather(k_cache, plan.tile_slot[lo:hi], width, ones=False)
        values = _gather(v_cache, plan.tile_slot[lo:hi], width, ones=True)
        a = q[lo:hi].expand(c, hkv, blocks, rows, d).reshape(-1, rows, d)
        scores = torch.bmm(a, keys.view(-1, KEY_BLOCK, d).transpose(1, 2)) * scaling
        scores = scores.view(c, hkv, blocks, rows, KEY_BLOCK).masked_fill(plan.mask[lo:hi], float("-inf"))
        p = pointwise(torch.exp, scores - scores.amax(dim=(2, 4), keepdim=True))
        weighted = torch.bmm(p.view(-1, rows, KEY_BLOCK), values.view(-1, KEY_BLOCK, d + 1))
        out[lo:hi] = tree_sum(weighted.view(c, hkv, blocks, rows, d + 1), 2)
    out = (out[..., :d] / out[..., d:]).view(n, hkv, QUERY_TILE, g, d).transpose(1, 2)
    out = out.reshape(n, QUERY_TILE, hq, d)
    return (out.view(n, hq, d) if plan.alone else out[plan.tile, plan.row]).to(query.dtype)


register("attention", "attention", "cpu", attention)
