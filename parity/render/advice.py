"""The advice section of a report page (recommendation, reason, configs to paste, every candidate),
from `extras["advice"]` alone.
"""

from __future__ import annotations

import html
import json
from typing import Any

from parity.core.schema import ADVICE_COLUMNS, advice_cell


def nested_yaml(keys: dict[str, Any]) -> str:
    """Dotted keys (`algorithm.rollout_correction.rollout_is`) as the nested YAML mappings of a
    config file (verl's and NeMo-RL's configs are YAML). Each value is written as JSON, which YAML
    reads as the same value: `"token"`, `2.0`, `null`, `true`."""
    tree: dict[str, Any] = {}
    for dotted, value in keys.items():
        *parents, leaf = dotted.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    lines: list[str] = []

    def emit(node: dict[str, Any], depth: int) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                lines.append(f"{'  ' * depth}{key}:")
                emit(value, depth + 1)
            else:
                lines.append(f"{'  ' * depth}{key}: {json.dumps(value)}")

    emit(tree, 0)
    return "\n".join(lines)


def _framework_block(name: str, value: Any) -> str:
    if value is None:
        return ""
    text = (" ".join(value) or "(no correction flags)") if isinstance(value, list) else nested_yaml(value)
    return f"<h3>{html.escape(name)}</h3><pre>{html.escape(text)}</pre>"


def framework_blocks(frameworks: dict[str, Any]) -> str:
    """The config to paste for each framework that has the correction: verl's and NeMo-RL's as
    YAML for their config files, slime's flags; then the notes on those that lack it."""
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in frameworks["notes"])
    return "\n".join([
        _framework_block("verl (YAML for your trainer config)", frameworks["verl"]),
        _framework_block("NeMo-RL (YAML for your config)", frameworks["nemo_rl"]),
        _framework_block("slime (flags)", frameworks["slime"]),
        f"<ul class='sub'>{notes}</ul>" if notes else "",
    ])


def advice_html(section: dict[str, Any]) -> str:
    """The "Which correction fixes it" section of a report page."""
    rec = section["recommendation"]
    chosen = {s["candidate"] for s in rec["stages"] if s["candidate"]}
    frameworks = rec["frameworks"]
    head = "".join(f"<th>{h}</th>" for h in ("candidate", *(h for _, h, _, _ in ADVICE_COLUMNS)))
    body = []
    for row in section["candidates"]:
        mark = ' class="chosen"' if row["name"] in chosen else ""
        cells = [html.escape(row["name"]), *(advice_cell(row, k, f) for _, _, k, f in ADVICE_COLUMNS)]
        body.append(f"<tr{mark}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return "\n".join([
        '<h2 id="advice">Which correction fixes it</h2>',
        f'<p class="advice"><b>Recommended: {html.escape(rec["name"])}</b>. {html.escape(rec["reason"])}</p>',
        f'<p class="gold-note"><b>Which side moved:</b> {html.escape(section["gold"])}.</p>'
        if section.get("gold") else "",
        framework_blocks(frameworks),
        f"<details><summary>All {len(section['candidates'])} candidates (residual bias against untruncated "
        f"IS, {section['bootstrap']} bootstrap resamples of sequences)</summary>",
        f'<table class="advice"><thead><tr>{head}</tr></thead>',
        f'<tbody>{"".join(body)}</tbody></table></details>',
    ])
