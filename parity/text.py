"""Decoded text for reports, computed once when a report is built.

A report stores token ids; people read text. `report_text` decodes, with the checkpoint's own
tokenizer, every distinct response token id of the rollouts and the start of every request's
prompt, and the report keeps them in `extras["text"]`:

    {"tokens": {"<token id>": "<its text>", ...},       one entry per distinct response token
     "prompts": {"<request id>": "<prompt start>", ...}}

so a stored report shows tokens in context (`ParityReport.worst_tokens`) and rendering it
never loads a tokenizer, transformers or torch. Each token is decoded on its own, so a byte
token that is part of a multi-byte character shows as U+FFFD.

Loading the tokenizer is the documented transformers exception of the light modules
(`parity.prompts.tokenizer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from parity.errors import ParityError
from parity.prompts import tokenizer
from parity.types import Rollout

#: prompt tokens decoded for a prompt's start, and the characters of it kept.
PROMPT_TOKENS = 48
PROMPT_CHARS = 160


def report_text(model: str, rollouts: Sequence[Rollout]) -> dict[str, Any] | None:
    """`extras["text"]` for a report of `rollouts` (see the module doc); None when the model
    has no loadable tokenizer (the report then shows token ids only)."""
    try:
        tok = tokenizer(model)
    except ParityError:
        return None
    ids = sorted({t for r in rollouts for t in r.token_ids})
    tokens = dict(zip((str(i) for i in ids), tok.batch_decode([[i] for i in ids])))
    prompts: dict[str, str] = {}
    for r in rollouts:
        if r.request_id not in prompts:
            start = tok.decode(list(r.prompt_ids[:PROMPT_TOKENS]))
            cut = len(r.prompt_ids) > PROMPT_TOKENS or len(start) > PROMPT_CHARS
            prompts[r.request_id] = start[:PROMPT_CHARS] + ("…" if cut else "")
    return {"tokens": tokens, "prompts": prompts}
