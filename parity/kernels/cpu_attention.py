"""Batch-invariant causal attention over the slot KV cache on CPU, as two fixed-shape GEMMs per KV block.

Every score and every weighted value of a token comes out of a BLAS product of one fixed shape
in which the token's numbers always sit at the same place, whatever the batch, the chunk or the
span, so the library runs the same code on the same operand positions for that token:

- The cache is read in KEY_BLOCK-position blocks; a key at position p is always column
  p % KEY_BLOCK of block p // KEY_BLOCK.
- For each token, KV head and block, the scores are one [G, D] x [D, KEY_BLOCK] product (the
  G = Hq / Hkv query heads of that KV head, always in head order), and the weighted values one
  [G, KEY_BLOCK] x [KEY_BLOCK, D + 1] product whose extra column of values is all ones, so the
  same product also gives the block's softmax mass. The products run as batches of problems
  like every CPU GEMM here (`cpu_gemm`: one thread per problem, equal alignment).
- Keys after a token's position get score -inf and exp gives them exact zeros; the max is
  order-free; the per-block products are summed over blocks by `tree_sum`, which whole blocks
  of zeros (a longer span) leave unchanged.

A token's K/V blocks are gathered from its slot and converted to float32 on the way (BLAS needs
each product's operands in place). Everything a step's layers share (the mask, the chunks) is
computed once per step: `_plan` keeps the last plan and reuses it while slots, positions and
span are equal (checked by value).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parity.kernels.cpu import pointwise, tree_sum
from parity.kernels.cpu_gemm import bmm
from parity.kernels.switch import register

#: cached positions per attention block: the key width of every attention GEMM (fixed here, not
#: taken from the cache, so that caches of any block size give the same bits).
KEY_BLOCK = 32
#: head-dim columns of the GEMM operands are padded (with zeros) to a multiple of this (64 bytes).
ALIGN = 16
#: float32 K/V elements one chunk of tokens gathers (bounds memory only; tokens never interact).
CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True, eq=False)
class _Plan:
    """What every layer of a step shares: slots, positions [T] and span it was made for (copies),
    the causal mask [T, 1, blocks, 1, KEY_BLOCK] (True: hidden key) and the (lo, hi) token chunks."""

    slots: torch.Tensor
    positions: torch.Tensor
    span: int
    mask: torch.Tensor
    chunks: tuple[tuple[int, int], ...]

    @property
    def blocks(self) -> int:
        return self.mask.shape[2]


_last_plan: _Plan | None = None


def _plan(slots: torch.Tensor, positions: torch.Tensor, span: int, per_token: int) -> _Plan:
    """The plan for these tokens (`per_token`: K/V elements gathered per token and position): the
    last one again if slots, positions and span are equal."""
    global _last_plan
    last = _last_plan
    if (last is not None and last.span == span and last.slots.shape == slots.shape
            and torch.equal(last.slots, slots) and torch.equal(last.positions, positions)):
        return last
    t = slots.numel()
    blocks = -(-span // KEY_BLOCK)
    key_position = torch.arange(blocks * KEY_BLOCK, device=slots.device).view(1, 1, blocks, 1, KEY_BLOCK)
    step = max(1, CHUNK_ELEMENTS // (blocks * KEY_BLOCK * per_token))
    plan = _Plan(slots=slots.clone(), positions=positions.clone(), span=span,
                 mask=key_position > positions.view(t, 1, 1, 1, 1),
                 chunks=tuple((lo, min(t, lo + step)) for lo in range(0, t, step)))
    _last_plan = plan
    return plan


def _gather(cache: torch.Tensor, slots: torch.Tensor, width: int, columns: int, ones: bool) -> torch.Tensor:
    """Cached positions [0, width) of `slots` as float32 [c, Hkv, width, columns]: the cached D
    values, then a column of ones if `ones`, then zeros (also past the cache's capacity)."""
    _, hkv, capacity, d = cache.shape
    have = min(capacity, width)
    out = cache.new_zeros(slots.numel(), hkv, width, columns, dtype=torch.float32)
    out[:, :, :have, :d] = cache[:, :, :have].index_select(0, slots)
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
    t, hq, d = query.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    # Operand rows of whole 64-byte multiples: every problem of a batch starts equally aligned.
    dk = -(-d // ALIGN) * ALIGN
    dv = -(-(d + 1) // ALIGN) * ALIGN
    plan = _plan(slots, positions, span, hkv * (dk + dv))
    blocks = plan.blocks
    width = blocks * KEY_BLOCK
    q = query.to(torch.float32).view(t, hkv, 1, g, d)
    if dk > d:
        q = torch.nn.functional.pad(q, (0, dk - d))
    out = torch.empty(t, hkv, g, dv, dtype=torch.float32, device=query.device)
    for lo, hi in plan.chunks:
        c = hi - lo
        keys = _gather(k_cache, slots[lo:hi], width, dk, ones=False)
        values = _gather(v_cache, slots[lo:hi], width, dv, ones=True)
        a = q[lo:hi].expand(c, hkv, blocks, g, dk).reshape(-1, g, dk)
        scores = bmm(a, keys.view(-1, KEY_BLOCK, dk).transpose(1, 2)) * scaling
        scores = scores.view(c, hkv, blocks, g, KEY_BLOCK).masked_fill(plan.mask[lo:hi], float("-inf"))
        p = pointwise(torch.exp, scores - scores.amax(dim=(2, 4), keepdim=True))
        weighted = bmm(p.view(-1, g, KEY_BLOCK), values.view(-1, KEY_BLOCK, dv))
        out[lo:hi] = tree_sum(weighted.view(c, hkv, blocks, g, dv), 2)
    return (out[..., :d] / out[..., d:d + 1]).reshape(t, hq, d).to(query.dtype)


register("attention", "attention", "cpu", attention)
