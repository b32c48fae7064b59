"""The nightly HTML page: one self-contained file (inline CSS and SVG, no scripts, no network):
verdict counts, the case x backend matrix, every row, changes against baselines, a section per
row, and trend charts.
"""

from __future__ import annotations

import html
import json
from collections import Counter
from typing import Any

import numpy as np

from parity.core.schema import GOLD_RATIO_KEY, GOLD_VERDICT_KEY, RECOMMENDATION_KEY, sweep_label
from parity.drift.tolerance import Violation
from parity.nightly.charts import trend_charts
from parity.nightly.history import RunInfo
from parity.nightly.regression import (
    DISTRIBUTION_VERDICT_KEY,
    NOISE_DETERMINISTIC_KEY,
    NOISE_MEAN_KEY,
    TEST_NAME,
)
from parity.nightly.rows import BASELINE_SKIPPED, STATUSES, RowKey, RowResult, correction_change
from parity.render.gold import gold_plots
from parity.render.report_page import key_value_table, report_plots, worst_tokens_table
from parity.report.document import ParityReport, number_text

#: columns of the rows table: (summary key, header).
TABLE_METRICS: tuple[tuple[str, str], ...] = (
    ("max_abs_logprob_diff", "max |Δlogp|"),
    ("mean_abs_logprob_diff", "mean |Δlogp|"),
    ("k3_kl", "k3 KL"),
    ("is_ratio_mean", "IS ratio mean"),
    ("frac_tokens_ratio_gt_2", "frac ratio>2"),
    ("num_tokens", "tokens"),
    (GOLD_RATIO_KEY, "gold: rollout/train error"),
)

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px; color: #222; }
h1 { font-size: 22px; margin: 0 0 4px 0; } h2 { font-size: 17px; margin: 28px 0 8px 0; }
h3 { font-size: 15px; margin: 0 0 6px 0; display: inline; } h4 { font-size: 13px; margin: 10px 0 4px 0; }
.sub { color: #555; font-size: 13px; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
td { font-variant-numeric: tabular-nums; } .num { display: block; text-align: right; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 4px; color: #fff; font-weight: 600;
         font-size: 12px; }
.pass { background: #2e7d32; } .improved { background: #00838f; } .fail { background: #c62828; }
.regression { background: #e65100; } .error { background: #6a1b9a; } .changed { background: #f9a825; }
.noise { background: #757575; }
td.cell-pass { background: #e8f5e9; } td.cell-improved { background: #e0f7fa; }
td.cell-fail { background: #ffebee; } td.cell-regression { background: #fff3e0; }
td.cell-error { background: #f3e5f5; } td.cell-none { color: #aaa; text-align: center; }
table.matrix td { min-width: 150px; } table.matrix a { color: inherit; text-decoration: none; }
.counts .badge { margin-right: 6px; font-size: 13px; padding: 3px 10px; }
section.row { border-top: 1px solid #ddd; padding: 12px 0; }
.plots, .trends { display: flex; flex-wrap: wrap; gap: 10px; }
img.plot { width: 430px; max-width: 100%; border: 1px solid #eee; }
.trends img.plot { width: 330px; }
.legend { font-size: 12px; margin-bottom: 8px; }
.swatch { margin-right: 14px; white-space: nowrap; }
.swatch i { display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: -1px; }
ul.violations { color: #c62828; margin: 4px 0; } pre.error { color: #6a1b9a; white-space: pre-wrap; }
pre { background: #f6f6f6; padding: 8px; font-size: 12px; overflow-x: auto; }
"""


def render_page(run: RunInfo, rows: list[RowResult],
                trend_points: list[tuple[str, RowKey, dict[str, Any]]]) -> str:
    """The whole page of one run. `rows` need their report JSON for the per-row plots."""
    title = f"parity nightly · {run.run_id}"
    env = run.environment
    git = env.get("git") or {}
    facts = [f"started {run.created_at}", f"finished {run.finished_at or '(unfinished)'}",
             f"parity {env.get('versions', {}).get('parity-harness', '?')}"
             + (f" @ {git['commit'][:10]}{' (dirty)' if git.get('dirty') else ''}" if git else ""),
             f"host {env.get('hostname', '?')}", f"{env.get('cpu', '?')} ×{env.get('cpu_count', '?')}"]
    facts += [f"GPU {g}" for g in env.get("gpus", [])]
    config = run.config
    facts.append(f"reference kernels {config.get('reference', '?')}")
    facts.append(f"baseline {config.get('baseline') or 'last passing run of each row'}")
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<div class="sub">{html.escape(" · ".join(facts))}</div>',
        _counts(rows),
        "<h2>Summary matrix</h2>", _matrix(rows),
        "<h2>Rows</h2>", _rows_table(rows),
        "<h2>Changes against baselines</h2>", _changes(rows),
        "<h2>Per row</h2>", *(_row_section(r) for r in rows),
        "<h2>Trends</h2>", trend_charts(trend_points, [r.key for r in rows]) if rows else "<p>no rows</p>",
        "<h2>Run configuration</h2>", key_value_table(config),
        "<h2>Environment</h2>", key_value_table(env),
        "</body></html>",
    ]
    return "\n".join(parts)


def _badge(status: str) -> str:
    return f'<span class="badge {status}">{status}</span>'


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    # 3 digits, more where they would print a figure that is not ±1 as 1 (an IS mean of 0.99996)
    return number_text(value, 3) if isinstance(value, float) else str(value)


def _counts(rows: list[RowResult]) -> str:
    counts = Counter(r.status for r in rows)
    badges = "".join(f"{_badge(s)}{counts[s]} " for s in STATUSES if counts[s])
    return f'<p class="counts">{badges or "no rows"}</p>'


def _matrix(rows: list[RowResult]) -> str:
    """Rows: case (and router-replay variant); columns: backend x dtype."""
    line_keys = list(dict.fromkeys((r.key.case, r.key.router_replay) for r in rows))
    col_keys = list(dict.fromkeys((r.key.backend, r.key.dtype) for r in rows))
    by_cell = {(r.key.case, r.key.router_replay, r.key.backend, r.key.dtype): r for r in rows}
    head = "<tr><th>case</th>" + "".join(f"<th>{html.escape(b)}<br><span class='sub'>{d}</span></th>"
                                         for b, d in col_keys) + "</tr>"
    body = []
    for case, replay in line_keys:
        label = html.escape(case)
        if replay:
            label += f" <span class='sub'>replay {html.escape(replay)}</span>"
        cells = []
        for backend, dtype in col_keys:
            row = by_cell.get((case, replay, backend, dtype))
            if row is None:
                cells.append('<td class="cell-none">—</td>')
                continue
            detail = (f"max {_fmt(row.summary.get('max_abs_logprob_diff'))} · "
                      f"mean {_fmt(row.summary.get('mean_abs_logprob_diff'))}") if row.summary else \
                html.escape((row.error or "")[:80])
            cells.append(f'<td class="cell-{row.status}"><a href="#{row.key.anchor}">{_badge(row.status)}<br>'
                         f'<span class="sub">{detail}</span></a></td>')
        body.append(f"<tr><th>{label}</th>{''.join(cells)}</tr>")
    return f'<table class="matrix"><thead>{head}</thead><tbody>{"".join(body)}</tbody></table>'


def _rows_table(rows: list[RowResult]) -> str:
    head = ["row", "status", *(h for _, h in TABLE_METRICS), "Δ mean vs baseline", "p (one-sided)",
            "noise (repeat mean)", "time (s)", "recommended correction"]
    body = []
    for r in rows:
        v = r.verdict
        numbers = [*(_fmt(r.summary.get(k)) for k, _ in TABLE_METRICS),
                   "" if v is None else f"{v.effect:+.3g}", "" if v is None else _fmt(v.p_value), _noise(r),
                   _fmt(round(sum(r.timing.values()), 2)) if r.timing else ""]
        cells = [f'<a href="#{r.key.anchor}">{html.escape(r.key.label)}</a>', _badge(r.status),
                 *(f'<span class="num">{n}</span>' for n in numbers), _correction_cell(r)]
        body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return ("<table><thead><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead><tbody>"
            + "".join(body) + "</tbody></table>")


def _noise(row: RowResult) -> str:
    """"deterministic", the repeat mean |Δlogp|, or "" (no audit of the backend ran)."""
    if NOISE_MEAN_KEY not in row.summary:
        return ""
    return "deterministic" if row.summary[NOISE_DETERMINISTIC_KEY] else _fmt(row.summary[NOISE_MEAN_KEY])


def _correction_cell(row: RowResult) -> str:
    """The row's recommended correction, flagged when it changed against the baseline row."""
    name = row.summary.get(RECOMMENDATION_KEY)
    if name is None:
        return ""
    change = correction_change(row)
    flag = "" if change is None else \
        f' <span class="badge changed" title="baseline: {html.escape(change[0])}">changed</span>'
    return html.escape(str(name)) + flag


def _changes(rows: list[RowResult]) -> str:
    compared = [r for r in rows if r.verdict is not None]
    changed = [r for r in compared if r.verdict.change != "unchanged"]
    first = compared[0].verdict if compared else None
    policy = f"alpha {first.alpha:g}, minimum effect {first.min_effect:g} nats" if first else ""
    lead = (f"<p class='sub'>{len(compared)} of {len(rows)} rows had a baseline row. Test: "
            f"{html.escape(TEST_NAME)}; a change counts when it is significant and moves the mean "
            f"|Δlogp| beyond the minimum effect{f' ({policy})' if policy else ''} and beyond the backend's "
            "repeat noise where an audit of it ran (noise: within it); a deterministic backend's row is "
            "flagged (changed) when its numbers move at all.</p>")
    items = "".join(f"<li>{_badge(r.verdict.change)} {html.escape(r.key.label)}: "
                    f"{html.escape(r.verdict.describe())}</li>" for r in changed)
    advice = "".join(f"<li>{_badge('changed')} {html.escape(r.key.label)}: recommended correction "
                     f"{html.escape(c[0])} → {html.escape(c[1])}</li>"
                     for r in rows if (c := correction_change(r)) is not None)
    return (lead + (f"<ul>{items}</ul>" if items else "<p>No significant change.</p>")
            + (f"<p>The correction advisor's recommendation changed:</p><ul>{advice}</ul>" if advice else ""))


def _row_section(row: RowResult) -> str:
    parts = [f'<section class="row" id="{row.key.anchor}"><h3>{html.escape(row.key.label)}</h3> '
             f"{_badge(row.status)}"]
    if row.verdict is not None:
        parts.append(f'<p class="sub">{html.escape(row.verdict.describe())}</p>')
    elif BASELINE_SKIPPED in row.provenance:
        parts.append(f'<p class="sub">{html.escape(str(row.provenance[BASELINE_SKIPPED]))}.</p>')
    elif row.status != "error":
        parts.append('<p class="sub">No baseline row yet: this run becomes the baseline if it passes.</p>')
    if DISTRIBUTION_VERDICT_KEY in row.summary:  # the KL test's verdict, or why it did not run
        kl = html.escape(str(row.summary[DISTRIBUTION_VERDICT_KEY]))
        parts.append(f'<p class="sub">KL bounds: {kl}</p>')
    if GOLD_VERDICT_KEY in row.summary:
        parts.append(f'<p>Which side moved: {html.escape(str(row.summary[GOLD_VERDICT_KEY]))}.</p>')
    if row.violations:
        items = "".join(f"<li>tolerance: {html.escape(Violation(**v).describe())}</li>"
                        for v in row.violations)
        parts.append(f'<ul class="violations">{items}</ul>')
    if row.error:
        parts.append(f'<pre class="error">{html.escape(row.error)}</pre>')
        if row.provenance.get("traceback"):
            parts.append(f"<details><summary>traceback</summary><pre>"
                         f"{html.escape(row.provenance['traceback'])}</pre></details>")
    if row.report_json is not None:
        parts.append(_report_views(row))
    provenance = {k: v for k, v in row.provenance.items() if k != "traceback"}
    parts += ["<details><summary>Provenance and timing</summary>",
              key_value_table({**provenance, "timing": json.dumps(row.timing)}), "</details>", "</section>"]
    return "\n".join(parts)


def _report_views(row: RowResult) -> str:
    """Plots, worst tokens and metrics of a row's report; one that cannot be drawn costs its section only."""
    try:
        report = ParityReport.from_json(row.report_json or "")
        parts = [
            '<div class="plots">', *report_plots(report), *gold_plots(report), "</div>",
            _by_sweep_block(report),
            "<h4>Worst tokens</h4>", worst_tokens_table(report.worst_tokens(8), report.num_tokens),
            "<details><summary>All metrics</summary>", key_value_table(row.summary),
            key_value_table(report.metrics), "</details>",
        ]
    except Exception as exc:  # a drawing failure must not lose the run's page
        return f'<pre class="error">plots unavailable: {html.escape(f"{type(exc).__name__}: {exc}")}</pre>'
    return "\n".join(parts)


def _by_sweep_block(report: ParityReport) -> str:
    """Drift per sampling block of a sweep case (empty for others)."""
    labels = [sweep_label(str(seq.get("request_id", ""))) for seq in report.sequences]
    if not any(labels):
        return ""
    diff = np.abs(report.train_logprobs.astype(np.float64) - report.rollout_logprobs)
    lines = []
    for label in dict.fromkeys(labels):
        rows = np.array([lab == label for lab in labels])
        values = diff[rows][report.mask[rows]]
        if values.size:
            cells = (html.escape(str(label)), values.size, f"{values.max():.3g}", f"{values.mean():.3g}")
            lines.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return ("<h4>Drift by sampling block</h4><table><thead><tr><th>block</th><th>tokens</th>"
            "<th>max |Δlogp|</th><th>mean |Δlogp|</th></tr></thead><tbody>" + "".join(lines)
            + "</tbody></table>")
