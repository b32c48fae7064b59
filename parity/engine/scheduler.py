"""The engine's scheduler: which sequences run in each step and which tokens each one computes.

Host bookkeeping only (no torch): `admit` (waiting sequences take free slots, FIFO), `plan`
(each running sequence adds its next prefill chunk or last token while the budget lasts; its
share is a `Span`), `finish` (sequences fully computed get their sampled token; stopped ones free
their slots). Composition changes every step; with invariant kernels no token depends on it.

With `overlap`, step N+1 is planned before step N's tokens reach the host: a sequence sampled in
step N decodes its token (still on the device: a `Step.fills` row) in step N+1; one that stops on
N's token has computed one row in vain, which `finish` drops.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from parity.core.turns import inject_until_generate
from parity.core.types import Request

if TYPE_CHECKING:
    import numpy as np


@dataclass(eq=False)
class Sequence:
    """One sample of a request being generated (mutable scheduler state).

    A multi-turn trajectory continues in place: injected ids are appended as known tokens and
    prefilled as one chunk. tokens, logprobs: the response (injected logprob 0.0); mask: 1 sampled,
    0 injected; turn, turn_tokens; top_k: (ids, logprobs) per sampled token when asked; routes
    [>= routes_len, moe_layers, k] int32, filled to routes_len (`overlap.append_routes`);
    computed: tokens whose KV is cached; slot; finish_reason; pending: sampled tokens not yet on
    the host (overlapped steps); vocab_size: the model's, which a tool's reply must stay below.
    """

    request: Request
    sample_index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routes: np.ndarray | None = None
    routes_len: int = 0
    top_k: list[tuple[list[int], list[float]]] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turn: int = 0
    turn_tokens: int = 0
    computed: int = 0
    slot: int = -1
    finish_reason: str | None = None
    pending: int = 0
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        self._inject()  # a trajectory may open with an injection

    @property
    def length(self) -> int:
        """Known tokens: prompt plus sampled."""
        return len(self.request.prompt_ids) + len(self.tokens)

    @property
    def max_length(self) -> int:
        """Positions the sequence can reach: prompt plus max_tokens."""
        return len(self.request.prompt_ids) + self.request.sampling.max_tokens

    @property
    def to_compute(self) -> int:
        """Tokens to compute next: the known ones not yet computed plus a pending one, unless that
        pending token is the response's last (max_tokens)."""
        if self.pending and len(self.tokens) + self.pending >= self.request.sampling.max_tokens:
            return 0
        return self.length + self.pending - self.computed

    def chunk(self, count: int) -> list[int]:
        """The next `count` known tokens not yet computed (without copying the whole sequence)."""
        prompt = self.request.prompt_ids
        head = list(prompt[self.computed:self.computed + count])
        start = max(self.computed - len(prompt), 0)
        return head + self.tokens[start:start + count - len(head)]

    def append(self, token: int, logprob: float, eos_token_ids: tuple[int, ...]) -> None:
        """Add a sampled token; finish on EOS (unless ignored), a stop token or max_tokens. In a
        trajectory those end the turn; the next injections follow, and the trajectory finishes
        after its last turn ("stop") or when the response reaches max_tokens ("length")."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.mask.append(1)
        sampling = self.request.sampling
        stop = (not sampling.ignore_eos and token in eos_token_ids) or token in sampling.stop_token_ids
        if len(self.tokens) == sampling.max_tokens and not (stop and not self.request.turns):
            self.finish_reason = "length"
            return
        if not self.request.turns:
            if stop:
                self.finish_reason = "stop"
            return
        turn = self.request.turns[self.turn]  # a Generate turn: `_inject` stops at one
        self.turn_tokens += 1
        if stop or token in turn.stop_token_ids or self.turn_tokens == turn.max_tokens:
            self.turn += 1
            self.turn_tokens = 0
            self._inject()

    def _inject(self) -> None:
        """Append the injected turns that come next, then finish if the trajectory is over."""
        turns = self.request.turns
        if not turns:
            return
        room = self.request.sampling.max_tokens - len(self.tokens)
        history = (*self.request.prompt_ids, *self.tokens)
        injected, self.turn = inject_until_generate(turns, self.turn, history, room, self.vocab_size)
        self.tokens.extend(injected)
        self.logprobs.extend([0.0] * len(injected))
        self.mask.extend([0] * len(injected))
        if len(self.tokens) == self.request.sampling.max_tokens:
            self.finish_reason = "length"
        elif self.turn == len(turns):
            self.finish_reason = "stop"


@dataclass(frozen=True)
class Span:
    """One sequence's share of a step: rows `[offset, offset + count)` of the packed forward,
    holding its known tokens from position `seq.computed - count` on."""

    seq: Sequence
    offset: int
    count: int

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.count)

    @property
    def last_row(self) -> int:
        """The row whose logits predict the sequence's next token."""
        return self.offset + self.count - 1


@dataclass(frozen=True)
class Step:
    """One packed forward: token ids, positions and KV slots of its T rows, the span of each
    sequence in it, `ready`: the spans whose sequence samples a token after the step, and `fills`:
    (row, sequence) of each row whose id is that sequence's pending token (its id here is 0)."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    spans: tuple[Span, ...]
    ready: tuple[Span, ...]
    fills: tuple[tuple[int, Sequence], ...] = ()

    @property
    def longest_run(self) -> int:
        """Most tokens of one sequence in the step (1 in a decode-only step)."""
        return max(span.count for span in self.spans)


class Scheduler:
    """FIFO admission into `max_num_seqs` KV slots and steps of at most `max_num_batched_tokens`
    tokens, with at most `chunk_size` tokens per sequence; `overlap`: plan before the last step's
    tokens are read (see the module doc; not for trajectories, whose next tokens follow the last)."""

    def __init__(self, sequences: list[Sequence], *, max_num_seqs: int, chunk_size: int,
                 max_num_batched_tokens: int, eos_token_ids: tuple[int, ...], overlap: bool = False) -> None:
        self.overlap = overlap
        self.chunk_size = chunk_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = eos_token_ids
        # a trajectory whose opening injection fills its whole response has nothing to sample
        self.waiting = deque(seq for seq in sequences if seq.finish_reason is None)
        self.running: list[Sequence] = []
        self.free_slots = list(range(max_num_seqs))

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def admit(self) -> None:
        """Move waiting sequences into free slots, lowest slot first."""
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop(0)
            self.running.append(seq)

    def plan(self) -> Step:
        """The next step over the running sequences; marks its tokens computed."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[Span] = []
        fills: list[tuple[int, Sequence]] = []
        budget = self.max_num_batched_tokens
        for seq in self.running:
            todo = seq.to_compute
            if todo == 0:
                continue  # its last token is still on the device
            count = min(self.chunk_size, todo, budget)
            if count == 0:
                break  # the budget is spent
            budget -= count
            spans.append(Span(seq, len(ids), count))
            if seq.pending:  # all known tokens are computed: the one row is the pending token
                fills.append((len(ids), seq))
                ids.append(0)
            else:
                ids.extend(seq.chunk(count))
            positions.extend(range(seq.computed, seq.computed + count))
            slots.extend([seq.slot] * count)
            seq.computed += count
        ready = tuple(span for span in spans if span.seq.computed == span.seq.length + span.seq.pending)
        if self.overlap:
            for span in ready:
                span.seq.pending += 1
        return Step(ids, positions, slots, tuple(spans), ready, tuple(fills))

    def finish(self, ready: tuple[Span, ...], tokens: list[int], logprobs: list[float]) -> list[Sequence]:
        """Give each ready sequence its sampled token; free the slots of those that stop, which are
        returned (their `slot` and `computed` say what they wrote). A sequence that stopped the step
        before (overlap) drops the token."""
        for span, token, logprob in zip(ready, tokens, logprobs, strict=True):
            seq = span.seq
            if self.overlap:
                seq.pending -= 1
            if seq.finish_reason is None:
                seq.append(token, logprob, self.eos_token_ids)
        stopped = [s for s in self.running if s.finish_reason is not None]
        for seq in stopped:
            self.running.remove(seq)
            self.free_slots.append(seq.slot)
        self.free_slots.sort()
        return stopped
