"""Per-token inputs checked once, and the float64 row blocks every metric and the correction
compute on.

`token_arrays` checks the three `[batch, seq]` inputs (torch tensors or NumPy arrays of per-token
log-probabilities in nats, and a bool or 0/1 mask of the tokens that count) and returns a
`TokenArrays`, which `parity.drift.metrics` and `parity.correction` read block by block (`Block`: whole
rows in float64, padding set to 0). Each metric is a `BlockPass`; `TokenArrays.scan` feeds every
block to several of them, which then share the block's conversion and the arrays derived from it
(|Δ|, the IS ratio, ...) while they are in cache: the monitor's step record is one scan.
Conventions:

- Logprobs must be finite wherever the mask is set. Masked-out slots may hold `-inf` (a common
  padding value) or any finite junk; they are ignored. NaN or `+inf` anywhere is an error: a
  log-probability is never either, so the producer is broken.
- All arithmetic runs in float64 whatever the input dtype, so float32 and float64 inputs agree
  to the precision of the inputs themselves.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

import numpy as np
import torch

from parity.core.errors import InputError
from parity.drift.ratio_rules import SAFETY_BOUND

#: Tokens per row block. Every per-token computation runs on blocks of whole rows of about this
#: size (512 KiB per float64 temporary), which stay in the core's L2 cache; full `[batch, seq]`
#: temporaries cost a page-faulting allocation per op, measured 4-30x slower at 10M tokens on 2
#: cores, and 2^18-token blocks (2 MiB temporaries) 1.4x slower than these at 1M (docs/PERF.md).
BLOCK_TOKENS = 1 << 16


class Buffers:
    """Float64 arrays reused from block to block of one scan.

    A block's arrays and the passes' temporaries are ~10 arrays of 512 KiB. Allocated afresh for
    every block, glibc gives their memory back to the system when they are freed (they sit at the
    top of the heap, above its trim threshold) and takes it again, page by page, for the next
    block: 4,000-11,000 page faults a 1M-token step, ~10-30 ms of the monitor's step on this
    shared machine (docs/PERF.md). `take` lends an uninitialised array; `recycle` takes back
    every array lent.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[tuple[int, ...], torch.device], list[torch.Tensor]] = {}
        self._lent: list[torch.Tensor] = []

    def take(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        free = self._free.get((shape, device))
        buffer = free.pop() if free else torch.empty(shape, dtype=torch.float64, device=device)
        self._lent.append(buffer)
        return buffer

    def recycle(self) -> None:
        for buffer in self._lent:
            self._free.setdefault((tuple(buffer.shape), buffer.device), []).append(buffer)
        self._lent.clear()


@dataclass(frozen=True)
class Block:
    """One block of whole rows, in float64 with masked-out slots set to 0.

    rows: the block's row range in the batch.
    train, rollout: logprobs (nats) `[rows, seq]`, 0 where `mask` is False.
    log_ratio: `train - rollout` (nats), 0 where `mask` is False.
    mask: bool `[rows, seq]`.
    dense: every slot of the block is valid (no padding): a masked reduction may skip its mask.
    buffers: where the block's arrays come from: a scan's `Buffers`, reused block to block.

    The cached properties are arrays several metrics derive from the block: each is computed
    once, on first use, and shared by every metric `scan` feeds the block to. They are never
    written to in place. In a scan, the block's arrays and `buffer`s are reused for the next
    block: a pass keeps none of them (nor a view of one) after its `add`.
    """

    rows: slice
    train: torch.Tensor
    rollout: torch.Tensor
    log_ratio: torch.Tensor
    mask: torch.Tensor
    dense: bool = False
    buffers: Buffers = field(default_factory=Buffers)

    def buffer(self) -> torch.Tensor:
        """An uninitialised float64 `[rows, seq]` array from `buffers`, for an op's `out=`."""
        return self.buffers.take(tuple(self.log_ratio.shape), self.log_ratio.device)

    @cached_property
    def maskf(self) -> torch.Tensor:
        """The mask as 0.0/1.0 `[rows, seq]`."""
        return self.buffer().copy_(self.mask)

    @cached_property
    def abs_log_ratio(self) -> torch.Tensor:
        """|Δ| `[rows, seq]` (nats, unclamped), 0 at padding."""
        return torch.abs(self.log_ratio, out=self.buffer())

    @cached_property
    def row_abs_max(self) -> torch.Tensor:
        """Max |Δ| of each row `[rows]` (0 for an empty row: |Δ| >= 0 and 0 at padding)."""
        return self.abs_log_ratio.amax(-1)

    @cached_property
    def row_log_ratio_sum(self) -> torch.Tensor:
        """Σ_t Δ_t of each row `[rows]` (nats)."""
        return self.log_ratio.sum(-1)

    @cached_property
    def clamped(self) -> torch.Tensor:
        """Δ clamped to ±`SAFETY_BOUND` `[rows, seq]`, 0 at padding. The clamp is the identity on a
        block with no |Δ| beyond the bound (the usual case): then this is `log_ratio` itself, and
        every array derived from the two is computed once."""
        if float(self.row_abs_max.max()) <= SAFETY_BOUND:
            return self.log_ratio
        return torch.clamp(self.log_ratio, -SAFETY_BOUND, SAFETY_BOUND, out=self.buffer())

    @cached_property
    def abs_clamped(self) -> torch.Tensor:
        """|clamp(Δ, ±20)| `[rows, seq]`, 0 at padding."""
        if self.clamped is self.log_ratio:
            return self.abs_log_ratio
        return torch.abs(self.clamped, out=self.buffer())

    @cached_property
    def exp_clamped(self) -> torch.Tensor:
        """The IS ratio exp(clamp(Δ, ±20)) `[rows, seq]`, 1 at padding."""
        return torch.exp(self.clamped, out=self.buffer())

    @cached_property
    def ratio(self) -> torch.Tensor:
        """The IS ratio exp(clamp(Δ, ±20)) `[rows, seq]`, 0 at padding."""
        if self.dense:
            return self.exp_clamped
        zero = torch.zeros((), dtype=torch.float64, device=self.mask.device)
        return torch.where(self.mask, self.exp_clamped, zero, out=self.buffer())

    @cached_property
    def exp_log_ratio(self) -> torch.Tensor:
        """exp(Δ) unclamped `[rows, seq]`, 1 at padding: `exp_clamped` where no |Δ| exceeds the
        bound (the same exp of the same values)."""
        if self.clamped is self.log_ratio:
            return self.exp_clamped
        return torch.exp(self.log_ratio, out=self.buffer())


class BlockPass(Protocol):
    """A computation over a batch's blocks: `scan` gives it every block once, in order."""

    def add(self, b: Block) -> None: ...


@dataclass(frozen=True)
class TokenArrays:
    """Validated `[batch, seq]` inputs: the caller's logprobs (not copied) and a bool mask.

    Made by `token_arrays`; every metric takes one in place of its three arrays, so a batch
    several metrics read is checked once.

    lengths: valid tokens per row `[batch]` (float64). total: valid tokens in the batch.
    dtype: floating dtype of the caller's train logprobs (results are cast back to it).
    numpy: whether the caller's train logprobs were not a torch tensor (results go back as NumPy).
    mask_dtype: the caller's mask dtype: a torch dtype for a tensor mask, else a NumPy dtype.
    """

    train: torch.Tensor
    rollout: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor
    total: float
    dtype: torch.dtype
    numpy: bool
    mask_dtype: torch.dtype | np.dtype

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.mask.shape[0]), int(self.mask.shape[1]))

    def like_train(self, values: torch.Tensor) -> Any:
        """`values` `[batch, seq]` in the container of the caller's train logprobs."""
        return values.cpu().numpy() if self.numpy else values

    def like_mask(self, keep: torch.Tensor) -> Any:
        """A bool `[batch, seq]` mask in the container and dtype of the caller's mask."""
        if isinstance(self.mask_dtype, torch.dtype):
            return keep.to(self.mask_dtype)
        return keep.cpu().numpy().astype(self.mask_dtype, copy=False)

    def row_blocks(self) -> Iterator[slice]:
        """Row ranges of about `BLOCK_TOKENS` tokens each, covering the batch in order."""
        batch, seq = self.shape
        step = max(1, BLOCK_TOKENS // max(seq, 1))
        for start in range(0, batch, step):
            yield slice(start, min(start + step, batch))

    def block(self, rows: slice, buffers: Buffers | None = None) -> Block:
        """Rows `rows` as a float64 `Block`, its arrays taken from `buffers` (default: new ones)."""
        buffers = Buffers() if buffers is None else buffers
        mask = self.mask[rows]
        dense = bool((self.lengths[rows] == self.shape[1]).all())
        shape, device = tuple(mask.shape), mask.device
        train = buffers.take(shape, device).copy_(self.train[rows])
        rollout = buffers.take(shape, device).copy_(self.rollout[rows])
        if not dense:  # padding to zero (a block of full rows has none)
            zero = torch.zeros((), dtype=torch.float64, device=device)
            torch.where(mask, train, zero, out=train)
            torch.where(mask, rollout, zero, out=rollout)
        log_ratio = torch.sub(train, rollout, out=buffers.take(shape, device))
        return Block(rows, train, rollout, log_ratio, mask, dense, buffers)

    def blocks(self) -> Iterator[Block]:
        """The batch as float64 `Block`s of whole rows, in order."""
        for rows in self.row_blocks():
            yield self.block(rows)

    def scan(self, *passes: BlockPass) -> None:
        """Give every block, in order, to each of `passes`. Several metrics of one batch scanned
        together share each block's conversion and derived arrays (`Block`) and read them while
        they are in the core's cache, instead of converting and reading the batch once each. The
        blocks' arrays are reused from block to block (`Buffers`)."""
        buffers = Buffers()
        for rows in self.row_blocks():
            b = self.block(rows, buffers)
            for p in passes:
                p.add(b)
            buffers.recycle()


def _as_tensor(x: Any, name: str) -> torch.Tensor:
    """A torch view of `x` (no copy for contiguous NumPy arrays); parity never writes to it."""
    if isinstance(x, torch.Tensor):
        return x.detach()
    try:
        with warnings.catch_warnings():
            # torch warns that a read-only array could be written through the tensor; it is not.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(np.ascontiguousarray(x))
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InputError(f"{name} must be a torch tensor or NumPy array of shape [batch, seq]") from exc


#: what `token_arrays` calls its three inputs in error messages, unless told otherwise.
INPUT_NAMES: tuple[str, str, str] = ("train_logprobs", "rollout_logprobs", "mask")


def token_arrays(train_logprobs: Any, rollout_logprobs: Any = None, mask: Any = None, *,
                 names: tuple[str, str, str] = INPUT_NAMES) -> TokenArrays:
    """Check the three `[batch, seq]` inputs every metric takes; a `TokenArrays` is returned as is.

    Raises `InputError` for non-2-D or mismatched shapes, non-float logprobs, mask values other
    than 0/1, a mask with no valid token, NaN or +inf anywhere, and -inf at a valid token. Its
    message calls the inputs `names` (a caller with its own spelling, e.g. verl's `old_log_probs`,
    `rollout_log_probs`, `response_mask`, passes it).
    """
    if isinstance(train_logprobs, TokenArrays):
        if rollout_logprobs is not None or mask is not None:
            raise InputError("give either a TokenArrays alone or train_logprobs, rollout_logprobs and mask")
        return train_logprobs
    train_name, rollout_name, mask_name = names
    train = _as_tensor(train_logprobs, train_name)
    rollout = _as_tensor(rollout_logprobs, rollout_name)
    m = _as_tensor(mask, mask_name)
    if train.dim() != 2:
        raise InputError(f"{train_name} must be 2-D [batch, seq], got shape {tuple(train.shape)}")
    if rollout.shape != train.shape or m.shape != train.shape:
        raise InputError(
            f"{train_name} {tuple(train.shape)}, {rollout_name} {tuple(rollout.shape)} and {mask_name} "
            f"{tuple(m.shape)} must have the same [batch, seq] shape"
        )
    for name, t in ((train_name, train), (rollout_name, rollout)):
        if not t.is_floating_point():
            raise InputError(f"{name} must be floating point (log-probabilities), got {t.dtype}")
    if m.dtype != torch.bool:
        if m.is_complex() or not _zeros_and_ones(m):
            raise InputError(f"{mask_name} must be bool or hold only 0 and 1 (1 = token counts)")
        m = m != 0
    # count in int32, ~2x faster than int64 (a float64 sum would convert the whole mask)
    lengths = m.sum(-1, dtype=torch.int32).to(torch.float64)
    total = float(lengths.sum())
    if total == 0:
        raise InputError(f"{mask_name} has no valid token: at least one position must be 1/True")
    mask_dtype = mask.dtype if isinstance(mask, torch.Tensor) else np.asarray(mask).dtype
    tok = TokenArrays(train, rollout, m, lengths, total, train.dtype,
                      numpy=not isinstance(train_logprobs, torch.Tensor), mask_dtype=mask_dtype)
    for rows in tok.row_blocks():
        for name, t in ((train_name, train[rows]), (rollout_name, rollout[rows])):
            if _all_finite(t):
                continue
            finite = torch.isfinite(t)
            if bool(torch.isnan(t).any()) or bool(torch.isposinf(t).any()):
                raise InputError(f"{name} contains NaN or +inf; log-probabilities must be finite and <= 0")
            if bool((~finite & m[rows]).any()):
                raise InputError(
                    f"{name} is -inf at a valid (mask=1) token; -inf is allowed only in masked-out padding"
                )
    return tok


def _zeros_and_ones(m: torch.Tensor) -> bool:
    """Whether a numeric mask holds only 0 and 1; for integers its min and max say it (two
    reductions, no temporaries: verl's masks are int64)."""
    if m.numel() and not m.is_floating_point():
        low, high = torch.aminmax(m)
        return int(low) >= 0 and int(high) <= 1
    return bool(((m == 0) | (m == 1)).all())


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every value of `t` is finite. NumPy's check where it can read the tensor (CPU,
    float16/32/64): ~15x faster than torch's `isfinite(t).all()` on CPU (measured, docs/PERF.md)."""
    if t.device.type == "cpu" and t.dtype in (torch.float16, torch.float32, torch.float64):
        return bool(np.isfinite(t.numpy()).all())
    return bool(torch.isfinite(t).all())


def row_counts(x: torch.Tensor, *, above: float | None = None, below: float | None = None,
               mask: torch.Tensor | None = None) -> torch.Tensor:
    """How many entries of each row of `x` `[rows, seq]` are > `above` (or < `below`: give one),
    where `mask` is set when given: float64 `[rows]`, exact integers.

    On CPU the comparison runs in NumPy and the count sums a bool view in int32: ~4x faster
    than torch's `(x > t).sum(-1)`, whose comparison alone is ~8x NumPy's (measured, docs/PERF.md).
    """
    if (above is None) == (below is None):
        raise ValueError("row_counts takes one of above= and below=")
    if x.device.type == "cpu":
        values = x.numpy()
        flags = np.greater(values, above) if above is not None else np.less(values, below)
        if mask is not None:
            flags &= mask.numpy()
        return torch.from_numpy(flags).sum(-1, dtype=torch.int32).to(torch.float64)
    flags = x > above if above is not None else x < below
    if mask is not None:
        flags &= mask
    return flags.sum(-1, dtype=torch.int32).to(torch.float64)


def masked_row_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max over valid tokens of each row `[rows]`; -inf for an empty row."""
    return x.masked_fill(~mask, -math.inf).amax(-1)


def masked_row_min(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Min over valid tokens of each row `[rows]`; +inf for an empty row."""
    return x.masked_fill(~mask, math.inf).amin(-1)
