"""Batch-invariant causal attention over the slot KV cache on CPU, as two fixed-shape GEMMs per KV block.

Every score and weighted value comes from a BLAS product of one fixed shape with the token at a
fixed place: keys in KEY_BLOCK blocks by absolute position; scores [HEAD_ROWS, D] x [D, KEY_BLOCK]
(HEAD_ROWS fixed rather than G, since tensor parallelism changes query heads per KV head); values
[HEAD_ROWS, KEY_BLOCK] x [KEY_BLOCK, D + 1] whose ones column gives the softmax mass. Masked keys
are exact zeros; blocks are summed by `tree_sum`. K/V are converted once per slot per layer and
tokens taken in rounds (one `bmm` each); `_plan` is reused across a step's layers.
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
    """What every layer of a step shares: the tokens `order` [T] round by round, `slot_order` (most
    tokens first; `first_slot` when consecutive, read through a view), `rounds` (first token, n_j),
    and `mask` [T, 1, blocks, 1, KEY_BLOCK] (True: hidden).
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
    """Cached positions [0, width) of the plan's slots as float32 [S', Hkv, width, columns] (a ones
    column if `ones`, then zeros).
    """
    _, hkv, capacity, d = cache.shape
    have = min(capacity, width)
    out = torch.empty(plan.slot_order.numel(), hkv, width, columns, dtype=torch.float32, device=cache.device)
    if plan.first_slot is None:
        out[:, :, :have, :d] = cache[:, :, :have].index_select(0, plan.slot_order)
    else:  # consecutive slots (a decode step): convert straight from the cache
        out[:, :, :have, :d] = cache[plan.first_slot:plan.first_slot + out.shape[0], :, :have]
    if have < width:
        out[:, :, have:, :d] = 0
    if columns > d:  # one broadcast copy of the padding columns (two strided fills cost twice as much)
        out[..., d:] = _tail(columns - d, ones, cache.device)
    return out


_TAILS: dict[tuple[int, bool, str], torch.Tensor] = {}


def _tail(width: int, ones: bool, device: torch.device) -> torch.Tensor:
    """The padding columns of a K/V row [width] float32: zeros, led by a one if `ones` (cached)."""
    key = (width, ones, str(device))
    if key not in _TAILS:
        tail = torch.zeros(width, dtype=torch.float32, device=device)
        tail[0] = float(ones)
        _TAILS[key] = tail
    return _TAILS[key]


def _chunks(rounds: tuple[tuple[int, int], ...], per_token: int) -> list[tuple[int, int, list]]:
    """Rounds grouped into chunks of at most CHUNK_ELEMENTS / per_token tokens: (first, end, rounds)."""
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
    """Causal attention of each query [T, Hq, D] over its own slot's K/V [S, Hkv, C, D] -> [T, Hq, D]
    (float32 math). `span` > every position; `max_run` is unused. A token's result depends on
    neither span, other tokens nor the phase.
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

