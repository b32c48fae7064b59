"""Trend charts: one small chart per summary metric, one line per row, across the history; each row
keeps one colour everywhere (one legend on the page).
"""

from __future__ import annotations

import html
import math
from typing import Any

from parity.core.schema import SUMMARY_KEYS
from parity.nightly.rows import RowKey
from parity.render.figures import figure_img

#: the newest runs shown; older ones stay in the database.
TREND_RUNS = 30
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
            "#bcbd22", "#17becf")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def row_colors(keys: list[RowKey]) -> dict[RowKey, tuple[str, str]]:
    """(colour, marker) per row; 80 distinct pairs before any repeats."""
    return {k: (_PALETTE[i % len(_PALETTE)], _MARKERS[(i // len(_PALETTE)) % len(_MARKERS)])
            for i, k in enumerate(keys)}


def trend_charts(points: list[tuple[str, RowKey, dict[str, Any]]], keys: list[RowKey]) -> str:
    """HTML: a legend and one inline chart per metric, from `History.trend` points."""
    from matplotlib.figure import Figure  # matplotlib only when a page is drawn

    runs = list(dict.fromkeys(run for run, _, _ in points))[-TREND_RUNS:]
    index = {run: i for i, run in enumerate(runs)}
    colors = row_colors(keys)
    charts = []
    for metric in trend_metrics([summary for _, _, summary in points]):
        fig = Figure(figsize=(4.4, 2.7))
        # fixed margins (room for the rotated run ids): constrained layout doubles the drawing time
        fig.subplots_adjust(left=0.16, right=0.97, bottom=0.3, top=0.9)
        ax = fig.add_subplot()
        ax.set_title(metric, fontsize=9)
        for key in keys:
            xy = [(index[run], _number(summary.get(metric))) for run, k, summary in points
                  if k == key and run in index]
            if xy:
                color, marker = colors[key]
                ax.plot([x for x, _ in xy], [y for _, y in xy], color=color, marker=marker, markersize=4,
                        linewidth=1.2)
        ax.set_xticks(range(len(runs)), [_short(r) for r in runs], rotation=45, ha="right", fontsize=6)
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlim(-0.5, max(len(runs) - 0.5, 0.5))
        ax.grid(True, linewidth=0.3, alpha=0.5)
        charts.append(figure_img(fig, f"trend of {metric}"))
    legend = "".join(
        f'<span class="swatch"><i style="background:{c}"></i>{html.escape(k.label)}</span>'
        for k, (c, _) in colors.items()
    )
    return (f'<div class="legend">{legend}</div><div class="trends">' + "".join(charts) + "</div>"
            f'<p class="sub">Last {len(runs)} run(s) holding these rows, oldest left; '
            "error rows are omitted, and so are a row's points from before its workload last changed "
            "(its case, model or LoRA adapter edited under the same name: the line starts again there).</p>")


def trend_metrics(summaries: list[dict[str, Any]]) -> list[str]:
    """Every scalar summary metric except the token and sequence counts (a feature's too, e.g.
    "gold/num_tokens"): parity's standard keys first, then any a feature adds (e.g. MoE router
    agreement, the gold errors), alphabetically."""
    found = {k for s in summaries for k, v in s.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool)
             and not k.rpartition("/")[2].startswith("num_")}
    return [k for k in SUMMARY_KEYS if k in found] + sorted(found - set(SUMMARY_KEYS))


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else math.nan


def _short(run_id: str) -> str:
    return run_id if len(run_id) <= 18 else run_id[:8] + "…" + run_id[-8:]
