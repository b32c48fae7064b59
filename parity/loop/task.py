"""What the loop trains on: prompts and a reward, a built-in verifiable task or the caller's own.

Built-in: seeded `"a+b="`, `"a-b="`, `"a*b="` prompts; reward 1.0 when the decoded response starts
with the exact answer's digits (read off the prompt, so any `a op b=` prompts work). A tiny model
almost never answers, and GRPO learns nothing from equal rewards, so a wrong answer earns
`FORMAT_CREDIT` times the share of the answer's length it covers with digits. Caller's own:
`Task(prompts, reward)`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from parity.core.errors import ConfigError
from parity.core.types import Rollout, check_int
from parity.workload.prompts import tokenizer

#: a reward function: one rollout (prompt, response, request id) -> a finite float.
Reward = Callable[[Rollout], float]
#: reward of a wrong response whose digits cover the answer's length (see the module doc).
FORMAT_CREDIT = 0.1
#: the operators of the built-in task.
OPERATORS = "+-*"
_LEADING_INTEGER = re.compile(r"\s*(-?\d+)")
#: a problem at the end of a prompt: "a op b=" (integers, op one of OPERATORS).
_PROBLEM = re.compile(r"(-?\d+)\s*([-+*])\s*(-?\d+)\s*=\s*$")
#: what may not come just before a problem: a digit or decimal point (its first number would be cut
#: short), or an operator or closing bracket (the problem would be the tail of a longer expression).
_CHAINED = re.compile(r"(?:[\d.]|[-+*/^)×÷]\s*)$")


@dataclass(frozen=True)
class Task:
    """Prompts (token ids, one request per prompt) and the reward of one rollout.

    name: how reports name the task ("arithmetic", "case smoke", a function's name).
    """

    name: str
    prompts: tuple[tuple[int, ...], ...]
    reward: Reward

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ConfigError("a loop task needs at least one prompt")
        if not callable(self.reward):
            raise ConfigError(f"reward must be a function of a Rollout, got {type(self.reward).__name__}")


def problems(count: int, seed: int, max_operand: int) -> list[tuple[str, int]]:
    """`count` arithmetic problems `("a+b=", answer)`, drawn with `seed` (the same on every machine)."""
    check_int(count, "count", low=1)
    check_int(max_operand, "max_operand", low=1)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        a, b = (int(v) for v in rng.integers(0, max_operand + 1, size=2))
        op = OPERATORS[int(rng.integers(0, len(OPERATORS)))]
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        out.append((f"{a}{op}{b}=", answer))
    return out


def answer_of(prompt: str) -> int | None:
    """The exact answer of the problem a prompt ends with ("... 12+7=" -> 19), or None."""
    match = _PROBLEM.search(prompt)
    # a longer expression ("12*3+4=", "10-5-3=", "1.5+2=") is not the "a op b=" at its end: no answer
    if match is None or _CHAINED.search(prompt[:match.start()]):
        return None
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return a + b if op == "+" else a - b if op == "-" else a * b


def arithmetic_reward(text: str, answer: int) -> float:
    """1.0 when `text` starts (after spaces) with exactly `answer`'s digits, else the format
    credit: FORMAT_CREDIT x min(1, digit characters in `text` / len(str(answer)))."""
    match = _LEADING_INTEGER.match(text)
    # the digits as written: int() would also take "019" for 19 and "-0" or "00" for 0
    if match is not None and match.group(1) == str(answer):
        return 1.0
    digits = sum(ch.isdigit() for ch in text)
    return FORMAT_CREDIT * min(1.0, digits / len(str(answer)))


def arithmetic_task(model: str, *, count: int = 8, seed: int = 0, max_operand: int = 20) -> Task:
    """The built-in task on `model` (its tokenizer encodes the prompts and decodes responses)."""
    tok = tokenizer(model, where="loop task")
    prompts = tuple(tuple(tok.encode(text)) for text, _ in problems(count, seed, max_operand))
    return Task("arithmetic", prompts, arithmetic_check(model))


def arithmetic_check(model: str, prompts: Sequence[Sequence[int]] = ()) -> Reward:
    """The arithmetic reward on `model`'s tokenizer: each rollout's answer is read off its prompt.
    `prompts` (token ids) are checked up front: each must end in a problem, else ConfigError."""
    tok = tokenizer(model, where="loop task")
    known = len(tok)

    def text(ids: Sequence[int]) -> str:
        # ids past the tokenizer's vocabulary (a model whose head is wider) decode to nothing
        return tok.decode([t for t in ids if t < known], skip_special_tokens=True)

    for i, prompt in enumerate(prompts):
        if answer_of(text(prompt)) is None:
            raise ConfigError(f"prompt {i} ({text(prompt)[-40:]!r}) does not end in an arithmetic problem "
                              "such as '12+7='; give a reward function for these prompts")

    def reward(rollout: Rollout) -> float:
        answer = answer_of(text(rollout.prompt_ids))
        return 0.0 if answer is None else arithmetic_reward(text(rollout.token_ids), answer)

    return reward


def prompt_id(index: int) -> str:
    """The request id of prompt `index` at every step (rollouts of one prompt form one group)."""
    return f"p{index}"


def custom_task(name: str, prompts: Sequence[Sequence[int]], reward: Reward) -> Task:
    """A task of the caller's prompts (token ids) and reward function."""
    return Task(name, tuple(tuple(int(t) for t in p) for p in prompts), reward)
