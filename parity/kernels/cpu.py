"""Batch-invariant CPU kernels built from stock torch ops whose results cannot depend on the batch.

What breaks invariance in stock CPU torch (measured, see docs/DESIGN.md) and how each op avoids it:

- GEMM kernel choice depends on the problem's shape and, for a lone product, on the thread
  count. Every matmul is a batch of fixed-shape float32 problems (`cpu_gemm`: [TILE, K] row
  tiles times column blocks of the weight), so the library runs the same single-threaded
  kernel for every row, whatever the batch.
- Reductions split across threads when rows are few, and their vectorized accumulation order
  is an implementation detail. Every sum here has an order fixed by construction: a
  `tree_sum` (a fixed pairwise tree of elementwise adds over the reduced axis, padded with exact
  zeros to a power of two), or a product with a ones vector inside a fixed-shape GEMM (RMSNorm's
  sum of squares, attention's softmax mass in `cpu_attention`).
- Transcendental pointwise ops (exp, log, silu, ...) use a vectorized body and a scalar tail
  that round differently, so an element's result depends on its flat position and on how
  `parallel_for` chunks the tensor. `pointwise` feeds them contiguous pieces whose lengths are
  multiples of `POINTWISE_ALIGN` and small enough to run on one thread, so every element goes
  through the vector body.

Elementwise +, -, *, / and comparisons are correctly rounded in every code path, so they are
used freely. Nothing here changes torch's thread settings: the switch must not change the
results of code outside it. The bitwise tests in tests/test_kernels.py prove each property on
the CPU they run on (row position, batch, thread count).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from parity.kernels import cpu_gemm
from parity.kernels.cpu_gemm import TILE

#: pointwise inputs are padded to a multiple of this many elements (2 x the widest vector, 32 lanes).
POINTWISE_ALIGN = 64
#: largest piece a pointwise op sees: half of ATen's GRAIN_SIZE (32768 elements), below which
#: TensorIterator runs an op on one thread.
POINTWISE_CHUNK = 16384


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` for an elementwise `fn`, with every element computed by the same (vector) code path.

    The flat input is zero-padded to a multiple of POINTWISE_ALIGN and fed in contiguous pieces
    of at most POINTWISE_CHUNK elements: below ATen's parallel grain size an op runs on one
    thread over the whole piece, so no thread split can put an element into a scalar tail.
    """
    flat = x.reshape(-1)
    n = flat.numel()
    pad = (-n) % POINTWISE_ALIGN
    flat = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat.contiguous()
    if flat.numel() <= POINTWISE_CHUNK:
        out = fn(flat)
    else:
        out = torch.cat([fn(piece) for piece in flat.split(POINTWISE_CHUNK)])
    return out[:n].view(x.shape)


def pointwise_(fn_: Callable[[torch.Tensor], torch.Tensor], flat: torch.Tensor) -> torch.Tensor:
    """`pointwise` in place on a flat contiguous tensor whose length is a multiple of POINTWISE_ALIGN.

    For callers that build their input in a padded buffer already (the sampler's Gumbel noise,
    32 x 49k float64 per step), so no padded copy or concatenation is made; `fn_` applies
    in-place ops to each piece. Returns `flat`.
    """
    if flat.dim() != 1 or not flat.is_contiguous() or flat.numel() % POINTWISE_ALIGN:
        raise ValueError(f"pointwise_ needs a flat contiguous tensor of a multiple of {POINTWISE_ALIGN} "
                         f"elements, got shape {tuple(flat.shape)}")
    for piece in flat.split(POINTWISE_CHUNK):
        fn_(piece)
    return flat


def tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Sum over `dim` by a fixed pairwise tree: add the upper half onto the lower half until one is left.

    Zeros pad the axis to a power of two; x + 0 == x exactly, so neither this padding nor any
    trailing zeros (masked entries) change the result.
    """
    dim = dim % x.dim()
    n = x.shape[dim]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        pad_shape = list(x.shape)
        pad_shape[dim] = width - n
        x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    while x.shape[dim] > 1:
        half = x.shape[dim] // 2
        x = x.narrow(dim, 0, half) + x.narrow(dim, half, half)
    return x if keepdim else x.squeeze(dim)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias): x [..., K], weight [N, K] -> [..., N]; each row independent of the others.

    A float32 GEMM of fixed [TILE, K] x [K, width] problems (`cpu_gemm.matmul`), rounded once to
    x's dtype.
    """
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
    """HF RMSNorm (normalize in fp32, cast back, multiply by weight) with a fixed-order mean.

    The sum of squares of each row is its product with a ones column in fixed-shape GEMM
    problems (`cpu_gemm.row_sums`) instead of a zero-padded tree of ~2 log2(hidden) ops.
    """
    dtype = x.dtype
    xf = x.to(torch.float32)
    variance = cpu_gemm.row_sums((xf * xf).reshape(-1, x.shape[-1])).view(*x.shape[:-1], 1) / x.shape[-1]
    rstd = pointwise(torch.rsqrt, variance + eps)
    return weight * (xf * rstd).to(dtype)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim; masked (-inf) entries give exact zeros."""
    z = x - x.amax(-1, keepdim=True)
    e = pointwise(torch.exp, z)
    return e / tree_sum(e, -1, keepdim=True)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the last dim: (x - max) - log(sum(exp(x - max)))."""
    z = x - x.amax(-1, keepdim=True)
    total = tree_sum(pointwise(torch.exp, z), -1, keepdim=True)
    return z - pointwise(torch.log, total)


def cumsum(x: torch.Tensor) -> torch.Tensor:
    """Inclusive cumulative sum over the last dim [..., V] -> [..., V] in x's dtype.

    ATen's CPU scan walks each row front to back with a float64 accumulator (rows are what its
    threads split), so a row's result is its float64 prefix sums rounded once, whatever the batch:
    the stock op is already the fixed order, and a bitwise test holds it to that.
    """
    return torch.cumsum(x, dim=-1)


def activation(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """An elementwise activation module/function applied position-independently."""
    return pointwise(fn, x)


def topk(scores: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k over the last dim with ties broken by the lower index (stable descending sort).

    Returns (values, indices), each [..., k]; values renormalized to sum 1 if `normalize`.
    `torch.topk` leaves the tie order unspecified.
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

    top_k_index, top_k_weights [N, k]; gate_up_proj [E, 2I, H]; down_proj [E, H, I]; `act` is
    the (patched) activation module. The (token, slot) rows routed to each expert are packed
    into that expert's own [TILE, H] row tiles (zero rows pad the last one), and one float32 bmm
    runs every tile against its expert's weights (`cpu_gemm.bmm`): each row meets the same
    problem whatever else was routed. Each row's weighted output goes back to its (token,
    slot), and the k slots of a token are summed in slot order.
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
    """cos, sin [B, L, D] for `position_ids` [B, L], gathered from a table of every position.

    The table is made by one call of the model's own rotary `forward` on positions
    0..max_positions-1 and cached in `tables` per (dtype, device); a row of it is then the same
    whatever batch, chunk or step asks for that position (cos/sin of a vectorized body and a
    scalar tail round differently, so computing them per call would not be).
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

