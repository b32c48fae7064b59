"""The page of one `ParityReport`: verdict, summary, drift figures, worst tokens, correction
metrics, the attribution section and provenance, in one self-contained HTML file.

The tables and `report_plots` are reused by the nightly pages. Everything here reads the
report's arrays and JSON sections, so a report loaded from JSON renders exactly like a fresh one.
"""

from __future__ import annotations

import html
import json
from typing import TYPE_CHECKING, Any

from parity.render.attribution import section_html
from parity.render.figures import breakdown_figure, figure_img, log_ratio_histogram

if TYPE_CHECKING:
    from parity.report import ParityReport


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
    attribution = section_html(report.extras["attribution"]) if "attribution" in report.extras else ""
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
