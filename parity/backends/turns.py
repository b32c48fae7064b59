"""Multi-turn trajectories on any backend, turn by turn, the way an agent loop drives an engine.

Each generated turn is a single-sample request whose prompt is the whole history (which vLLM and
SGLang may serve from their prefix cache: the mismatch this workload measures); every trajectory's
turn t goes in one `generate` call, seeded `turn_seed(s, i, t)` on every backend. Backends with
`native_turns` (the reference engine) continue in place. MoE routes are not carried across turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from parity.core.errors import BackendError, InputError
from parity.core.turns import Inject, check_top_k_turns, inject_until_generate
from parity.core.types import Request, Rollout
from parity.models.limits import model_limits

if TYPE_CHECKING:
    from parity.backends.base import Backend

#: seeds stay in the non-negative int32 range every backend accepts.
_SEED_RANGE = 2**31 - 1


def turn_seed(seed: int, sample_index: int, turn: int) -> int:
    """The seed of generated turn `turn` of sample `sample_index` of a request with seed `seed`."""
    state = np.random.SeedSequence([seed, sample_index, turn]).generate_state(1, dtype=np.uint64)[0]
    return int(state % _SEED_RANGE)


def generate(backend: Backend, requests: Sequence[Request]) -> list[Rollout]:
    """`backend.generate(requests)`, with trajectories (requests with turns) run turn by turn
    unless the backend continues them in place; rollouts in request, then sample order."""
    requests = list(requests)
    if backend.native_turns or not any(r.turns for r in requests):
        return backend.generate(requests)
    if not all(r.turns for r in requests):
        single = next(r.request_id for r in requests if not r.turns)
        raise BackendError(f"request {single!r} has no turns but others do; run trajectories and single-turn "
                           "requests in separate batches")
    check_top_k_turns(requests)  # before any turn is sent
    # an injected id past the vocabulary would reach the engine as a prompt id: fixed replies are
    # refused before any turn runs (as the reference engine does), a tool's when it replies
    limits = model_limits(backend.model_path)
    for r in requests:
        for t, turn in enumerate(r.turns):
            problem = isinstance(turn, Inject) and limits.vocabulary_problem(turn.token_ids)
            if problem:
                raise InputError(f"request {r.request_id!r}: turns[{t}] token_ids {problem}")
    states = [_Trajectory(r, i, vocab_size=limits.vocab_size) for r in requests for i in range(r.sampling.n)]
    while live := [s for s in states if s.finish_reason is None]:
        outs = backend.generate([s.next_request() for s in live])
        if len(outs) != len(live):
            raise BackendError(f"backend {backend.name!r} returned {len(outs)} rollouts for {len(live)} "
                               "turns")
        for state, out in zip(live, outs):
            state.take(out)
    return [s.rollout(backend) for s in states]


@dataclass(eq=False)
class _Trajectory:
    """One sample of a trajectory between turns (mutable)."""

    request: Request
    sample_index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turn: int = 0
    generated_turns: int = 0
    finish_reason: str | None = None
    last: Rollout | None = None
    vocab_size: int | None = None  # the model's: a tool's reply must stay below it

    def __post_init__(self) -> None:
        self._inject()

    def next_request(self) -> Request:
        """The request for the current Generate turn: the whole history as its prompt."""
        turn = self.request.turns[self.turn]  # a Generate turn: `_inject` stops at one
        sampling = self.request.sampling
        room = sampling.max_tokens - len(self.tokens)
        stops = tuple(dict.fromkeys(sampling.stop_token_ids + turn.stop_token_ids))
        params = sampling.replace(n=1, max_tokens=min(turn.max_tokens, room), stop_token_ids=stops,
                                  seed=turn_seed(sampling.seed, self.sample_index, self.generated_turns))
        return Request((*self.request.prompt_ids, *self.tokens), params,
                       request_id=f"{self.request.request_id}/{self.sample_index}/turn{self.generated_turns}")

    def take(self, out: Rollout) -> None:
        """Append a generated turn (it ended on a stop id or its max_tokens), then the injections."""
        self.tokens.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)
        self.mask.extend([1] * len(out.token_ids))
        self.turn += 1
        self.generated_turns += 1
        self.last = out
        self._inject()

    def _inject(self) -> None:
        room = self.request.sampling.max_tokens - len(self.tokens)
        history = (*self.request.prompt_ids, *self.tokens)
        injected, self.turn = inject_until_generate(self.request.turns, self.turn, history, room,
                                                    self.vocab_size)
        self.tokens.extend(injected)
        self.logprobs.extend([0.0] * len(injected))
        self.mask.extend([0] * len(injected))
        if len(self.tokens) >= self.request.sampling.max_tokens:
            self.finish_reason = "length"
        elif self.turn == len(self.request.turns):
            self.finish_reason = "stop"

    def rollout(self, backend: Backend) -> Rollout:
        """The whole trajectory as one Rollout, stamped like its last generated turn."""
        sampling = self.request.sampling
        last = self.last or Rollout(  # an opening injection filled the response: nothing was sampled
            self.request.request_id, self.sample_index, self.request.prompt_ids, (), (), "length",
            backend.name, sampling.logprobs_mode, meta=dict(backend.meta))
        meta: dict[str, Any] = {**last.meta, "generated_turns": self.generated_turns}
        return replace(last, request_id=self.request.request_id, sample_index=self.sample_index,
                       prompt_ids=self.request.prompt_ids, token_ids=tuple(self.tokens),
                       logprobs=tuple(self.logprobs), finish_reason=self.finish_reason or "length",
                       routed_experts=None, meta=meta, sampling=sampling,
                       response_mask=tuple(self.mask))
