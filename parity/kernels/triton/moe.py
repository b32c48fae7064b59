"""Batch-invariant mixture-of-experts on CUDA: top-k routing, grouped expert GEMM, ordered combine.

`topk`: k argmax rounds, ties to the lower expert (`torch.topk`'s tie order is unspecified). `route`:
the slots sorted by expert, token order inside (a counting sort, one launch).
`grouped_linear`: rows sorted by expert, a fixed plan per dtype (`_GROUPED_PLAN`), K ascending in
fp32, so an output is the same whether 1 or 10,000 tokens chose the expert. `combine`: a token's
k outputs summed in slot order, one rounding (HF's `index_add_` follows expert order). No host
sync: capturable in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from parity.core.errors import InputError
from parity.kernels.triton.gated import gated
from parity.kernels.triton.mma import mma


@triton.jit
def _topk_kernel(
    scores_ptr,
    values_ptr,
    indices_ptr,
    E,
    K: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    s = tl.load(scores_ptr + row * E + cols, mask=cols < E, other=float("-inf"))
    values = tl.zeros((BLOCK_K,), s.dtype)
    indices = tl.zeros((BLOCK_K,), tl.int64)
    for j in tl.static_range(K):
        best = tl.argmax(s, axis=0, tie_break_left=True)
        values = tl.where(slots == j, tl.max(s, axis=0), values)
        indices = tl.where(slots == j, best.to(tl.int64), indices)
        s = tl.where(cols == best, float("-inf"), s)
    if NORMALIZE:  # one sum of the k chosen values (zeros beyond k add nothing), in scores' dtype
        values = values / tl.sum(values, axis=0)
    tl.store(values_ptr + row * K + slots, values, mask=slots < K)
    tl.store(indices_ptr + row * K + slots, indices, mask=slots < K)


def topk(scores: torch.Tensor, k: int, normalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) [..., k] of the k largest of scores [..., E], descending, ties to the lower
    index; `normalize` divides by their sum.
    """
    e = scores.shape[-1]
    if not 1 <= k <= e:
        raise InputError(f"topk: k={k} must be in [1, {e}]")
    s2 = scores.reshape(-1, e).contiguous()
    values = torch.empty((s2.shape[0], k), dtype=scores.dtype, device=scores.device)
    indices = torch.empty((s2.shape[0], k), dtype=torch.int64, device=scores.device)
    if s2.shape[0]:
        _topk_kernel[(s2.shape[0],)](
            s2,
            values,
            indices,
            e,
            K=k,
            NORMALIZE=normalize,
            BLOCK_E=triton.next_power_of_2(e),
            BLOCK_K=triton.next_power_of_2(k),
        )
    return values.reshape(*scores.shape[:-1], k), indices.reshape(*scores.shape[:-1], k)


#: grouped GEMM plan (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per dtype: fixed, never
#: chosen from the number of routed tokens.
_GROUPED_PLAN = {
    torch.bfloat16: (64, 128, 64, 4, 3),
    torch.float16: (64, 128, 64, 4, 3),
    torch.float32: (32, 64, 32, 4, 2),
}


@triton.jit(do_not_specialize=["num_experts"])
def _grouped_linear_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    offsets_ptr,
    tile_start_ptr,
    tile_expert_ptr,
    num_experts,
    N,
    K,
    stride_we,
    stride_wn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert >= num_experts:
        return
    row_end = tl.load(offsets_ptr + expert + 1)
    first = tl.load(offsets_ptr + expert) + (tile - tl.load(tile_start_ptr + expert)) * BLOCK_M
    rows = (first + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < row_end
    col_ok = cols < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(
            w_base + cols[:, None] * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0
        )
        acc = mma(a, b.T, acc)
    tl.store(
        out_ptr + rows[:, None] * N + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def tile_plan(counts: torch.Tensor, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The row tiles of `grouped_linear` for counts [E] rows per expert over `rows` rows: each
    expert's first tile [E] and each tile's expert [cdiv(rows, BLOCK_M) + E]; one plan serves every
    product of a layer (the same counts, the same BLOCK_M per dtype).
    """
    block_m = _GROUPED_PLAN[dtype][0]
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    max_tiles = triton.cdiv(rows, block_m) + tiles.shape[0]  # an upper bound: no host sync on the counts
    tile_expert = torch.searchsorted(tile_end, torch.arange(max_tiles, device=counts.device), right=True)
    return tile_end - tiles, tile_expert


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    plan: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Rows of x [R, K] sorted by expert times weight [E, N, K].T per expert -> [R, N]; expert e owns
    rows offsets[e]:offsets[e+1] (offsets [E + 1] int64); `plan` is `tile_plan`'s for them.
    """
    e, n, k = weight.shape
    if x.shape[-1] != k or x.dtype != weight.dtype:
        raise InputError(
            f"grouped_linear: x {tuple(x.shape)} {x.dtype} vs weight {tuple(weight.shape)} {weight.dtype}"
        )
    if weight.stride(-1) != 1:
        raise InputError("grouped_linear: weight needs a contiguous last (K) axis")
    block_m, block_n, block_k, num_warps, num_stages = _GROUPED_PLAN[x.dtype]
    x = x.contiguous()
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    offsets = offsets.to(torch.int64)
    if plan is None:
        plan = tile_plan(offsets[1:] - offsets[:-1], x.shape[0], x.dtype)
    tile_start, tile_expert = plan
    max_tiles = tile_expert.shape[0]
    grid = (max_tiles, triton.cdiv(n, block_n))
    _grouped_linear_kernel[grid](
        x,
        weight,
        out,
        offsets,
        tile_start,
        tile_expert,
        e,
        n,
        k,
        weight.stride(0),
        weight.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


@triton.jit
def _combine_kernel(
    y_ptr,
    rows_ptr,
    w_ptr,
    out_ptr,
    H,
    K: tl.constexpr,
    WEIGHTED: tl.constexpr,
    GATHER: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for j in tl.static_range(K):
        row = token * K + j
        if GATHER:
            row = tl.load(rows_ptr + row)
        y = tl.load(y_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
        if WEIGHTED:
            y = tl.load(w_ptr + token * K + j).to(tl.float32) * y
        acc += y
    tl.store(out_ptr + token * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine(
    slots: torch.Tensor, weights: torch.Tensor | None = None, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """sum_j weights[t, j] * slots[t, j] in fp32, j in order, one rounding: [T, k, H] -> [T, H]. With
    `rows` [T * k] int64, slots [R, H] and slot (t, j) is slots[rows[t * k + j]] (read in place: no
    [T * k, H] copy put back in token order first); weights [T, k] give k."""
    if rows is not None and weights is None:
        raise InputError("combine: rows= reads [T * k] slots and takes k from weights [T, k]; pass weights")
    k = slots.shape[1] if rows is None else weights.shape[1]
    h = slots.shape[-1]
    t = slots.shape[0] if rows is None else rows.shape[0] // k
    out = torch.empty((t, h), dtype=slots.dtype, device=slots.device)
    if t:
        block_h = min(1024, triton.next_power_of_2(h))
        _combine_kernel[(t, triton.cdiv(h, block_h))](
            slots.contiguous(),
            slots if rows is None else rows.contiguous(),
            slots if weights is None else weights.contiguous(),
            out,
            h,
            K=k,
            WEIGHTED=weights is not None,
            GATHER=rows is not None,
            BLOCK_H=block_h,
        )
    return out


@triton.jit
def _route_kernel(flat_ptr, offsets_ptr, order_ptr, position_ptr, N, K: tl.constexpr, BLOCK: tl.constexpr):
    expert = tl.program_id(0)
    base = tl.load(offsets_ptr + expert)
    for start in range(0, N, BLOCK):
        slot = start + tl.arange(0, BLOCK)
        hit = tl.load(flat_ptr + slot, mask=slot < N, other=-1) == expert
        place = base + tl.cumsum(hit.to(tl.int32), 0) - 1
        tl.store(order_ptr + place, slot.to(tl.int64) // K, mask=hit)
        tl.store(position_ptr + slot, place, mask=hit)
        base += tl.sum(hit.to(tl.int32), 0)


def route(flat: torch.Tensor, offsets: torch.Tensor, k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A counting sort of expert ids flat [N] (expert e owns offsets[e]:offsets[e+1]): order [N], the
    slots grouped by expert in slot order (`argsort(stable=True)`'s) divided by k (the token of each
    slot when a token has k), and position [N], where each slot went. One launch, one program an expert.
    """
    n = flat.shape[0]
    order = torch.empty(n, dtype=torch.int64, device=flat.device)
    position = torch.empty_like(order)
    if n:
        _route_kernel[(offsets.shape[0] - 1,)](
            flat.contiguous(), offsets, order, position, n, K=k, BLOCK=min(1024, triton.next_power_of_2(n))
        )
    return order, position


def experts_forward(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The MoE experts of one layer: hidden [T, H], top_k_index/weights [T, k] -> [T, H];
    gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].
    """
    k = top_k_index.shape[1]
    e = gate_up_proj.shape[0]
    flat = top_k_index.reshape(-1)
    counts = torch.zeros(e, dtype=torch.int64, device=hidden.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    offsets = torch.zeros(e + 1, dtype=torch.int64, device=hidden.device)
    offsets[1:] = torch.cumsum(counts, 0)  # scatter_add, not bincount: bincount syncs the host on CUDA
    token, position = route(flat, offsets, k)
    plan = tile_plan(counts, flat.shape[0], hidden.dtype)
    gate, up = grouped_linear(hidden[token], gate_up_proj, offsets, plan).chunk(2, dim=-1)
    y_sorted = grouped_linear(gated(act_fn, gate, up), down_proj, offsets, plan)
    # combine reads each slot where the products left it: a [T * k, H] scatter back into token order
    # first cost 45 us a layer at 2,048 rows on an H100
    return combine(y_sorted, top_k_weights, rows=position)
