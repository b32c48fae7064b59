"""Built-in deterministic tools for multi-turn trajectories, bound to a checkpoint's tokenizer: a
tool reads the decoded text so far and replies with text that is injected, the same on every
backend. "calculator" answers the last integer expression ("\\n<result>12*7+3 = 87</result>\\n");
"length" the characters so far.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

from parity.core.errors import ConfigError
from parity.core.turns import Inject, Turn
from parity.models.checkpoints import model_text
from parity.workload.prompts import tokenizer

_EXPRESSION = re.compile(r"\d+(?:\s*[-+*]\s*\d+)+")
#: numbers longer than this are not evaluated (a reply stays short whatever the model writes)
_MAX_DIGITS = 12


def calculator(text: str) -> str:
    """The last integer expression of `text`, evaluated (no eval: `*` first, then `+`/`-`)."""
    found = _EXPRESSION.findall(text)
    if not found:
        return "\n<result>no expression</result>\n"
    expression = re.sub(r"\s+", "", found[-1])
    numbers = re.findall(r"\d+", expression)
    if any(len(n) > _MAX_DIGITS for n in numbers):
        return "\n<result>number too long</result>\n"
    terms = re.split(r"(?<=\d)([-+])", expression)  # [product, op, product, ...]
    total, sign = 0, 1
    for part in terms:
        if part in ("+", "-"):
            sign = 1 if part == "+" else -1
            continue
        product = 1
        for factor in part.split("*"):
            product *= int(factor)
        total += sign * product
    return f"\n<result>{expression} = {total}</result>\n"


def length(text: str) -> str:
    """The number of characters so far."""
    return f"\n<result>{len(text)} characters</result>\n"


TOOLS: dict[str, Callable[[str], str]] = {"calculator": calculator, "length": length}


def bind_tools(model: str | os.PathLike[str], turns: tuple[Turn, ...],
               where: str = "turns") -> tuple[Turn, ...]:
    """`turns` with every tool injection (`Inject(name=...)` without a function) bound to `model`'s
    tokenizer: its function decodes the ids so far, runs the tool and encodes the reply."""
    bound: list[Turn] = []
    for i, turn in enumerate(turns):
        if isinstance(turn, Inject) and turn.fn is None and not turn.token_ids:
            if turn.name not in TOOLS:
                raise ConfigError(f"{where}[{i}]: unknown tool {turn.name!r}; the tools are {sorted(TOOLS)}")
            turn = Inject(fn=_text_tool(model_text(model), TOOLS[turn.name]), name=turn.name)
        bound.append(turn)
    return tuple(bound)


def encode_text(model: str | os.PathLike[str], text: str, where: str) -> tuple[int, ...]:
    """`text` as ids of `model`'s tokenizer, without special tokens (an injected reply)."""
    tok = tokenizer(model_text(model), where)
    return tuple(tok(text, add_special_tokens=False)["input_ids"])


def _text_tool(model: str, tool: Callable[[str], str]) -> Callable[[tuple[int, ...]], list[int]]:
    tok = tokenizer(model, "tool")

    def run(history: tuple[int, ...]) -> list[int]:
        reply = tool(tok.decode(list(history), skip_special_tokens=True))
        return list(tok(reply, add_special_tokens=False)["input_ids"])

    return run
