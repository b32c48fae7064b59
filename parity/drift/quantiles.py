"""Exact quantiles of the clamped log ratio over a batch's valid tokens, in the batch's one scan.

The ranks `summarize` needs lie among a few thousand values at either end, so `QuantilePass`
reads bracket values off a small sample, keeps from each cached block only the values beyond
them, and partitions those (a full `np.partition` costs ~14 ms at 1M). Exact: a bracket that
falls short takes a second scan.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from parity.drift.ratio_rules import clamp_log_ratio
from parity.drift.token_arrays import Block, TokenArrays

#: ranks within this share of either end of the data are found among the tail values only.
_TAIL = 0.05
#: values sampled to place a tail's bracket; below 8x this many, one partition of all.
_SAMPLE = 4096


def quantile_ranks(n: int, qs: Sequence[float]) -> list[int]:
    """The 0-based ranks whose values NumPy's linear interpolation of quantiles `qs` of n values reads."""
    pos = [q * (n - 1) for q in qs]
    return sorted({math.floor(p) for p in pos} | {min(math.floor(p) + 1, n - 1) for p in pos})


def interpolate(order: dict[int, float], n: int, qs: Sequence[float],
                increasing: Callable[[float], float]) -> list[float]:
    """Quantiles `qs` of `increasing(values)`, linearly interpolated (NumPy's default method),
    from the order statistics `order` (rank -> value) of the n values at `quantile_ranks`."""
    out = []
    for q in qs:
        p = q * (n - 1)
        lo = math.floor(p)
        low, high = increasing(order[lo]), increasing(order[min(lo + 1, n - 1)])
        out.append(low + (p - lo) * (high - low))
    return out


def order_statistics(values: np.ndarray, ks: Sequence[int]) -> dict[int, float]:
    """The k-th smallest of `values` (0-based) for each k of `ks`, exactly (sample brackets per tail;
    a bracket that falls short, or a middle rank, takes the full partition).
    """
    n = values.size
    out: dict[int, float] = {}
    rest = list(ks)
    if n >= 8 * _SAMPLE:
        low_bracket, high_bracket = _brackets(np.sort(values[:: n // _SAMPLE]), n, ks)
        if low_bracket is not None:
            out.update(_low_tail(values[values <= low_bracket], ks, n))
        if high_bracket is not None:
            out.update(_high_tail(values[values >= high_bracket], ks, n))
        rest = [k for k in rest if k not in out]
    if rest:
        part = np.partition(values, rest)
        out.update({k: float(part[k]) for k in rest})
    return out


def _brackets(sample: np.ndarray, n: int, ks: Sequence[int]) -> tuple[float | None, float | None]:
    """Bracket values (low, high; None: no rank there, or an empty sample) from a sorted sample, with a
    2x-and-8-values margin."""
    if sample.size == 0:  # every strided slot was padding (e.g. column 0 masked, seq dividing the stride)
        return None, None
    low = [k for k in ks if k < _TAIL * n]
    high = [k for k in ks if k >= (1 - _TAIL) * n]
    low_bracket = high_bracket = None
    if low:
        low_bracket = float(sample[min(sample.size - 1, 2 * (max(low) * sample.size) // n + 8)])
    if high:
        shallowest = n - min(high)  # values at or above the smallest high rank
        high_bracket = float(sample[max(0, sample.size - 1 - 2 * (shallowest * sample.size) // n - 8)])
    return low_bracket, high_bracket


def _low_tail(tail: np.ndarray, ks: Sequence[int], n: int) -> dict[int, float]:
    """The low ranks of `ks` from `tail`, every value <= a bracket; {} when it holds too few."""
    low = [k for k in ks if k < _TAIL * n]
    if tail.size <= max(low):
        return {}
    part = np.partition(tail, low)
    return {k: float(part[k]) for k in low}


def _high_tail(tail: np.ndarray, ks: Sequence[int], n: int) -> dict[int, float]:
    """The high ranks of `ks` from `tail`, every value >= a bracket; {} when it holds too few."""
    high = [k for k in ks if k >= (1 - _TAIL) * n]
    below = n - tail.size  # values under the bracket
    if below > min(high):
        return {}
    part = np.partition(tail, [k - below for k in high])
    return {k: float(part[k - below]) for k in high}


class QuantilePass:
    """Quantiles `qs` of c = clamp(Δ, ±20) over a batch's valid tokens (a
    `parity.drift.token_arrays.BlockPass`); `result(increasing)` gives those of `increasing(c)`."""

    def __init__(self, tok: TokenArrays, qs: Sequence[float]) -> None:
        self.tok, self.qs = tok, tuple(qs)
        self.n = int(tok.total)
        self.ks = quantile_ranks(self.n, self.qs)
        self._low: list[np.ndarray] = []
        self._high: list[np.ndarray] = []
        self._all: list[np.ndarray] | None = None
        brackets = (None, None)
        if self.n >= 8 * _SAMPLE and all(k < _TAIL * self.n or k >= (1 - _TAIL) * self.n for k in self.ks):
            brackets = _brackets(self._sample(), self.n, self.ks)
        self.low_bracket, self.high_bracket = brackets
        if brackets == (None, None):
            self._all = []  # a small batch, a middle rank or an empty sample: keep every value

    def _sample(self) -> np.ndarray:
        """c at ~2 x `_SAMPLE` slots evenly strided over the batch (valid ones), sorted."""
        batch, seq = self.tok.shape
        flat = torch.arange(0, batch * seq, max(1, batch * seq // (2 * _SAMPLE)), device=self.tok.mask.device)
        rows, cols = flat // seq, flat % seq
        valid = self.tok.mask[rows, cols]
        train, rollout = (x[rows, cols][valid].to(torch.float64) for x in (self.tok.train, self.tok.rollout))
        return np.sort(clamp_log_ratio(train - rollout).cpu().numpy())

    def add(self, b: Block) -> None:
        c = b.clamped.cpu().numpy()
        if self._all is not None:
            self._all.append(_valid(c, b))
            return
        mask = None if b.dense else b.mask.cpu().numpy()
        for tail, compare, bracket in ((self._low, np.less_equal, self.low_bracket),
                                       (self._high, np.greater_equal, self.high_bracket)):
            if bracket is not None:
                flags = compare(c, bracket)
                if mask is not None:
                    flags &= mask
                tail.append(c[flags])

    def result(self, increasing: Callable[[float], float]) -> list[float]:
        """The quantiles of `increasing(c)` (an order-preserving function), once every block was added."""
        order: dict[int, float] = {}
        if self._low:
            order.update(_low_tail(np.concatenate(self._low), self.ks, self.n))
        if self._high:
            order.update(_high_tail(np.concatenate(self._high), self.ks, self.n))
        if len(order) < len(self.ks):  # a bracket fell short: every value, from a second scan
            values = self._all if self._all is not None else [_valid(b.clamped.cpu().numpy(), b)
                                                               for b in self.tok.blocks()]
            order = order_statistics(np.concatenate(values), self.ks)
        return interpolate(order, self.n, self.qs, increasing)


def _valid(c: np.ndarray, b: Block) -> np.ndarray:
    return c.reshape(-1).copy() if b.dense else c[b.mask.cpu().numpy()]
