"""Decoded text for reports, computed once when a report is built.

`report_text` decodes every distinct response token id and the start of every prompt into
`extras["text"]` (`{"tokens": {id: text}, "prompts": {request_id: start}}`), so rendering never
loads a tokenizer. Tokens are decoded alone (a partial multi-byte character shows as U+FFFD). A
chat prompt starts at its last user message (after the shared system prompt).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from parity.core.errors import ParityError
from parity.core.types import Rollout
from parity.workload.prompts import tokenizer

#: prompt tokens decoded for a prompt's start, and the characters of it kept.
PROMPT_TOKENS = 48
PROMPT_CHARS = 160


def report_text(model: str, rollouts: Sequence[Rollout],
                extra_ids: Sequence[int] = ()) -> dict[str, Any] | None:
    """`extras["text"]` for a report of `rollouts` (see the module doc), decoding `extra_ids` too
    (the distribution section's top-5s); None when the model has no loadable tokenizer (the report
    then shows token ids only)."""
    try:
        tok = tokenizer(model)
    except ParityError:
        return None
    ids = sorted({t for r in rollouts for t in r.token_ids} | {int(t) for t in extra_ids})
    tokens = dict(zip((str(i) for i in ids), tok.batch_decode([[i] for i in ids])))
    marker = user_turn_marker(tok)
    prompts: dict[str, str] = {}
    for r in rollouts:
        if r.request_id not in prompts:
            prompts[r.request_id] = prompt_start(tok, r.prompt_ids, marker)
    return {"tokens": tokens, "prompts": prompts}


def prompt_start(tok: Any, prompt_ids: Sequence[int], marker: str | None) -> str:
    """The start of a prompt as a report shows it: from its last user message when `marker`
    (`user_turn_marker`) is in it, else from its first token; at most PROMPT_CHARS characters,
    "…" where cut."""
    if marker is not None:
        text = tok.decode(list(prompt_ids))
        at = text.rfind(marker)
        if at >= 0:
            start = text[at + len(marker):]
            return start[:PROMPT_CHARS] + ("…" if len(start) > PROMPT_CHARS else "")
    start = tok.decode(list(prompt_ids[:PROMPT_TOKENS]))
    cut = len(prompt_ids) > PROMPT_TOKENS or len(start) > PROMPT_CHARS
    return start[:PROMPT_CHARS] + ("…" if cut else "")


#: stand-in message contents that locate the template's text between a system and a user turn.
_SYSTEM, _USER = "\x00parity-system\x00", "\x00parity-user\x00"


def user_turn_marker(tok: Any) -> str | None:
    """The text the tokenizer's chat template writes between a system message's content and a user
    message's content; None without a chat template, or one that refuses a system turn."""
    if not getattr(tok, "chat_template", None):
        return None
    try:
        probe = [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _USER}]
        text = tok.apply_chat_template(probe, tokenize=False)
    except Exception:  # a template raises what its Jinja code raises (e.g. no system role)
        return None
    if not isinstance(text, str) or _SYSTEM not in text or _USER not in text:
        return None
    between = text[text.index(_SYSTEM) + len(_SYSTEM):text.index(_USER)]
    return between or None
