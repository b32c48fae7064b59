"""Pushing the trained weights to every backend, and proving they arrived.

A push takes the backend's own path (`Backend.update_weights`); the proof is digests, not
logprobs: every tensor the backend shows (`weight_checksums`) must match the trainer's in its
layout (`expected_checksums`), so a skipped or stale push is caught at any learning rate. Tensors
it cannot show (vLLM-CPU packs linear weights into GEMM kernels) are counted as `hidden`. Adapter
updates check the frozen base and the reported adapter. Step 0's push is verified before training.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from parity.backends import Backend
from parity.core.errors import BackendError
from parity.loop.adapter import AdapterWeights
from parity.loop.weights import FullWeights

#: mismatched tensor names a report lists (the count is always complete).
LISTED = 5


@dataclass(frozen=True)
class SyncCheck:
    """One verification of one backend's weights: in_sync (every shown digest matched, at least one),
    checked, hidden (not comparable), mismatched (first `LISTED` names), mismatches, seconds.
    """

    in_sync: bool
    checked: int
    hidden: int
    mismatched: tuple[str, ...]
    mismatches: int
    seconds: float

    def describe(self) -> str:
        hidden = f"; {self.hidden} more it cannot show" if self.hidden else ""
        if self.in_sync:
            return f"all {self.checked} tensors it shows match{hidden}"
        return (f"{self.mismatches} of {self.checked} tensors differ from the trainer's "
                f"(e.g. {', '.join(self.mismatched)}){hidden}")


def verify(weights: FullWeights | AdapterWeights, backend: Backend, *,
           started: float | None = None) -> SyncCheck:
    """Compare `backend`'s weight digests with the digests the trained weights give in its layout."""
    started = time.perf_counter() if started is None else started
    expected = weights.expected_checksums(backend)
    actual = backend.weight_checksums()
    hidden = [name for name in expected if name in actual and actual[name] is None]
    shown = {name: digest for name, digest in expected.items() if name not in hidden}
    differ = sorted(name for name, digest in shown.items() if actual.get(name) != digest)
    stale = weights.stale_adapter(backend)
    differ = differ if stale is None else [stale, *differ]
    return SyncCheck(in_sync=not differ and bool(shown), checked=len(shown), hidden=len(hidden),
                     mismatched=tuple(differ[:LISTED]), mismatches=len(differ),
                     seconds=time.perf_counter() - started)


def push(weights: FullWeights | AdapterWeights, backend: Backend) -> SyncCheck:
    """Push the trained weights to `backend`, then verify them."""
    started = time.perf_counter()
    weights.push(backend)
    return verify(weights, backend, started=started)


def initial_sync(weights: FullWeights | AdapterWeights, backend: Backend) -> SyncCheck:
    """The push before step 0: the trainer's starting weights, which must verify; otherwise the
    backend cannot take part (BackendError naming what differs)."""
    check = push(weights, backend)
    if not check.in_sync:
        raise BackendError(f"backend {backend.name!r}: after pushing the trainer's starting weights, "
                           f"{check.describe()}; its weight sync cannot be verified, so the loop cannot "
                           "use it")
    return check
