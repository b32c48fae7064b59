"""Pushing the trained weights to every backend, and proving they arrived.

A push goes through the backend's own weight-sync path (`Backend.update_weights`: the reference
engine copies in place, vLLM reloads through `reload_weights`, vLLM's server through its
`/collective_rpc` endpoint). The proof is a comparison of weight digests, not of logprobs: the
backend reports a digest of every tensor it computes with (`Backend.weight_checksums`), and the
trainer's tensors, laid out and cast the way that backend holds them, must give the same digests
(`Backend.expected_checksums`). A skipped, partial or stale push leaves at least one digest
unchanged, whatever the learning rate; a drift in logprobs could not tell a small update from the
engine's own rounding noise.

A backend may compute with tensors it cannot show (its digest is None): vLLM-CPU packs every
linear layer's weight into a oneDNN or SGL GEMM kernel and drops the tensor, so on CPU only the
embedding, the norms and the LM head can be read back. Those hidden tensors are counted
(`SyncCheck.hidden`), not checked: a push that skipped them alone would pass. Every other tensor
is checked, and Adam moves every trained parameter every step, so a skipped push, or a push that
reached no readable tensor, is caught.

With an adapter-only update (`parity.loop.adapter`), the push is the adapter and the digests are
the frozen base's (they must never change), plus the adapter the backend reports applying.

Before step 0 the loop pushes the trainer's initial weights and verifies them: a backend whose
digests cannot be matched even then is refused before any training step, with the reason.
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
    """One verification of one backend's weights.

    in_sync: every digest the backend shows matched (and it showed one at least). checked:
    tensors compared; hidden: tensors the backend computes with but cannot show (not compared).
    mismatched: names of the first `LISTED` tensors whose digests differ or are missing;
    mismatches: how many differ. seconds: time of the push and the check.
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
