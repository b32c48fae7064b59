"""Per-token inputs checked once, and the float64 row blocks every metric and the correction
compute on.

`token_arrays` checks the three `[batch, seq]` inputs (torch tensors or NumPy arrays of per-token
log-probabilities in nats, and a bool or 0/1 mask of the tokens that count) and returns a
`TokenArrays`, which `parity.metrics` and `parity.correction` read block by block (`Block`: whole
rows in float64, padding set to 0). Conventions:

- Logprobs must be finite wherever the mask is set. Masked-out slots may hold `-inf` (a common
  padding value) or any finite junk; they are ignored. NaN or `+inf` anywhere is an error: a
  log-probability is never either, so the producer is broken.
- All arithmetic runs in float64 whatever the input dtype, so float32 and float64 inputs agree
  to the precision of the inputs themselves.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from parity.errors import InputError

#: Tokens per row block. Every per-token computation runs on blocks of whole rows of about this
#: size (512 KiB per float64 temporary), which stay in the core's L2 cache; full `[batch, seq]`
#: temporaries cost a page-faulting allocation per op, measured 4-30x slower at 10M tokens on 2
#: cores, and 2^18-token blocks (2 MiB temporaries) 1.4x slower than these at 1M (docs/PERF.md).
BLOCK_TOKENS = 1 << 16


@dataclass(frozen=True)
class Block:
    """One block of whole rows, in float64 with masked-out slots set to 0.

    rows: the block's row range in the batch.
    train, rollout: logprobs (nats) `[rows, seq]`, 0 where `mask` is False.
    log_ratio: `train - rollout` (nats), 0 where `mask` is False.
    mask: bool `[rows, seq]`; maskf: the same as 0.0/1.0.
    dense: every slot of the block is valid (no padding): a masked reduction may skip its mask.
    """

    rows: slice
    train: torch.Tensor
    rollout: torch.Tensor
    log_ratio: torch.Tensor
    mask: torch.Tensor
    maskf: torch.Tensor
    dense: bool = False


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

    def blocks(self) -> Iterator[Block]:
        """The batch as float64 `Block`s of whole rows, in order."""
        zero = torch.zeros((), dtype=torch.float64, device=self.mask.device)
        seq = self.shape[1]
        for rows in self.row_blocks():
            mask = self.mask[rows]
            train, rollout = self.train[rows].to(torch.float64), self.rollout[rows].to(torch.float64)
            dense = bool((self.lengths[rows] == seq).all())
            if not dense:  # padding to zero (a block of full rows has none)
                train, rollout = torch.where(mask, train, zero), torch.where(mask, rollout, zero)
            yield Block(rows, train, rollout, train - rollout, mask, mask.to(torch.float64), dense)

    def with_blocks(self) -> TokenArrays:
        """The same arrays with their float64 blocks made once and kept: every metric given the
        result reuses them instead of converting and masking the batch again. For several metrics
        of one modest batch (the monitor's step: ~40 bytes a token kept, 40 MB for 1M tokens);
        a large batch is better converted block by block, each time (`blocks`)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(TokenArrays)}
        return _KeptBlocks(**fields, kept=tuple(self.blocks()))


@dataclass(frozen=True)
class _KeptBlocks(TokenArrays):
    """`TokenArrays` whose blocks were made once (`TokenArrays.with_blocks`)."""

    kept: tuple[Block, ...] = ()

    def blocks(self) -> Iterator[Block]:
        return iter(self.kept)

    def with_blocks(self) -> TokenArrays:
        return self


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
    lengths = m.sum(-1).to(torch.float64)  # count in integers: a float64 sum converts the whole mask
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


def valid_values(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`x[mask]` (1-D, row-major); through NumPy on CPU, ~10x faster than torch's boolean index."""
    if x.device.type == "cpu":
        return torch.from_numpy(x.numpy()[mask.numpy()])
    return x[mask]


def masked_row_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max over valid tokens of each row `[rows]`; -inf for an empty row."""
    return x.masked_fill(~mask, -math.inf).amax(-1)


def masked_row_min(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Min over valid tokens of each row `[rows]`; +inf for an empty row."""
    return x.masked_fill(~mask, math.inf).amin(-1)
