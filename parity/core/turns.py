"""Multi-turn trajectories: the turns of an agentic rollout (no torch).

After the prompt, each turn generates (`Generate`: at most `max_tokens`, ending on EOS or a stop
id) or injects tokens the model did not sample (`Inject`: fixed, or a function of the ids so far).
`SamplingParams.max_tokens` bounds the whole response, as verl's `response_length`; an injection
that does not fit is cut and the trajectory ends with "length". The `Rollout` has
`response_mask` 1 on generated, 0 on injected tokens (logprobs there are 0.0 and unread); turn
indices come from the mask alone (`turn_index`), so verl dumps get the same per-turn breakdown.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from parity.core.errors import ConfigError
from parity.core.strict import check_token_ids

if TYPE_CHECKING:
    from parity.core.types import Request

#: a deterministic injection: token ids so far (prompt and response) -> the ids to inject.
InjectFn = Callable[[tuple[int, ...]], Sequence[int]]


@dataclass(frozen=True)
class Generate:
    """A generated turn: at most `max_tokens` sampled tokens; it ends early on EOS (unless the
    sampling ignores EOS), a stop id of the sampling or one of `stop_token_ids` (kept)."""

    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"Generate.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        object.__setattr__(self, "stop_token_ids",
                           check_token_ids(self.stop_token_ids, "Generate.stop_token_ids", ConfigError))

    def to_dict(self) -> dict[str, Any]:
        return {"generate": self.max_tokens, "stop_token_ids": list(self.stop_token_ids)}


@dataclass(frozen=True)
class Inject:
    """An injected turn: fixed `token_ids`, or `fn(ids so far)`; `name` identifies a function in
    records and reports (a built-in tool's name, `parity.workload.tools`)."""

    token_ids: tuple[int, ...] = ()
    fn: InjectFn | None = None
    name: str = ""

    def __post_init__(self) -> None:
        ids = check_token_ids(self.token_ids, "Inject.token_ids", ConfigError)
        object.__setattr__(self, "token_ids", ids)
        has_ids, has_fn = bool(self.token_ids), self.fn is not None
        if (has_ids and has_fn) or not (has_ids or has_fn or self.name):
            raise ConfigError("Inject takes either token_ids (a fixed reply) or fn (a function of the ids "
                              "so far), not both and not neither")

    def tokens(self, history: tuple[int, ...], vocab_size: int | None = None) -> tuple[int, ...]:
        """The ids this turn injects after `history` (prompt and response so far); a function's
        reply is checked (and against `vocab_size` when given: an id past it would index no embedding)."""
        if self.fn is None:
            if not self.token_ids:
                raise ConfigError(f"injection {self.name!r} has no function bound; load it through a case "
                                  "or parity.workload.tools.bind_tools with the model")
            return self.token_ids
        out = self.fn(history)
        where = f"injection {self.name or self.fn!r}: the ids it returned"
        # checked, never converted: int() would round 3.9 to 3, parse "7" and take True for 1
        ids = check_token_ids(tuple(out) if isinstance(out, Iterator) else out, where, ConfigError)
        bad = next((t for t in ids if vocab_size is not None and t >= vocab_size), None)
        if bad is not None:
            raise ConfigError(f"{where} hold token id {bad}, outside the model's vocabulary "
                              f"[0, {vocab_size}); the tool must reply with ids of this model's tokenizer")
        return ids

    def to_dict(self) -> dict[str, Any]:
        return {"inject": list(self.token_ids)} if self.token_ids else {"tool": self.name}


Turn = Generate | Inject


def check_turns(turns: Sequence[Any], where: str) -> tuple[Turn, ...]:
    """`turns` as a tuple of Generate/Inject with at least one Generate; ConfigError otherwise."""
    turns = tuple(turns)
    for i, turn in enumerate(turns):
        if not isinstance(turn, (Generate, Inject)):
            raise ConfigError(f"{where}: turns[{i}] is a {type(turn).__name__}, not a parity.Generate or "
                              "parity.Inject")
    if turns and not any(isinstance(t, Generate) for t in turns):
        raise ConfigError(f"{where}: turns has no Generate turn; a trajectory samples at least one turn")
    return turns


def turns_from_dict(items: Sequence[dict[str, Any]]) -> tuple[Turn, ...]:
    """The inverse of each turn's `to_dict` (a tool comes back unbound:
    `parity.workload.tools.bind_tools`)."""
    turns: list[Turn] = []
    for item in items:
        if "generate" in item:
            turns.append(Generate(item["generate"], item.get("stop_token_ids", ())))
        elif "inject" in item:
            turns.append(Inject(item["inject"]))
        else:
            turns.append(Inject(name=str(item["tool"])))
    return tuple(turns)


def inject_until_generate(turns: tuple[Turn, ...], turn: int, history: tuple[int, ...],
                          room: int, vocab_size: int | None = None) -> tuple[list[int], int]:
    """(injected ids cut to `room`, index of the next Generate turn or len(turns)) from turn `turn`;
    a function's reply past `vocab_size` (when given) is a ConfigError naming the injection."""
    injected: list[int] = []
    while turn < len(turns) and isinstance(turns[turn], Inject):
        injected.extend(turns[turn].tokens(history + tuple(injected), vocab_size))
        turn += 1
    return injected[:room], turn


def turn_index(mask: Sequence[int]) -> list[int]:
    """Per response token, the index of the generated turn it belongs to (0-based: runs of mask-1
    tokens in order), -1 at injected (mask-0) tokens."""
    out, turn, previous = [], -1, 0
    for m in mask:
        if m and not previous:
            turn += 1
        out.append(turn if m else -1)
        previous = m
    return out


def after_injection(mask: Sequence[int]) -> list[bool]:
    """Per response token: whether it is the first generated token right after injected ones."""
    return [bool(m) and i > 0 and not mask[i - 1] for i, m in enumerate(mask)]


def check_top_k_turns(requests: Sequence[Request]) -> None:
    """ConfigError for a trajectory asking for top-k logprobs, as the reference engine refuses it: run
    turn by turn (`parity.backends.turns`), the rollout would carry only the last turn's rows (none for
    injected tokens)."""
    for r in requests:
        if r.turns and r.sampling.top_k_logprobs:
            raise ConfigError(f"request {r.request_id!r}: top_k_logprobs does not run with multi-turn "
                              "trajectories yet; set it to 0 or drop the turns")
