"""Per-token inputs checked once, and the float64 row blocks every metric and the correction
compute on.

`token_arrays` checks `[batch, seq]` logprobs (nats) and mask into a `TokenArrays`; each metric
is a `BlockPass`, and `TokenArrays.scan` feeds every block to several, which share its derived
arrays while cached (the monitor's step is one scan). Logprobs must be finite where the mask is
set (masked slots may hold -inf or junk); NaN or +inf anywhere is an error. Arithmetic is float64.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Protocol

import numpy as np
import torch

from parity.core.errors import InputError
from parity.core.logprobs import MAX_LOGPROB, above_bound, check_logprob_array
from parity.drift.ratio_rules import SAFETY_BOUND

#: Tokens per row block. Every per-token computation runs on blocks of whole rows of about this
#: size (512 KiB per float64 temporary), which stay in the core's L2 cache; full `[batch, seq]`
#: temporaries cost a page-faulting allocation per op, measured 4-30x slower at 10M tokens on 2
#: cores, and 2^18-token blocks (2 MiB temporaries) 1.4x slower than these at 1M (docs/PERF.md).
BLOCK_TOKENS = 1 << 16


class Buffers:
    """Float64 arrays reused from block to block of one scan: fresh ~512 KiB arrays are returned to
    the OS by glibc and faulted back page by page (~10-30 ms of a 1M-token step, docs/PERF.md).
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
    """One block of whole rows, float64 `[rows, seq]`, masked-out slots 0.

    train, rollout, log_ratio (nats); mask: bool; dense: no padding (a reduction may skip the mask).
    Cached properties are derived once and shared by every pass; never written in place. Arrays are
    reused for the next block: a pass keeps none after its `add`.
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

    lengths: valid tokens per row `[batch]`; total. dtype, numpy, mask_dtype: the caller's, so results
    go back in its kind. One built by hand (not by `token_arrays`) is checked again, from its train,
    rollout and mask, by every entry point that takes it.
    """

    train: torch.Tensor
    rollout: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor
    total: float
    dtype: torch.dtype
    numpy: bool
    mask_dtype: torch.dtype | np.dtype
    #: True when `token_arrays` made it (its checks ran); one built by hand is checked again.
    _checked: bool = field(default=False, repr=False, compare=False)

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
        """Give every block, in order, to each of `passes`, which share its conversion while cached."""
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
            array = np.asarray(x)  # a 0-d array kept 0-d (ascontiguousarray makes it (1,): errors name it)
            return torch.from_numpy(np.ascontiguousarray(array) if array.ndim else array)
    except (TypeError, ValueError, RuntimeError) as exc:  # named as given: a float128 array is an array
        got = f"an array of dtype {x.dtype}" if isinstance(x, np.ndarray) else type(x).__name__
        raise InputError(f"{name} must be a torch tensor or NumPy array of numbers, [batch, seq], got {got} "
                         f"({str(exc).split('. ')[0]})") from exc


#: what `token_arrays` calls its three inputs in error messages, unless told otherwise.
INPUT_NAMES: tuple[str, str, str] = ("train_logprobs", "rollout_logprobs", "mask")


def token_arrays(train_logprobs: Any, rollout_logprobs: Any = None, mask: Any = None, *,
                 names: tuple[str, str, str] = INPUT_NAMES) -> TokenArrays:
    """Check the three `[batch, seq]` inputs; a `TokenArrays` is returned as is. `InputError` (inputs
    called `names`) for bad shapes or dtypes, non-0/1 masks, no valid token, NaN/+inf, -inf at a
    valid token. A `TokenArrays` built by hand is checked as its train, rollout and mask would be
    (its lengths and total recomputed), in the caller's containers.
    """
    if isinstance(train_logprobs, TokenArrays):
        if rollout_logprobs is not None or mask is not None:
            raise InputError("give either a TokenArrays alone or train_logprobs, rollout_logprobs and mask")
        given = train_logprobs
        if given._checked:
            return given
        tok = token_arrays(given.train, given.rollout, given.mask, names=names)
        return replace(tok, numpy=given.numpy, mask_dtype=given.mask_dtype)
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
    numpy = not isinstance(train_logprobs, torch.Tensor)
    tok = TokenArrays(train, rollout, m, lengths, total, train.dtype, numpy=numpy, mask_dtype=mask_dtype,
                      _checked=True)
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


def checked_inputs(train_logprobs: Any, rollout_logprobs: Any = None, mask: Any = None) -> TokenArrays:
    """`token_arrays` for a metric's public entry point: arrays given are also refused where a counted
    logprob is above `MAX_LOGPROB` (probabilities or logits passed, `check_logprob_bound`). A
    `TokenArrays` `token_arrays` made is taken as its maker checked it (`build_report` and the monitor
    check the bound once, upstream, with the rollout named), so a batch is searched once per report;
    one built by hand is checked as arrays given."""
    tok = token_arrays(train_logprobs, rollout_logprobs, mask)
    if tok is not train_logprobs:
        for name, values in zip(INPUT_NAMES, (tok.train, tok.rollout)):
            check_logprob_bound(values, tok.mask, name)
    return tok


def check_logprob_bound(values: torch.Tensor, mask: torch.Tensor, name: str) -> None:
    """`parity.core.logprobs.check_logprob_array` for a tensor `[batch, seq]` (`mask` bool, True where
    a token counts): InputError naming `name[row, col]` of the first counted value above `MAX_LOGPROB`,
    the value in its own precision. On the CPU NumPy's one max; elsewhere one max on the device, and
    the masked search there only when it is above the bound (or NaN: a NaN must not hide one)."""
    if values.device.type == "cpu" and values.dtype in (torch.float16, torch.float32, torch.float64):
        check_logprob_array(values.numpy(), mask.cpu().numpy(), name)
        return
    if values.numel() == 0:
        return
    top = float(values.max())
    if not (top > MAX_LOGPROB or top != top):
        return
    bad = (values > MAX_LOGPROB) & mask.to(values.device)
    flat = int(bad.reshape(-1).to(torch.uint8).argmax())  # the first True, row-major
    r, c = divmod(flat, int(values.shape[-1]))
    if bool(bad[r, c]):
        value = values[r, c]  # bfloat16 -> float32 is exact; NumPy prints it in its precision
        raise above_bound(value.float().cpu().numpy()[()] if value.dtype == torch.bfloat16
                          else value.cpu().numpy()[()], f"{name}[{r}, {c}]")


#: integer dtypes torch has no min or max for on the CPU (NumPy's uint16/32/64 masks come in as these).
_NO_AMINMAX = (torch.uint16, torch.uint32, torch.uint64)


def _zeros_and_ones(m: torch.Tensor) -> bool:
    """Whether a numeric mask holds only 0 and 1 (for integers, min and max: verl's masks are int64)."""
    if m.numel() and not m.is_floating_point() and m.dtype not in _NO_AMINMAX:
        low, high = torch.aminmax(m)
        return int(low) >= 0 and int(high) <= 1
    return bool(((m == 0) | (m == 1)).all())


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every value is finite; NumPy where it can read the tensor (~15x torch's on CPU)."""
    if t.device.type == "cpu" and t.dtype in (torch.float16, torch.float32, torch.float64):
        return bool(np.isfinite(t.numpy()).all())
    return bool(torch.isfinite(t).all())


def row_counts(x: torch.Tensor, *, above: float | None = None, below: float | None = None,
               mask: torch.Tensor | None = None) -> torch.Tensor:
    """Entries per row of `x` `[rows, seq]` above `above` (or below `below`) where `mask`: float64
    `[rows]`. On CPU NumPy compares (~4x torch's `(x > t).sum(-1)`, docs/PERF.md).
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
