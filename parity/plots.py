"""Figures and HTML fragments for parity reports, reusable by the nightly pages.

Every figure is a matplotlib `Figure` built without pyplot (no global state, safe in threads and
under pytest) and embedded as an inline base64 SVG `<img>`, so pages need no network and no
files next to them. Fragments take plain arrays and breakdown rows, not engines, so they render
a report loaded from JSON exactly like a fresh one.
"""

from __future__ import annotations

import base64
import html
import io
import json
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from parity.report import ParityReport

_FIGSIZE = (6.4, 3.4)  # inches; 3 fit side by side on a wide screen, stacked on a narrow one
_BLUE, _ORANGE, _GREY = "#1f77b4", "#d62728", "#7f7f7f"


def new_figure() -> tuple[Figure, Any]:
    """A figure of parity's report-plot size with one axes (no pyplot: no global figure state)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=_FIGSIZE, layout="constrained")
    return fig, fig.add_subplot()


def figure_data_uri(fig: Figure) -> str:
    """`data:image/svg+xml;base64,...` of a figure. Text is drawn as paths (no font needed
    by the viewer) and the date metadata is dropped so the same data gives the same bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    return "data:image/svg+xml;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def figure_img(fig: Figure, alt: str) -> str:
    """An `<img>` tag holding the figure inline."""
    return f'<img class="plot" alt="{html.escape(alt)}" src="{figure_data_uri(fig)}">'


def log_ratio_histogram(log_ratio: np.ndarray) -> Figure:
    """Histogram of per-token log ratios logp_train - logp_rollout (nats), `[num_tokens]`.

    The count axis is logarithmic: drift lives in the tails, which a linear axis flattens
    next to the spike of (near-)identical tokens. Non-finite values are counted in the title.
    """
    values = np.asarray(log_ratio, dtype=np.float64).ravel()
    finite = values[np.isfinite(values)]
    span = float(np.max(np.abs(finite))) if finite.size else 0.0
    notes = [f"{values.size} tokens"]
    if values.size > finite.size:
        notes.append(f"{values.size - finite.size} non-finite")
    if finite.size and span == 0.0:
        notes.append("all identical")
    fig, ax = new_figure()
    ax.set_title(f"log ratio per token ({', '.join(notes)})", fontsize=10)
    ax.set_xlabel("logp_train - logp_rollout (nats)")
    ax.set_ylabel("tokens")
    if finite.size == 0:
        ax.text(0.5, 0.5, "no finite tokens", ha="center", va="center", transform=ax.transAxes)
        return fig
    if span == 0.0:
        # one bar at 0 says "identical" better than an empty axis
        ax.bar([0.0], [finite.size], width=1.0, color=_BLUE)
        ax.set_xlim(-1.0, 1.0)
    else:
        ax.hist(finite, bins=np.linspace(-span, span, 61), color=_BLUE)
        ax.set_yscale("log")
    ax.axvline(0.0, color=_GREY, linewidth=0.8)
    return fig


def breakdown_figure(rows: list[dict[str, Any]], *, title: str, xlabel: str) -> Figure:
    """Mean and max |Δlogp| per bucket of a `parity.metrics.drift_by_*` breakdown.

    rows: one dict per bucket with `lo`, `hi`, `mean_abs_logprob_diff` and
    `max_abs_logprob_diff` (nats; None for an empty bucket, which is left blank).
    Bars are the mean (left axis), the line the max (right axis): the max is often 10-100x the
    mean, and on one axis it would flatten the bars.
    """
    fig, ax = new_figure()
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    if not rows:
        ax.text(0.5, 0.5, "no tokens", ha="center", va="center", transform=ax.transAxes)
        return fig
    x = np.arange(len(rows))
    mean = np.array([_number(row.get("mean_abs_logprob_diff")) for row in rows])
    peak = np.array([_number(row.get("max_abs_logprob_diff")) for row in rows])
    ax.bar(x, mean, color=_BLUE)
    ax.set_ylabel("mean |Δlogp| (nats)", color=_BLUE)
    ax.set_ylim(bottom=0.0)
    peak_ax = ax.twinx()
    peak_ax.plot(x, peak, color=_ORANGE, marker="o", markersize=3, linewidth=1)
    peak_ax.set_ylabel("max |Δlogp| (nats)", color=_ORANGE)
    peak_ax.set_ylim(bottom=0.0)
    crowded = len(rows) > 6
    ax.set_xticks(x, [_bucket_label(row) for row in rows], rotation=45 if crowded else 0,
                  ha="right" if crowded else "center", fontsize=7)
    return fig


def _bucket_label(row: dict[str, Any]) -> str:
    """`[lo, hi)` of a bucket as a short tick label."""
    return f"{row['lo']:g}–{row['hi']:g}"


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else np.nan


def worst_tokens_table(rows: list[dict[str, Any]]) -> str:
    """HTML table of `ParityReport.worst_tokens()` rows."""
    head = ("sequence", "request", "position", "token id", "train logprob", "rollout logprob",
            "Δlogp", "ratio")
    body = []
    for row in rows:
        cells = (row["sequence"], row.get("request_id", ""), row["position"], row["token_id"],
                 f"{row['train_logprob']:.6f}", f"{row['rollout_logprob']:.6f}",
                 f"{row['logprob_diff']:+.3e}", f"{row['ratio']:.6f}")
        body.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    if not body:
        body.append(f'<tr><td colspan="{len(head)}">no tokens</td></tr>')
    return ('<table class="worst"><thead><tr>' + "".join(f"<th>{h}</th>" for h in head)
            + "</tr></thead><tbody>" + "".join(body) + "</tbody></table>")


def key_value_table(values: dict[str, Any], *, css_class: str = "kv") -> str:
    """Two-column HTML table of a flat dict; nested values are shown as compact JSON."""
    rows = []
    for key, value in values.items():
        if isinstance(value, float):
            text = f"{value + 0.0:.6g}"  # + 0.0 shows -0.0 as 0
        elif isinstance(value, (dict, list)):
            text = json.dumps(value, sort_keys=True, default=str)
        else:
            text = str(value)
        rows.append(f"<tr><th>{html.escape(str(key))}</th><td>{html.escape(text)}</td></tr>")
    return f'<table class="{css_class}">' + "".join(rows) + "</table>"


_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; margin: 0 0 4px 0; } h2 { font-size: 16px; margin: 24px 0 8px 0; }
.verdict { display: inline-block; padding: 2px 10px; border-radius: 4px; color: #fff; font-weight: 600; }
.pass { background: #2e7d32; } .fail { background: #c62828; }
.sub { color: #555; font-size: 13px; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; }
td { font-variant-numeric: tabular-nums; }
table.worst td { text-align: right; }
.row { display: flex; flex-wrap: wrap; gap: 12px 32px; align-items: flex-start; }
img.plot { width: 460px; max-width: 100%; border: 1px solid #eee; }
ul.violations { color: #c62828; }
pre { background: #f6f6f6; padding: 8px; font-size: 12px; overflow-x: auto; }
"""


def report_plots(report: ParityReport) -> list[str]:
    """The three drift plots of a report as inline <img> tags: log-ratio histogram, drift by
    response position, drift by rollout probability."""
    return [
        figure_img(log_ratio_histogram(report.log_ratio()), "log-ratio histogram"),
        figure_img(breakdown_figure(report.breakdowns.get("by_position", []),
                                    title="drift by response position", xlabel="response position"),
                   "drift by position"),
        figure_img(breakdown_figure(report.breakdowns.get("by_probability", []),
                                    title="drift by rollout probability", xlabel="rollout probability"),
                   "drift by rollout probability"),
    ]


def report_html(report: ParityReport) -> str:
    """The whole self-contained page of one report (what `ParityReport.to_html` returns)."""
    prov = report.provenance
    title = f"parity: {prov.get('backend', '?')} vs training forward on {prov.get('model', '?')}"
    verdict = '<span class="verdict pass">PASS</span>' if report.passed \
        else '<span class="verdict fail">FAIL</span>'
    sub = " · ".join(f"{k}={prov[k]}" for k in ("dtype", "reference_kernels", "device", "case") if k in prov)
    violations = "".join(f"<li>{html.escape(v.describe())}</li>" for v in report.violations)
    plots = report_plots(report)
    attribution = ""
    if "attribution" in report.extras:
        from parity.attribute import section_html

        attribution = section_html(report.extras["attribution"])
    extras = "".join(
        f"<details><summary>{html.escape(name)}</summary><pre>"
        f"{html.escape(json.dumps(section, indent=2, sort_keys=True, default=str))}</pre></details>"
        for name, section in report.extras.items() if name != "attribution"
    )
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)} {verdict}</h1>", f'<div class="sub">{html.escape(sub)}</div>',
        f'<ul class="violations">{violations}</ul>' if violations else "",
        '<div class="row"><div><h2>Summary</h2>', key_value_table(report.summary), "</div>",
        "<div><h2>Tolerance</h2>", key_value_table(report.tolerance.to_dict()), "</div></div>",
        '<h2>Plots</h2><div class="row">', *plots, "</div>",
        "<h2>Worst tokens</h2>", worst_tokens_table(report.worst_tokens(10)),
        "<h2>Rollout correction (verl rollout_corr/*)</h2>", key_value_table(report.metrics),
        attribution,
        "<h2>Provenance</h2>", key_value_table(prov),
        f"<h2>Extras</h2>{extras}" if extras else "",
        "</body></html>",
    ]
    return "\n".join(p for p in parts if p)
