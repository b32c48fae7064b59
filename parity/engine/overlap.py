"""A step's sampled tokens in flight: launched on the device, read on the host one step later.

`Draw.launch` queues the copy of a step's tokens and logprobs to pinned host memory behind the
sampler and records an event; `read` waits for that event only, so the next step (queued after
the copy) keeps the device busy while the host finishes this one. `Fill` writes a draw's tokens
into the next step's input ids on the device (the rows of sequences decoding their pending token).
`Routes` does for a step's recorded MoE routes what `Draw` does for its tokens.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from parity.engine.inputs import device_tensor
from parity.engine.scheduler import Sequence, Span


@dataclass(frozen=True, eq=False)
class Fill:
    """Rows [F] of a step's input ids and the tokens [F] (on the device) that go there."""

    rows: torch.Tensor
    tokens: torch.Tensor

    def apply(self, ids: torch.Tensor) -> None:
        """Write the tokens into `ids` [T] int64 in place, queued on the device."""
        ids.index_copy_(0, self.rows, self.tokens)


@dataclass(frozen=True, eq=False)
class Draw:
    """One step's sampled tokens [R] (device), and their copy with the logprobs [2, R] float64 on
    the host once `event` has passed (no event on CPU: already there); `ready` the spans sampled."""

    ready: tuple[Span, ...]
    tokens: torch.Tensor
    host: torch.Tensor
    event: torch.cuda.Event | None

    @classmethod
    def launch(cls, ready: tuple[Span, ...], tokens: torch.Tensor, logprobs: torch.Tensor) -> Draw:
        """Queue the device->host copy of tokens [R] int64 and logprobs [R] float32."""
        # float64 holds every token id and every float32 logprob exactly: one copy carries both.
        both = torch.stack([tokens.to(torch.float64), logprobs.to(torch.float64)])
        return cls(ready, tokens, *_to_host(both))

    def read(self) -> tuple[list[int], list[float]]:
        """The tokens and logprobs on the host, waiting for this draw's copy only."""
        if self.event is not None:
            self.event.synchronize()
        host_tokens, host_logprobs = self.host.tolist()
        return [int(t) for t in host_tokens], host_logprobs

    def fill(self, fills: Seq[tuple[int, Sequence]]) -> Fill:
        """The `Fill` of a step's (row, sequence) pairs whose ids are this draw's tokens."""
        index = {id(span.seq): i for i, span in enumerate(self.ready)}
        rows_and_sources = device_tensor([[row for row, _ in fills], [index[id(seq)] for _, seq in fills]],
                                         torch.int64, self.tokens.device)
        return Fill(rows_and_sources[0], self.tokens.index_select(0, rows_and_sources[1]))


def _to_host(x: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Queue `x`'s copy to pinned host memory and record its event (none on CPU: `x` is there)."""
    if x.device.type != "cuda":
        return x, None
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


@dataclass(frozen=True, eq=False)
class Routes:
    """A step's recorded routes [>= T, moe_layers, k] int32 on their way to the host, and the spans
    whose rows they hold."""

    spans: tuple[Span, ...]
    host: torch.Tensor
    event: torch.cuda.Event | None

    @classmethod
    def launch(cls, spans: tuple[Span, ...], routes: torch.Tensor) -> Routes:
        """Queue the copy of routes (a graph's output buffer may be overwritten by the next replay:
        the copy is queued before it)."""
        return cls(spans, *_to_host(routes))

    def live(self) -> Routes:
        """Without the spans of sequences already stopped: with overlap, a sequence that stopped on
        the step before's token computed its row of this step in vain. Call it after the step
        before's tokens are given and before this step's are."""
        return Routes(tuple(s for s in self.spans if s.seq.finish_reason is None), self.host, self.event)

    def keep(self) -> None:
        """Write each span's routes [count, moe_layers, k] int32 into its sequence's buffer, after
        the copy: one buffer a sequence, filled step by step while the device runs the next step
        (joining ~512 slices a sequence once the last step ended took 0.2 s for 256 x 48 layers)."""
        if self.event is not None:
            self.event.synchronize()
        host = self.host.numpy()
        for span in self.spans:
            append_routes(span.seq, host[span.rows])


def append_routes(seq: Sequence, rows: np.ndarray) -> None:
    """rows [count, moe_layers, k] after `seq.routes[:seq.routes_len]`, in place. The buffer doubles
    as it fills, up to the positions a rollout of max_tokens computes (`seq.max_length - 1`: a
    sequence that runs to the end takes it without a copy), and past them only for a trajectory's
    injected tokens; memory follows the tokens computed, not max_tokens."""
    end = seq.routes_len + rows.shape[0]
    held = 0 if seq.routes is None else seq.routes.shape[0]
    if end > held:
        grown = np.empty((max(end, min(2 * held, seq.max_length - 1)), *rows.shape[1:]), dtype=rows.dtype)
        if seq.routes is not None:
            grown[:seq.routes_len] = seq.routes[:seq.routes_len]
        seq.routes = grown
    seq.routes[seq.routes_len:end] = rows
    seq.routes_len = end
