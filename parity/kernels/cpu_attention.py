"""Batch-invariant causal attention over the slot KV cache on CPU, as two fixed-shape GEMMs per KV block.

Every score and every weighted value of a token comes out of a BLAS product of one fixed shape
in which the token's numbers always sit at the same place, whatever the batch, the chunk or the
span, so the library runs the same code on the same operand positions for that token:

- The cache is read in KEY_BLOCK-position blocks; a key at position p is always column
  p % KEY_BLOCK of block p // KEY_BLOCK.
- For each token, KV head and block, the scores are [HEAD_ROWS, D] x [D, KEY_BLOCK] products
  (the G = Hq / Hkv query heads of that KV head in head order, HEAD_ROWS at a time, zero rows
  padding the last), and the weighted values [HEAD_ROWS, KEY_BLOCK] x [KEY_BLOCK, D + 1]
  products whose extra column of values is all ones, so the same product also gives the
  block's softmax mass. The library's kernel depends on the row count, so the rows are fixed
  rather than G: a head's bits do not depend on how many query heads share its KV head, which
  tensor parallelism changes when it replicates KV heads (TP=4 of 4 query / 2 KV heads leaves
  one query head per KV head on each rank). The products run as batches of problems
  like every CPU GEMM here (`cpu_gemm`: one thread per problem, equal alignment).
- Keys after a token's position get score -inf and exp gives them exact zeros; the max is
  order-free; the per-block products are summed over blocks by `tree_sum`, which whole blocks
  of zeros (a longer span) leave unchanged.

K/V are read once per sequence slot, not once per token: the step's slots are converted to
float32 once per layer, ordered by how many of the step's tokens they hold (most first), and
the tokens are taken in rounds: round j holds the j-th token of every slot that has one, which
are the first n_j slots. One `bmm` per round then pairs token i of the round with slot i's
blocks through a plain strided view of the converted cache. A decode step is one round; a
prefill chunk of L tokens per sequence is L rounds. Everything a step's layers share (the
order, the rounds, the mask) is computed once per step: `_plan` keeps the last plan and reuses
it while slots, positions and span are equal (checked by value).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parity.kernels.cpu import pointwise, tree_sum
from parity.kernels.cpu_gemm import bmm

#: cached positions per attention block: the key width of every attention GEMM (fixed here, not
#: taken from the cache, so that caches of any block size give the same bits).
KEY_BLOCK = 32
#: query heads per attention GEMM problem (zero rows pad the last of a KV head's groups).
HEAD_ROWS = 4
#: head-dim columns of the GEMM operands are padded (with zeros) to a multiple of this (64 bytes of
#: float32), so every problem of a batch starts equally aligned.
ALIGN = 16
#: float32 scores and weighted values one chunk of rounds holds (bounds memory only).
CHUNK_ELEMENTS = 1 << 23


@dataclass(frozen=True, eq=False)
class _Plan:
    """What every layer of a step shares.

    slots, positions [T], span: what the plan was made for (copies). order [T]: the tokens
    round by round (round j: the j-th token of slot 0, 1, ..., n_j - 1 of `slot_order`);
    slot_order [S']: the step's slots, most tokens first; first_slot: slot_order[0] when slot_order
    is consecutive slots (then K/V are read through a view), else None; rounds: (first token in `order`, n_j)
    per round; mask [T, 1, blocks, 1, KEY_BLOCK] in `order` (True: hidden key).
    """

    slots: torch.Tensor
    positions: torch.Tensor
    span: int
    order: torch.Tensor
    slot_order: torch.Tensor
    first_slot: int | None
    rounds: tuple[tuple[int, int], ...]
    mask: torch.Tensor

    @property
    def blocks(self) -> int:
        return self.mask.shape[2]


_last_plan: _Plan | None = None


def _plan(slots: torch.Tensor, positions: torch.Tensor, span: int) -> _Plan:
    """The plan for these tokens: the last one again if slots, positions and span are equal."""
    global _last_plan
    last = _last_plan
    if (last is not None and last.span == span and last.slots.shape == slots.shape
            and torch.equal(last.slots, slots) and torch.equal(last.positions, positions)):
        return last
    t = slots.numel()
    unique, inverse, counts = torch.unique(slots, return_inverse=True, return_counts=True)
    by_count = torch.sort(-counts, stable=True).indices  # slot rank -> index into `unique`
    rank = torch.empty_like(by_count)
    rank[by_count] = torch.arange(by_count.numel(), device=slots.device)
    token_rank = rank[inverse]
    # j: how many of the step's earlier tokens share the token's slot.
    grouped = torch.sort(token_rank, stable=True).indices
    ranked_counts = counts[by_count]
    first = torch.cumsum(ranked_counts, 0) - ranked_counts
    j = torch.empty_like(grouped)
    j[grouped] = torch.arange(t, device=slots.device) - first[token_rank[grouped]]
    order = torch.sort(j * by_count.numel() + token_rank).indices
    per_round = torch.bincount(j).tolist()
    starts = [0]
    for n in per_round[:-1]:
        starts.append(starts[-1] + n)
    blocks = -(-span // KEY_BLOCK)
    key_position = torch.arange(blocks * KEY_BLOCK, device=slots.device).view(1, 1, blocks, 1, KEY_BLOCK)
    slot_order = unique[by_count]
    low = int(slot_order[0])
    consecutive = torch.equal(slot_order, torch.arange(low, low + len(slot_order), device=slots.device))
    plan = _Plan(slots=slots.clone(), positions=positions.clone(), span=span, order=order,
                 slot_order=slot_order, first_slot=low if consecutive else None,
                 rounds=tuple(zip(starts, per_round)),
                 mask=key_position > positions[order].view(t, 1, 1, 1, 1))
    _last_plan = plan
    return plan


def _gather(cache: torch.Tensor, plan: _Plan, width: int, columns: int, ones: bool) -> torch.Tensor:
    """Cached positions [0, width) of the plan's slots as float32 [S', Hkv, width, columns]: the
    cached D values, then a column of ones if `ones`, then zeros (also past the cache's capacity)."""
    _, hkv, capacity, d = cache.shape
    have = min(capacity, width)
    out = torch.empty(plan.slot_order.numel(), hkv, width, columns, dtype=torch.float32, device=cache.device)
    if plan.first_slot is None:
        out[:, :, :have, :d] = cache[:, :, :have].index_select(0, plan.slot_order)
    else:  # consecutive slots (a decode step): convert straight from the cache
        out[:, :, :have, :d] = cache[plan.first_slot:plan.first_slot + out.shape[0], :, :have]
    out[:, :, have:, :d] = 0
    out[..., d:] = 0
    if ones:
        out[..., d] = 1
    return out


def _chunks(rounds: tuple[tuple[int, int], ...], per_token: int) -> list[tuple[int, int, list]]:
    """Consecutive rounds grouped into chunks of at most CHUNK_ELEMENTS / per_token tokens (at least
    one round each): (first token, end token, the chunk's rounds)."""
    chunks: list[tuple[int, int, list]] = []
    limit = max(1, CHUNK_ELEMENTS // per_token)
    for start, n in rounds:
        if chunks and chunks[-1][1] - chunks[-1][0] + n <= limit:
            chunks[-1] = (chunks[-1][0], start + n, [*chunks[-1][2], (start, n)])
        else:
            chunks.append((start, start + n, [(start, n)]))
    return chunks


def attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
              positions: torch.Tensor, span: int, scaling: float, max_run: int | None = None) -> torch.Tensor:
    """Causal attention of each query token over its own sequence's cached K/V.

    query [T, Hq, D]; k_cache, v_cache [S, Hkv, C, D] (S sequence slots, C cached positions);
    slots, positions [T] (int64): the slot and absolute position of each query token; `span`:
    how many cached positions to read (> every position); `max_run` (the switch's signature) is
    not needed: the plan orders tokens by slot itself. Returns [T, Hq, D] in the query
    dtype; the math runs in float32. A token's result does not depend on `span`, on the other
    tokens, or on whether it came in a full forward, a prefill chunk or a decode step.
    """
    t, hq, d = query.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    gp = -(-g // HEAD_ROWS) * HEAD_ROWS
    dk = -(-d // ALIGN) * ALIGN
    dv = -(-(d + 1) // ALIGN) * ALIGN
    plan = _plan(slots, positions, span)
    blocks = plan.blocks
    width = blocks * KEY_BLOCK
    keys = _gather(k_cache, plan, width, dk, ones=False).view(-1, KEY_BLOCK, dk).transpose(1, 2)
    values = _gather(v_cache, plan, width, dv, ones=True).view(-1, KEY_BLOCK, dv)
    groups = gp // HEAD_ROWS
    q = torch.nn.functional.pad(query.to(torch.float32)[plan.order].view(t, hkv, 1, g, d),
                                (0, dk - d, 0, gp - g)).view(t, hkv, 1, groups, HEAD_ROWS, dk)
    out = torch.empty(t, hkv, gp, dv, dtype=torch.float32, device=query.device)
    for lo, hi, rounds in _chunks(plan.rounds, hkv * blocks * gp * (KEY_BLOCK + dv)):
        # Head group first: each (group, round) product writes one contiguous slice in place.
        scores = torch.empty(groups, hi - lo, hkv, blocks, HEAD_ROWS, KEY_BLOCK, dtype=torch.float32,
                             device=query.device)
        weighted = torch.empty(groups, hi - lo, hkv, blocks, HEAD_ROWS, dv, dtype=torch.float32,
                               device=query.device)
        for start, n in rounds:
            rows = slice(start - lo, start - lo + n)
            for group in range(groups):
                a = q[start:start + n, :, :, group].expand(n, hkv, blocks, HEAD_ROWS, dk)
                bmm(a.reshape(-1, HEAD_ROWS, dk), keys[:n * hkv * blocks],
                    out=scores[group, rows].view(-1, HEAD_ROWS, KEY_BLOCK))
        scores.mul_(scaling).masked_fill_(plan.mask[lo:hi], float("-inf"))
        p = pointwise(torch.exp, scores - scores.amax(dim=(3, 5), keepdim=True))
        for start, n in rounds:
            rows = slice(start - lo, start - lo + n)
            for group in range(groups):
                bmm(p[group, rows].view(-1, HEAD_ROWS, KEY_BLOCK), values[:n * hkv * blocks],
                    out=weighted[group, rows].view(-1, HEAD_ROWS, dv))
        out[lo:hi] = tree_sum(weighted, 3).permute(1, 2, 0, 3, 4).reshape(hi - lo, hkv, gp, dv)
    result = torch.empty(t, hkv, g, dv, dtype=torch.float32, device=query.device)
    result[plan.order] = out[:, :, :g]  # the padding rows of each KV head's last problem are dropped
    return (result[..., :d] / result[..., d:d + 1]).reshape(t, hq, d).to(query.dtype)

