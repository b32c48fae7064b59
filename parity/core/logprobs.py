"""parity's one rule for values handed over as log-probabilities (Monitor, verl / NeMo-RL / slime
helpers, dumps, records, `parity score`). NumPy only.

A logprob is <= 0 nats; `MAX_LOGPROB` allows an engine's log(1) rounded a hair above 0. A counted
value above it means probabilities, logits or sign-flipped logprobs were passed, and every figure
would be silently wrong. -inf is a token outside the sampling support (counted apart); NaN and
+inf are never logprobs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from parity.core.errors import InputError

#: the largest value accepted as a logprob (nats): rounding above log(1) = 0, nothing more.
MAX_LOGPROB = 1e-4
#: what a value above `MAX_LOGPROB` means, in every message that refuses one.
NOT_LOGPROBS = "looks like probabilities/logits, not logprobs (a logprob is <= 0)"


def above_bound(value: float | np.floating, name: str) -> InputError:
    """The error for one counted value above `MAX_LOGPROB` (`name` says where it is); a NumPy
    scalar prints in its own precision (float32 0.9 as 0.9, not 0.8999999761581421)."""
    return InputError(f"{name} is {value!s} > {MAX_LOGPROB}: {NOT_LOGPROBS}; pass the log-probabilities "
                      "of the sampled tokens")


def check_logprob_values(values: Sequence[Any], name: str = "logprob", where: str = "") -> None:
    """Every value of a list a number <= `MAX_LOGPROB` or -inf, else InputError naming the index
    (prefixed with `where`, e.g. the request it answers)."""
    for t, v in enumerate(values):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v) or v == math.inf:
            raise InputError(f"{where}{name} {t} is {v!r}; every logprob must be a number <= 0 (-inf "
                             "for a token outside the sampling support)")
        if v > MAX_LOGPROB:
            raise above_bound(v, f"{where}{name} {t}")


def first_above_bound(values: np.ndarray, mask: np.ndarray | None) -> tuple[int, ...] | None:
    """The index of the first counted value of float `values` (`mask` True where a token counts;
    None: all) above `MAX_LOGPROB`, or None. One max when nothing is wrong; padding may hold anything,
    so a max above the bound is looked at again under the mask. The max skips NaN (`fmax`, as fast):
    a NaN anywhere must not hide a value above the bound elsewhere.
    """
    if values.size == 0 or values.dtype.kind != "f":
        return None
    top = np.fmax.reduce(values, axis=None)
    if not top > MAX_LOGPROB:  # all NaN: nothing above the bound (NaN is the finiteness check's)
        return None
    bad = values > MAX_LOGPROB
    if mask is not None:
        bad &= mask.astype(bool, copy=False)
    if not bad.any():
        return None
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), bad.shape))


def check_logprob_array(values: np.ndarray, mask: np.ndarray | None, name: str) -> None:
    """InputError naming the first counted value of `values` `[batch, seq]` (`mask` True where a token
    counts; None: all) above `MAX_LOGPROB` (`first_above_bound`)."""
    index = first_above_bound(values, mask)
    if index is None:
        return
    where = f" {index[0]}" if len(index) == 1 else "[" + ", ".join(map(str, index)) + "]"
    raise above_bound(values[index], f"{name}{where}")
