"""`summary.md`: the nightly verdict as GitHub-flavoured Markdown, sized for a CI comment; rows that
need attention first. Text that is not parity's own goes through `_cell`.
"""

from __future__ import annotations

import html
import re
from collections import Counter
from typing import Any

from parity.core.schema import GOLD_RATIO_KEY, GOLD_VERDICT_KEY
from parity.drift.tolerance import Violation
from parity.nightly.history import RunInfo
from parity.nightly.regression import DISTRIBUTION_CHANGE_KEY, DISTRIBUTION_VERDICT_KEY, TEST_NAME
from parity.nightly.rows import BASELINE_SKIPPED, STATUSES, RowResult, correction_change
from parity.report.document import number_text

_MARK = {"error": "💥", "regression": "📉", "fail": "❌", "improved": "📈", "pass": "✅"}


def render_summary(run: RunInfo, rows: list[RowResult], *, report_path: str = "index.html") -> str:
    """Markdown: headline counts, one table line per row, then what changed and why rows broke."""
    counts = Counter(r.status for r in rows)
    headline = ", ".join(f"{counts[s]} {s}" for s in STATUSES if counts[s]) or "no rows"
    ordered = sorted(rows, key=lambda r: STATUSES.index(r.status))
    lines = [
        f"## parity nightly `{run.run_id}`: {headline}",  # run ids are letters, digits, ".", "_", "-"
        "",
        "| | case | backend | dtype | max \\|Δlogp\\| | mean \\|Δlogp\\| | k3 KL | Δ mean vs baseline | p "
        "| gold: rollout/train error |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in ordered:
        v = r.verdict
        case = r.key.case + (f" ({r.key.router_replay})" if r.key.router_replay else "")
        lines.append(
            f"| {_MARK[r.status]} {r.status} | {_cell(case)} | {_cell(r.key.backend)} | "
            f"{_cell(r.key.dtype)} | "
            f"{_num(r.summary.get('max_abs_logprob_diff'))} | "
            f"{_num(r.summary.get('mean_abs_logprob_diff'))} | "
            f"{_num(r.summary.get('k3_kl'))} | {'' if v is None else f'{v.effect:+.2g}'} | "
            f"{'' if v is None else _num(v.p_value)} | {_num(r.summary.get(GOLD_RATIO_KEY))} |"
        )
    notes = []
    for r in ordered:
        if r.error:
            notes.append(f"- **{_cell(r.key.label)}** error: {_cell(r.error.splitlines()[0][:300])}")
        for viol in r.violations:
            notes.append(f"- **{_cell(r.key.label)}** tolerance: {_cell(Violation(**viol).describe())}")
        if r.verdict is not None and r.verdict.change != "unchanged":
            notes.append(f"- **{_cell(r.key.label)}** {_cell(r.verdict.describe())}")
        if DISTRIBUTION_VERDICT_KEY in r.summary and r.summary.get(DISTRIBUTION_CHANGE_KEY) != "unchanged":
            kl = _cell(str(r.summary[DISTRIBUTION_VERDICT_KEY]))
            notes.append(f"- **{_cell(r.key.label)}** KL bounds: {kl}")
        if BASELINE_SKIPPED in r.provenance:
            notes.append(f"- **{_cell(r.key.label)}** {_cell(str(r.provenance[BASELINE_SKIPPED]))}")
        if GOLD_VERDICT_KEY in r.summary and r.status != "pass":
            verdict = str(r.summary[GOLD_VERDICT_KEY])
            notes.append(f"- **{_cell(r.key.label)}** which side moved: {_cell(verdict)}")
        if (change := correction_change(r)) is not None:
            notes.append(f"- **{_cell(r.key.label)}** recommended correction changed: "
                         f"{_cell(change[0])} → {_cell(change[1])}")
    if notes:
        lines += ["", *notes]
    lines += ["", f"Regression test: {TEST_NAME}; baseline: "
              f"{_cell(str(run.config.get('baseline') or 'the last passing run of each row'))}. "
              f"Full report: {_cell(report_path)}.", ""]
    return "\n".join(lines)


def _num(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return ""
    # 3 digits, more where they would print a figure that is not ±1 as 1 (an IS mean of 0.99996)
    return number_text(value, 3) if isinstance(value, (int, float)) else str(value)


#: Markdown punctuation that could start emphasis, code, a link, an image, a strike or a cell.
_MARKDOWN_PUNCTUATION = re.compile(r"([\\`*_{}\[\]()#+!|~-])")


def _cell(text: str) -> str:
    """`text` as literal one-line Markdown (entities, escaped punctuation, a word joiner after "@")."""
    text = html.escape(" ".join(text.splitlines()), quote=False)
    return _MARKDOWN_PUNCTUATION.sub(r"\\\1", text).replace("@", "@\u2060")
