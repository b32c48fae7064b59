"""Batch-invariant causal attention over the engine's KV cache on CUDA: prefill, chunked prefill, decode.

The cache is [S, Hkv, C, D] per layer, slot s holding keys at absolute positions. A program owns
one run (consecutive tokens of one slot in a tile of TOKENS) and one KV head, its BLOCK_M rows
the run's tokens x G query heads, and walks the slot from position 0 in BLOCK_N tiles (TMA loads)
with an fp32 online softmax. A persistent variant walks compacted run starts; decode
(`max_run=1`) takes a per-token launch.

Invariance: tile boundaries sit at absolute multiples of BLOCK_N in every phase; no KV split;
every tile runs one body and a fully masked tile leaves a row's bits unchanged (rescale exp2(0) =
1, p = 0); each row is its own fixed-shape dot product (GPU tests: decode == prefill == chunked).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from parity.core.errors import InputError
from parity.kernels.triton.matmul import num_sms
from parity.kernels.triton.mma import mma

#: query rows (tokens x GQA heads) per tile: 64 is the smallest wgmma tile (fewer rows run another
#: MMA instruction, whose bits differ). A decode run fills only G of them, so its softmax work per
#: tile is mostly wasted, but decode is bound by K/V bytes; a prefill run reads each K/V tile once
#: per BLOCK_M // G tokens.
BLOCK_M = 64
#: keys per KV tile; tiles start at absolute positions 0, BLOCK_N, 2*BLOCK_N, ... for every phase.
BLOCK_N = 64
#: warps per program and software-pipeline depth of the K/V loads.
NUM_WARPS = 4
NUM_STAGES = 3
#: 0: one program per (token, KV head); n > 0: about n persistent programs per SM (`AttentionConfig`).
PROGRAMS_PER_SM = 0
#: Steps of at least this many tokens (prefill-sized; decode steps and CUDA-graph buckets have fewer)
#: launch LONG_STEP_PROGRAMS_PER_SM persistent programs per SM with LONG_STEP_STAGES pipeline stages
#: instead: the per-token launch would start T programs per KV head of which all but each run's
#: first exit. Same tiles and warps, so the same per-run code and the same bits (see `shipped_config`).
LONG_STEP_TOKENS = 1024
LONG_STEP_PROGRAMS_PER_SM = 2
LONG_STEP_STAGES = 3


@dataclass(frozen=True)
class AttentionConfig:
    """One launch plan (rows and keys per tile, warps, stages); one plan must serve every phase, since
    BLOCK_N fixes tile boundaries and BLOCK_M and warps the MMA shape. Shipped only after the GPU
    attention_sweep proves decode == prefill == chunked prefill under it.
    """

    block_m: int = BLOCK_M
    block_n: int = BLOCK_N
    num_warps: int = NUM_WARPS
    num_stages: int = NUM_STAGES
    #: 0: one program per (token, KV head), exiting unless its token starts a run (a prefill run of
    #: R tokens launches R - 1 idle programs); n > 0: about n programs per SM, each walking a
    #: compacted list of run starts. Which program computes a run never changes the run's bits.
    programs_per_sm: int = 0

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise InputError(f"AttentionConfig.{name}={value} must be a power of two")
        if self.block_m < 16 or self.block_n < 16:
            raise InputError(f"AttentionConfig: block_m={self.block_m} and block_n={self.block_n} must be "
                             ">= 16 (the MMA tile)")
        if self.num_stages < 1:
            raise InputError(f"AttentionConfig.num_stages={self.num_stages} must be >= 1")
        if self.programs_per_sm < 0:
            raise InputError(f"AttentionConfig.programs_per_sm={self.programs_per_sm} must be >= 0")

    @property
    def name(self) -> str:
        persistent = f"_p{self.programs_per_sm}" if self.programs_per_sm else ""
        return f"m{self.block_m}_n{self.block_n}_w{self.num_warps}_s{self.num_stages}{persistent}"


#: plans the GPU sweep times and checks (decode == prefill == chunked prefill, bit for bit, each
#: plan on its own): the shipped pair first, then other launches of the same per-run code (stages,
#: programs per SM), larger tiles for prefill's MMA work, and plans of other bitwise classes (16 or
#: 32 query rows: another MMA instruction; 128 keys: other tile boundaries) for the cross table.
CANDIDATES: tuple[AttentionConfig, ...] = (
    AttentionConfig(64, 64, 4, 3),
    AttentionConfig(64, 64, 4, 3, programs_per_sm=2),
    AttentionConfig(64, 64, 4, 2),
    AttentionConfig(64, 64, 4, 4),
    AttentionConfig(64, 64, 4, 2, programs_per_sm=4),
    AttentionConfig(64, 64, 4, 3, programs_per_sm=4),
    AttentionConfig(64, 64, 4, 3, programs_per_sm=8),
    AttentionConfig(64, 64, 8, 3),
    AttentionConfig(128, 64, 8, 3),
    AttentionConfig(128, 64, 8, 3, programs_per_sm=2),
    AttentionConfig(16, 64, 4, 3),
    AttentionConfig(32, 64, 4, 3),
    AttentionConfig(16, 64, 4, 3, programs_per_sm=16),
    AttentionConfig(64, 128, 4, 3),
    AttentionConfig(128, 128, 8, 3),
)


def shipped_config(tokens: int = 1) -> AttentionConfig:
    """The default plan for `tokens` query tokens: long and short steps share BLOCK_M, BLOCK_N and warps
    (a row's arithmetic) and differ only in program assignment and pipelining (checked bitwise).
    """
    if tokens >= LONG_STEP_TOKENS:
        return AttentionConfig(BLOCK_M, BLOCK_N, NUM_WARPS, LONG_STEP_STAGES, LONG_STEP_PROGRAMS_PER_SM)
    return AttentionConfig(BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES, PROGRAMS_PER_SM)


@triton.jit
def _tile(q, k_desc, v_desc, row0, start, in_run, pos, qk_scale_log2, m_i, l_i, acc, BLOCK_N: tl.constexpr):
    """One KV tile [start, start + BLOCK_N) of the online softmax: (m, l, acc) updated by one body for
    every tile; keys past the run's last are read with p = 0 (the zero-initialized cache stays finite).
    """
    keys = start + tl.arange(0, BLOCK_N)
    row = (row0 + start).to(tl.int32)
    k = k_desc.load([row, 0])
    v = v_desc.load([row, 0])
    s = mma(q, k.T, tl.zeros((q.shape[0], BLOCK_N), tl.float32)) * qk_scale_log2
    s = tl.where(in_run[:, None] & (keys[None, :] <= pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # Rows outside the run see no key: shift them by 0, not -inf, so they stay (-inf, 0, 0).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = mma(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _tile_tokens(slots_ptr, positions_ptr, T, t0, GROUP: tl.constexpr, TOKENS: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    """The rows of t0's tile: (token [BLOCK_M], valid, slot, position), loaded early with the scalars."""
    rows = tl.arange(0, BLOCK_M)
    tok = (t0 // TOKENS) * TOKENS + rows // GROUP
    row_ok = (rows < TOKENS * GROUP) & (tok < T)
    tok_slot = tl.load(slots_ptr + tok, mask=row_ok, other=-1)
    pos = tl.load(positions_ptr + tok, mask=row_ok, other=-1)
    return tok, row_ok, tok_slot, pos


@triton.jit
def _softmax_over_slot(q, k_desc, v_desc, row0, in_run, pos, last, qk_scale_log2, BLOCK_M: tl.constexpr,
                       HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online softmax of q [BLOCK_M, HEAD_DIM] over one slot's keys 0..last, ascending: fp32 output
    (rows outside the run come out 0, not to be stored).
    """
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    for start in range(0, last + 1, BLOCK_N):
        m_i, l_i, acc = _tile(q, k_desc, v_desc, row0, start, in_run, pos, qk_scale_log2, m_i, l_i, acc,
                              BLOCK_N)
    return acc / tl.where(in_run, l_i, 1.0)[:, None]


@triton.jit
def _attend_run(q_ptr, k_desc, v_desc, out_ptr, t0, slot, tok, row_ok, tok_slot, pos, kv_head, qk_scale_log2,
                stride_qt, stride_qh, stride_ot, stride_oh, KV_HEADS, CAPACITY,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, TOKENS: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """One run and one KV head: the whole online softmax, stored for the run's rows; the run ends at
    the next token of another slot or the tile's end (no per-step preparation).
    """
    end = tl.min(tl.where(row_ok & (tok > t0) & (tok_slot != slot), tok, (t0 // TOKENS + 1) * TOKENS), axis=0)
    in_run = row_ok & (tok >= t0) & (tok < end)
    head = kv_head * GROUP + tl.arange(0, BLOCK_M) % GROUP
    dims = tl.arange(0, HEAD_DIM)
    q_offs = tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=in_run[:, None], other=0.0)
    last = tl.max(tl.where(in_run, pos, 0), axis=0)
    out = _softmax_over_slot(q, k_desc, v_desc, (slot * KV_HEADS + kv_head) * CAPACITY, in_run, pos, last,
                             qk_scale_log2, BLOCK_M, HEAD_DIM, BLOCK_N)
    o_offs = tok.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=in_run[:, None])


@triton.jit(do_not_specialize=["T"])
def _attention_kernel(
    q_ptr, k_desc, v_desc, out_ptr, slots_ptr, positions_ptr, runs_ptr, num_runs_ptr, T, qk_scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh, KV_HEADS, CAPACITY,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, TOKENS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid (tiles, KV heads, TOKENS): token t0's program works only if t0 starts a run."""
    kv_head = tl.program_id(1)
    t0 = tl.program_id(0) * TOKENS + tl.program_id(2)
    if t0 >= T:
        return
    tok, row_ok, tok_slot, pos = _tile_tokens(slots_ptr, positions_ptr, T, t0, GROUP, TOKENS, BLOCK_M)
    slot = tl.load(slots_ptr + t0)
    # -1 is never a slot: the first token of a tile always starts a run
    before = tl.load(slots_ptr + t0 - 1, mask=t0 % TOKENS != 0, other=-1)
    if before == slot:
        return
    _attend_run(q_ptr, k_desc, v_desc, out_ptr, t0, slot, tok, row_ok, tok_slot, pos, kv_head, qk_scale_log2,
                stride_qt, stride_qh, stride_ot, stride_oh, KV_HEADS, CAPACITY, GROUP, HEAD_DIM, TOKENS,
                BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["T"])
def _attention_persistent_kernel(
    q_ptr, k_desc, v_desc, out_ptr, slots_ptr, positions_ptr, runs_ptr, num_runs_ptr, T, qk_scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh, KV_HEADS, CAPACITY,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, TOKENS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid (programs, KV heads): program i takes runs i, i + programs, ... of runs_ptr[0:num_runs]."""
    kv_head = tl.program_id(1)
    num_runs = tl.load(num_runs_ptr)
    i = tl.program_id(0)
    while i < num_runs:
        t0 = tl.load(runs_ptr + i)
        tok, row_ok, tok_slot, pos = _tile_tokens(slots_ptr, positions_ptr, T, t0, GROUP, TOKENS, BLOCK_M)
        _attend_run(q_ptr, k_desc, v_desc, out_ptr, t0, tl.load(slots_ptr + t0), tok, row_ok, tok_slot, pos,
                    kv_head, qk_scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, KV_HEADS, CAPACITY,
                    GROUP, HEAD_DIM, TOKENS, BLOCK_M, BLOCK_N)
        i += tl.num_programs(0)


@triton.jit(do_not_specialize=["T"])
def _attention_tokens_kernel(
    q_ptr, k_desc, v_desc, out_ptr, slots_ptr, positions_ptr, runs_ptr, num_runs_ptr, T, qk_scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh, KV_HEADS, CAPACITY,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, TOKENS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid (T * KV heads,): the decode launch, one token per program, no run search. A token gets the
    same bits as in its run (rows are independent dot products), only K/V are read per token.
    """
    t0 = tl.program_id(0) // KV_HEADS
    kv_head = tl.program_id(0) % KV_HEADS
    slot = tl.load(slots_ptr + t0)
    last = tl.load(positions_ptr + t0)
    rows = tl.arange(0, BLOCK_M)
    live = rows < GROUP
    head = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + t0.to(tl.int64) * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=live[:, None], other=0.0)
    out = _softmax_over_slot(q, k_desc, v_desc, (slot * KV_HEADS + kv_head) * CAPACITY, live,
                             tl.full((BLOCK_M,), 0, tl.int64) + last, last, qk_scale_log2, BLOCK_M, HEAD_DIM,
                             BLOCK_N)
    o_offs = t0.to(tl.int64) * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=live[:, None])


def attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    scaling: float,
    config: AttentionConfig | None = None,
    max_run: int | None = None,
) -> torch.Tensor:
    """Causal attention of each query token [T, Hq, D] over its own slot's cached K/V [S, Hkv, C, D]
    (own key already written) -> [T, Hq, D], fp32 math. config: default `shipped_config(T)`.
    max_run: 1 takes the decode launch; only speed depends on it (a wrong hint is slow, not wrong).
    """
    t, hq, d = query.shape
    cfg = config or shipped_config(t)
    _, hkv, capacity, dk = k_cache.shape
    if dk != d or v_cache.shape != k_cache.shape:
        raise InputError(
            f"attention: query head_dim {d}, k_cache {tuple(k_cache.shape)}, "
            f"v_cache {tuple(v_cache.shape)} disagree"
        )
    if hq % hkv:
        raise InputError(f"attention: {hq} query heads is not a multiple of {hkv} KV heads")
    if d & (d - 1) or d < 16:
        raise InputError(f"attention: head_dim {d} must be a power of two >= 16")
    if query.stride(-1) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise InputError("attention: query needs a contiguous last (head_dim) axis and k_cache, v_cache "
                         "must be contiguous (their TMA descriptors read [S * Hkv * C, D] rows)")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if t == 0:
        return out
    group = hq // hkv
    block_m = max(cfg.block_m, triton.next_power_of_2(group))
    tokens = block_m // group
    runs = num_runs = slots  # placeholders: only the persistent kernel reads a run list (shared signature)
    if max_run == 1:
        kernel, grid = _attention_tokens_kernel, (t * hkv,)
    elif cfg.programs_per_sm:
        # the runs' first tokens, compacted on the device (no host sync: CUDA graphs capture it)
        index = torch.arange(t, device=query.device)
        is_start = index % tokens == 0
        is_start[1:] |= slots[1:] != slots[:-1]
        runs = torch.full((t + 1,), -1, dtype=torch.int64, device=query.device)
        runs.scatter_(0, torch.where(is_start, torch.cumsum(is_start, 0) - 1, t), index)
        num_runs = is_start.sum(dtype=torch.int64).reshape(1)
        programs = min(t, triton.cdiv(cfg.programs_per_sm * num_sms(query.device), hkv))
        kernel, grid = _attention_persistent_kernel, (programs, hkv)
    else:
        kernel, grid = _attention_kernel, (triton.cdiv(t, tokens), hkv, tokens)
    kernel[grid](
        query, _rows_descriptor(k_cache, cfg.block_n), _rows_descriptor(v_cache, cfg.block_n), out, slots,
        positions, runs, num_runs, t,
        scaling * 1.4426950408889634,  # log2(e): the kernel exponentiates with exp2
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), hkv, capacity,
        GROUP=group, HEAD_DIM=d, TOKENS=tokens, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def _rows_descriptor(cache: torch.Tensor, block_n: int) -> TensorDescriptor:
    """A TMA descriptor over the cache as [S * Hkv * C, D] rows, loading [block_n, D] tiles."""
    rows = cache.view(-1, cache.shape[-1])
    if rows.shape[0] >= 2**31:
        raise InputError(f"attention: a KV cache of {rows.shape[0]} rows; TMA row coordinates are 32-bit "
                         "(fewer than 2**31 rows): use fewer slots or a shorter max_len")
    return TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [block_n, rows.shape[1]])
