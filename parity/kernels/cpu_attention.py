"""Batch-invariant causal attention over the slot KV cache on CPU, as two fixed-shape GEMMs per KV block.

Every score and weighted value comes from a BLAS product of one fixed shape with the token at a
fixed place: keys in KEY_BLOCK blocks by absolute position; scores [HEAD_ROWS, D] x [D, KEY_BLOCK]
(HEAD_ROWS fixed rather than G, since tensor parallelism changes query heads per KV head); values
[HEAD_ROWS, KEY_BLOCK] x [KEY_BLOCK, D + 1] whose ones column gives the softmax mass. Masked keys
are exact zeros; blocks are summed by `tree_sum`. K/V are converted once per slot per layer and
tokens taken in rounds (one `bmm` each); `_plan` is reused across a step's layers, and so are the
views of its operands (`_operands`). The float32 operands and products live in per-thread scratch
buffers kept between calls (`cpu.scratch`): fresh pages otherwise, and the padding of K/V and
queries is written only when their layout changes.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass

import torch

from parity.kernels.cpu import pointwise_, scratch, tree_steps
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
    """What every layer of a step shares: the tokens `order` [T] round by round (`inverse` [T] puts
    them back; None when `order` is the identity), `slot_order` (most tokens first; `first_slot`
    when consecutive, read through a view), `rounds` (first token, n_j), `bias` [T, 1, blocks, 1,
    KEY_BLOCK] float32 added to the scaled scores (-inf hides a key, -0.0 keeps every score's bits:
    x + -0.0 == x, -0.0 included), and `floor` (0 where the bias is -inf, else -inf) and `keep` (its
    0 / 1) that take hidden keys through the exponential as exp(0), zeroed after.
    """

    slots: torch.Tensor
    positions: torch.Tensor
    span: int
    order: torch.Tensor
    inverse: torch.Tensor | None
    slot_order: torch.Tensor
    first_slot: int | None
    rounds: tuple[tuple[int, int], ...]
    bias: torch.Tensor
    floor: torch.Tensor
    keep: torch.Tensor

    @property
    def blocks(self) -> int:
        return self.bias.shape[2]


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
    identity = torch.equal(order, torch.arange(t, device=slots.device))
    hidden = key_position > positions[order].view(t, 1, 1, 1, 1)
    plan = _Plan(slots=slots.clone(), positions=positions.clone(), span=span, order=order,
                 inverse=None if identity else torch.argsort(order), slot_order=slot_order,
                 first_slot=low if consecutive else None, rounds=tuple(zip(starts, per_round)),
                 bias=torch.where(hidden, -math.inf, -0.0), floor=torch.where(hidden, 0.0, -math.inf),
                 keep=(~hidden).float())
    _last_plan = plan
    return plan


@functools.cache
def _one(device: torch.device) -> torch.Tensor:
    """A float32 1 (`addcmul`'s second factor: times 1 is exact)."""
    with torch.inference_mode(False):
        return torch.ones((), device=device)


def _gather(cache: torch.Tensor, plan: _Plan, width: int, columns: int, ones: bool
            ) -> tuple[torch.Tensor, int]:
    """Scratch for cached positions [0, width) of the plan's slots as float32 [S', Hkv, width, columns]
    (a ones column if `ones`, then zeros: written here only when the layout changes) and `have`, the
    positions a layer's cache (K and V alike: only its shape is read) fills (`_fill`)."""
    _, hkv, capacity, d = cache.shape
    have = min(capacity, width)
    out, fresh = scratch("values" if ones else "keys", (plan.slot_order.numel(), hkv, width, columns),
                          cache.device, (have, d))
    if fresh:
        if have < width:
            out[:, :, have:, :d] = 0
        if columns > d:  # one broadcast copy of the padding columns (two strided fills cost twice as much)
            tail = torch.zeros(columns - d, dtype=torch.float32, device=cache.device)
            tail[0] = float(ones)
            out[..., d:] = tail
    return out, have


def _fill(into: torch.Tensor, cache: torch.Tensor, plan: _Plan) -> None:
    """A layer's cached K or V of the plan's slots, positions [0, have), converted into `into`
    [S', Hkv, have, D] (a view of `_gather`'s scratch)."""
    have = into.shape[2]
    if plan.first_slot is None:
        into.copy_(cache[:, :, :have].index_select(0, plan.slot_order))
    else:  # consecutive slots (a decode step): convert straight from the cache
        into.copy_(cache[plan.first_slot:plan.first_slot + into.shape[0], :, :have])


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


@dataclass(frozen=True, eq=False)
class _Chunk:
    """One chunk of rounds (tokens lo..hi of the plan's order) as views: the score and weighted
    products (a, b, out), the scores and their mask (bias, floor, keep), the blocks' tree
    (`tree_steps`: adds, last pair; None for one block), the totals, and per head group (numerator,
    denominator, heads)."""

    lo: int
    hi: int
    score_products: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]
    weight_products: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]
    scores: torch.Tensor
    bias: torch.Tensor
    floor: torch.Tensor
    keep: torch.Tensor
    tree: tuple[list, tuple[torch.Tensor, torch.Tensor]] | None
    total: torch.Tensor
    quotients: tuple[tuple[torch.Tensor, torch.Tensor, slice], ...]


@dataclass(frozen=True, eq=False)
class _Operands:
    """A plan's float32 operands in this thread's scratch as the views every layer of its step uses:
    K/V destinations [S', Hkv, have, D], query destinations per head group (broadcast over the key
    blocks) with their heads, and the chunks. Made once per plan, layout and thread: the views alone
    were ~45 of a layer's ~70 ATen calls."""

    keys: torch.Tensor
    values: torch.Tensor
    queries: tuple[tuple[torch.Tensor, slice], ...]
    chunks: tuple[_Chunk, ...]


#: this thread's last operands: (plan, layout key, `_Operands`).
_OPERANDS = threading.local()


def _operands(plan: _Plan, query: torch.Tensor, k_cache: torch.Tensor) -> _Operands:
    """The plan's operands for this layout: the last ones again for the same plan and layout (a plan
    is never reused once another was made, so the scratch still holds their padding)."""
    t, hq, d = query.shape
    _, hkv, capacity, _ = k_cache.shape
    # views made in inference mode may not be written outside it
    key = (hq, hkv, d, capacity, str(query.device), CHUNK_ELEMENTS, torch.is_inference_mode_enabled())
    last = getattr(_OPERANDS, "last", None)
    if last is not None and last[0] is plan and last[1] == key:
        return last[2]
    g = hq // hkv
    groups = -(-g // HEAD_ROWS)
    dk = -(-d // ALIGN) * ALIGN
    dv = -(-(d + 1) // ALIGN) * ALIGN
    blocks = plan.blocks
    width = blocks * KEY_BLOCK
    keys, have = _gather(k_cache, plan, width, dk, ones=False)
    values, _ = _gather(k_cache, plan, width, dv, ones=True)
    a, fresh = scratch("queries", (groups, t, hkv, blocks, HEAD_ROWS, dk), query.device, (g, d))
    if fresh:
        a[-1, ..., g - (groups - 1) * HEAD_ROWS:, :] = 0
        a[..., d:] = 0
    queries = tuple((a[group, ..., :min(HEAD_ROWS, g - group * HEAD_ROWS), :d],
                     slice(group * HEAD_ROWS, min(g, (group + 1) * HEAD_ROWS))) for group in range(groups))
    key_blocks = keys.view(-1, KEY_BLOCK, dk).transpose(1, 2)
    value_blocks = values.view(-1, KEY_BLOCK, dv)
    per_token = hkv * blocks * groups * HEAD_ROWS * (KEY_BLOCK + dv)
    chunks = []
    for lo, hi, rounds in _chunks(plan.rounds, per_token):
        # Head group first: each (group, round) product writes one contiguous slice in place.
        scores, _ = scratch("scores", (groups, hi - lo, hkv, blocks, HEAD_ROWS, KEY_BLOCK), query.device)
        weighted, _ = scratch("weighted", (groups, hi - lo, hkv, blocks, HEAD_ROWS, dv), query.device)
        score_products, weight_products = [], []
        for start, n in rounds:
            rows = slice(start - lo, start - lo + n)
            for group in range(groups):
                problems = scores[group, rows].view(-1, HEAD_ROWS, KEY_BLOCK)
                score_products.append((a[group, start:start + n].view(-1, HEAD_ROWS, dk),
                                       key_blocks[:n * hkv * blocks], problems))
                weight_products.append((problems, value_blocks[:n * hkv * blocks],
                                        weighted[group, rows].view(-1, HEAD_ROWS, dv)))
        tree, total = None, weighted
        if blocks > 1:  # `tree_sum(weighted, 3, overwrite=True)`, its last sum into scratch
            tree = tree_steps(weighted, 3)
            total, _ = scratch("totals", (groups, hi - lo, hkv, 1, HEAD_ROWS, dv), query.device)
        total = total.squeeze(3)
        quotients = []
        for group in range(groups):  # the padding rows of each KV head's last problem are dropped
            heads = slice(group * HEAD_ROWS, min(g, (group + 1) * HEAD_ROWS))
            rows = heads.stop - heads.start
            quotients.append((total[group, :, :, :rows, :d], total[group, :, :, :rows, d:d + 1], heads))
        chunks.append(_Chunk(lo=lo, hi=hi, score_products=tuple(score_products),
                             weight_products=tuple(weight_products), scores=scores, bias=plan.bias[lo:hi],
                             floor=plan.floor[lo:hi], keep=plan.keep[lo:hi],
                             tree=tree, total=total, quotients=tuple(quotients)))
    operands = _Operands(keys=keys[:, :, :have, :d], values=values[:, :, :have, :d], queries=queries,
                         chunks=tuple(chunks))
    _OPERANDS.last = (plan, key, operands)
    return operands


def attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
              positions: torch.Tensor, span: int, scaling: float, max_run: int | None = None) -> torch.Tensor:
    """Causal attention of each query [T, Hq, D] over its own slot's K/V [S, Hkv, C, D] -> [T, Hq, D]
    (float32 math). `span` > every position; `max_run` is unused. A token's result depends on
    neither span, other tokens nor the phase.
    """
    t, hq, d = query.shape
    hkv = k_cache.shape[1]
    plan = _plan(slots, positions, span)
    operands = _operands(plan, query, k_cache)
    _fill(operands.keys, k_cache, plan)
    _fill(operands.values, v_cache, plan)
    own = (query if plan.inverse is None else query[plan.order]).view(t, hkv, 1, hq // hkv, d)
    for into, heads in operands.queries:
        into.copy_(own[..., heads, :])
    out = torch.empty(t, hkv, hq // hkv, d, dtype=query.dtype, device=query.device)  # in the plan's order
    for chunk in operands.chunks:
        for a, b, product in chunk.score_products:
            bmm(a, b, out=product)
        # one pass for scale and mask: bias + scores * scaling * 1, the product rounded once as by mul_
        torch.addcmul(chunk.bias, chunk.scores, _one(query.device), value=scaling, out=chunk.scores)
        chunk.scores.sub_(chunk.scores.amax(dim=(3, 5), keepdim=True))
        # exp(-inf) takes MKL's slow path (10x with a quarter of the keys hidden): a hidden key's -inf
        # becomes 0 (max with the floor), its exp(0) 0 (times keep); the other elements keep their bits
        torch.maximum(chunk.scores, chunk.floor, out=chunk.scores)
        pointwise_(torch._foreach_exp_, chunk.scores.view(-1))  # a multiple of 128 elements: no padding
        chunk.scores.mul_(chunk.keep)
        for a, b, product in chunk.weight_products:
            bmm(a, b, out=product)
        if chunk.tree is not None:
            adds, (first, second) = chunk.tree
            for into, term in adds:
                into.add_(0 if term is None else term)
            torch.add(first, second, out=chunk.total.unsqueeze(3))
        for numerator, denominator, heads in chunk.quotients:
            # float32 quotient rounded once to the output's dtype
            torch.div(numerator, denominator, out=out[chunk.lo:chunk.hi, :, heads])
    return (out if plan.inverse is None else out[plan.inverse]).view(t, hq, d)


def write_kv(k_rows: torch.Tensor, v_rows: torch.Tensor, rows: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor) -> None:
    """k_rows[rows] = key and v_rows[rows] = value: caches viewed as [R, D], rows [N], key/value [N, D]."""
    k_rows.index_copy_(0, rows, key)
    v_rows.index_copy_(0, rows, value)
