"""The page of one `ParityReport` in one self-contained HTML file, from its arrays and JSON alone;
its tables and `report_plots` are reused by the nightly pages.
"""

from __future__ import annotations

import html
import json
from typing import TYPE_CHECKING, Any

from parity.render.advice import advice_html
from parity.render.attribution import section_html
from parity.render.distribution import distribution_html
from parity.render.figures import breakdown_figure, figure_img, log_ratio_histogram
from parity.render.gold import gold_html
from parity.report.document import logprob_pair, number_text, ratio_text

if TYPE_CHECKING:
    from parity.report.document import ParityReport


def worst_tokens_table(rows: list[dict[str, Any]], num_tokens: int | None = None) -> str:
    """HTML table of `ParityReport.worst_tokens()` rows; with decoded text, each token in its
    context and the start of its prompt; with a gold, the gold's logprob beside the two sides'. No
    rows: "all `num_tokens` tokens identical"."""
    with_text = bool(rows) and "text" in rows[0]
    with_gold = bool(rows) and "gold_logprob" in rows[0]
    text_head = ("token in context", "prompt starts") if with_text else ()
    head = ("sequence", "request", "position", "token id", *text_head, "train logprob", "rollout logprob",
            *(("gold logprob",) if with_gold else ()), "Δlogp", "ratio")
    body = []
    for row in rows:
        cells = [_td(row["sequence"]), _td(row.get("request_id", "")), _td(row["position"]),
                 _td(row["token_id"])]
        if with_text:
            cells += [f'<td class="text">{in_context(row)}</td>',
                      f'<td class="text prompt">{_text(row["prompt"])}</td>']
        cells += [_td(text) for text in logprob_pair(row["train_logprob"], row["rollout_logprob"])]
        if with_gold:
            cells.append(_td(f"{row['gold_logprob']:.6f}"))
        cells += [_td(f"{row['logprob_diff']:+.3e}"), _td(ratio_text(row["ratio"]))]
        body.append("<tr>" + "".join(cells) + "</tr>")
    if not body:
        empty = f"all {num_tokens} tokens identical" if num_tokens else "no tokens"
        body.append(f'<tr><td class="identical" colspan="{len(head)}">{empty}</td></tr>')
    return ('<table class="worst"><thead><tr>' + "".join(f"<th>{h}</th>" for h in head)
            + "</tr></thead><tbody>" + "".join(body) + "</tbody></table>")


def in_context(row: dict[str, Any]) -> str:
    """A worst token (marked) between its neighbours, every piece HTML-escaped."""
    return (f'<span class="ctx">{_text(row["before"])}</span><mark>{_text(row["text"]) or "&nbsp;"}</mark>'
            f'<span class="ctx">{_text(row["after"])}</span>')


def request_drift_table(rows: list[dict[str, Any]]) -> str:
    """HTML table of `ParityReport.request_drift()` rows; a request without drift reads
    "all N tokens identical" instead of its zeros."""
    with_text = any(row["prompt"] for row in rows)
    head = ("request", "samples", "tokens", "max |Δlogp|", "mean |Δlogp|", *(("prompt starts",) if with_text
            else ()))
    body = []
    for row in rows:
        outside = row["outside_support"]
        tokens = f"{row['tokens']} (+{outside} outside support)" if outside else row["tokens"]
        cells = [_td(row["request_id"]), _td(row["samples"]), _td(tokens)]
        if row["identical"]:
            cells.append(f'<td class="identical" colspan="2">all {row["tokens"]} tokens identical</td>')
        elif not row["tokens"]:  # every token outside a side's support: nothing measured, no 0
            cells.append('<td colspan="2">no token inside both sides\' support</td>')
        else:
            cells += [_td(f"{row['max_abs_logprob_diff']:.3e}"), _td(f"{row['mean_abs_logprob_diff']:.3e}")]
        if with_text:
            cells.append(f'<td class="text prompt">{_text(row["prompt"])}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return ('<table class="requests"><thead><tr>' + "".join(f"<th>{h}</th>" for h in head)
            + "</tr></thead><tbody>" + "".join(body) + "</tbody></table>")


def turn_drift_table(breakdowns: dict[str, Any]) -> str:
    """HTML table of a multi-turn report's drift by generated turn and of the first generated
    token after an injection vs the rest (`parity.drift.metrics.drift_by_turn`); "" for single-turn."""
    if "by_turn" not in breakdowns:
        return ""
    rows = [(f"turn {r['lo']}", r) for r in breakdowns["by_turn"]]
    rows += [("first token after an injection" if r["lo"] == "first" else "other generated tokens", r)
             for r in breakdowns["after_injection"]]
    body = []
    for label, r in rows:
        cells = [_td(label), _td(r["num_tokens"])]
        for key in ("max_abs_logprob_diff", "mean_abs_logprob_diff", "mean_log_ratio"):
            cells.append(_td("—" if r[key] is None else f"{r[key]:.3e}"))
        body.append("<tr>" + "".join(cells) + "</tr>")
    head = ("generated tokens", "tokens", "max |Δlogp|", "mean |Δlogp|", "mean Δlogp")
    return ("<h2>Drift by turn</h2><table class=\"requests\"><thead><tr>"
            + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead><tbody>" + "".join(body)
            + "</tbody></table>")


def _td(value: Any) -> str:
    return f"<td>{html.escape(str(value))}</td>"


def _text(text: str) -> str:
    """Decoded model text, HTML-escaped, with newlines and tabs made visible (↵, →)."""
    return html.escape(text).replace("\n", "↵").replace("\t", "→")


def key_value_table(values: dict[str, Any], *, css_class: str = "kv") -> str:
    """Two-column HTML table of a flat dict; nested values are shown as compact JSON."""
    rows = []
    for key, value in values.items():
        if isinstance(value, float):
            text = number_text(value + 0.0)  # + 0.0 shows -0.0 as 0
        elif isinstance(value, (dict, list)):
            text = json.dumps(value, sort_keys=True, default=str)
        else:
            text = str(value)
        rows.append(f"<tr><th>{html.escape(str(key))}</th><td>{html.escape(text)}</td></tr>")
    return f'<table class="{css_class}">' + "".join(rows) + "</table>"


#: the style sheet of a report page, which the monitor page shares.
PAGE_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; margin: 0 0 4px 0; } h2 { font-size: 16px; margin: 24px 0 8px 0; }
.verdict { display: inline-block; padding: 2px 10px; border-radius: 4px; color: #fff; font-weight: 600; }
.pass { background: #2e7d32; } .fail { background: #c62828; }
.sub { color: #555; font-size: 13px; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; }
td { font-variant-numeric: tabular-nums; }
table.worst td, table.requests td { text-align: right; }
table td.text { text-align: left; font-family: ui-monospace, monospace; white-space: pre; max-width: 480px;
                overflow: hidden; text-overflow: ellipsis; }
table td.prompt { color: #555; } span.ctx { color: #666; } mark { background: #ffe08a; }
table td.identical { text-align: left; color: #2e7d32; }
.row { display: flex; flex-wrap: wrap; gap: 12px 32px; align-items: flex-start; }
img.plot { width: 460px; max-width: 100%; border: 1px solid #eee; }
ul.violations { color: #c62828; }
pre { background: #f6f6f6; padding: 8px; font-size: 12px; overflow-x: auto; }
p.advice { background: #e8f5e9; padding: 6px 10px; border-left: 4px solid #2e7d32; }
p.gold-note { background: #fff3e0; padding: 6px 10px; border-left: 4px solid #e65100; }
tr.chosen td { background: #e8f5e9; font-weight: 600; } h3 { font-size: 14px; margin: 10px 0 4px 0; }
"""


def report_plots(report: ParityReport) -> list[str]:
    """The three drift plots of a report as inline <img> tags: log-ratio histogram, drift by
    response position, drift by rollout probability (`gold_plots` draws the gold's two)."""
    return [
        figure_img(log_ratio_histogram(report.log_ratio()), "log-ratio histogram"),
        figure_img(breakdown_figure(report.breakdowns.get("by_position", []),
                                    title="drift by response position", xlabel="response position"),
                   "drift by position"),
        figure_img(breakdown_figure(report.breakdowns.get("by_probability", []),
                                    title="drift by rollout probability", xlabel="rollout probability"),
                   "drift by rollout probability"),
    ]


def server_settings_html(provenance: dict[str, Any]) -> str:
    """The settings that decide a server backend's numbers (`backend_meta["server_settings"]`, where
    they were read from), as a table; "" for other backends."""
    settings = (provenance.get("backend_meta") or {}).get("server_settings")
    if not settings:
        return ""
    return ("<h2>Server settings</h2><p class=\"sub\">What decides this server's numbers; None: the server "
            "does not show it.</p>" + key_value_table(settings))


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
    advice = advice_html(report.extras["advice"]) if "advice" in report.extras else ""
    extras = "".join(
        f"<details><summary>{html.escape(name)}</summary><pre>"
        f"{html.escape(json.dumps(section, indent=2, sort_keys=True, default=str))}</pre></details>"
        for name, section in report.extras.items()
        if name not in ("attribution", "text", "advice", "gold", "distribution")
    )
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{PAGE_CSS}</style></head><body>",
        f"<h1>{html.escape(title)} {verdict}</h1>", f'<div class="sub">{html.escape(sub)}</div>',
        f'<ul class="violations">{violations}</ul>' if violations else "",
        '<div class="row"><div><h2>Summary</h2>', key_value_table(report.summary), "</div>",
        "<div><h2>Tolerance</h2>", key_value_table(report.tolerance.to_dict()), "</div></div>",
        '<h2>Plots</h2><div class="row">', *plots, "</div>",
        gold_html(report),
        distribution_html(report),
        "<h2>Worst tokens</h2>", worst_tokens_table(report.worst_tokens(10), report.num_tokens),
        "<h2>Drift per request</h2>", request_drift_table(report.request_drift()),
        turn_drift_table(report.breakdowns),
        advice,
        "<h2>Rollout correction (verl rollout_corr/*)</h2>", key_value_table(report.metrics),
        attribution,
        server_settings_html(prov),
        "<h2>Provenance</h2>", key_value_table(prov),
        f"<h2>Extras</h2>{extras}" if extras else "",
        "</body></html>",
    ]
    return "\n".join(p for p in parts if p)
