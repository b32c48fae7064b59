"""The "Beyond the sampled token" section of a report page: KL bounds per position and the worst
positions' top-5 side by side, from `extras["distribution"]` alone.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

import numpy as np

from parity.core.schema import DISTRIBUTION_SUMMARY_KEYS
from parity.render.figures import BLUE, ORANGE, figure_img, new_figure
from parity.report.document import number_text

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from parity.report.document import ParityReport

#: KL values below this (nats; exactly 0 included) are drawn at it on the log axis.
KL_FLOOR = 1e-12
#: infinite KL values (nats) are drawn at this height, and counted in the title.
KL_CEILING = 1e3


def kl_position_figure(forward: list[float], backward: list[float]) -> Figure:
    """Both KL lower bounds at every position (rollout order, `[positions]` nats each), log axis:
    infinite ones drawn at `KL_CEILING`, undefined (NaN) ones left as gaps, both counted in the title."""
    fig, ax = new_figure()
    sides = [np.asarray(values, np.float64) for values in (forward, backward)]
    infinite, undefined = (sum(int(test(v).sum()) for v in sides) for test in (np.isinf, np.isnan))
    notes = [f"{n} {what}" for n, what in ((infinite, f"infinite (drawn at {KL_CEILING:g})"),
                                           (undefined, "undefined (gaps)")) if n]
    ax.set_title("KL lower bounds per position (engine top-k vs trainer row)"
                 + (f"\n{', '.join(notes)}" if notes else ""), fontsize=10)
    ax.set_xlabel("position (rollouts in order)")
    ax.set_ylabel(f"nats (floor {KL_FLOOR:g})")
    if not forward:
        ax.text(0.5, 0.5, "no positions", ha="center", va="center", transform=ax.transAxes)
        return fig
    x = np.arange(len(forward))
    for values, color, label in zip(sides, (BLUE, ORANGE), ("KL(train || engine)", "KL(engine || train)")):
        # NaN stays NaN (a gap): nan_to_num would draw an undefined KL at the floor, as agreement
        ax.plot(x, np.where(np.isinf(values), KL_CEILING, np.maximum(values, KL_FLOOR)),
                color=color, linewidth=0.8, label=label, rasterized=True)
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    return fig


def _entries(side: dict[str, Any], tokens: dict[str, str]) -> str:
    return "<br>".join(f"{html.escape(repr(tokens.get(str(t), str(t))))} {_logprob(lp)}"
                       for t, lp in zip(side["ids"], side["logprobs"]))


def _logprob(lp: float) -> str:
    """A top-k logprob at 3 decimals, or 3 significant digits where 3 decimals would print a nonzero
    one as 0 (a probability of 0.9996 is no certainty)."""
    text = f"{lp:.3f}"
    return f"{lp:.3g}" if float(text) == 0.0 and lp != 0.0 else text


def distribution_html(report: ParityReport) -> str:
    """The section, or "" for a report without top-k."""
    section = report.extras.get("distribution")
    if not section:
        return ""
    tokens = (report.extras.get("text") or {}).get("tokens", {})
    summary = "".join(f"<tr><th>{html.escape(k)}</th><td>{_value(report.summary[k])}</td></tr>"
                      for k in DISTRIBUTION_SUMMARY_KEYS if k in report.summary)
    rows = "".join(
        f"<tr><td>{html.escape(str(w['request_id']))}/{w['sample_index']}</td><td>{w['position']}</td>"
        f"<td>{html.escape(repr(tokens.get(str(w['token_id']), str(w['token_id']))))}</td>"
        f"<td>{w['kl_train_engine']:.3g}</td><td>{w['kl_engine_train']:.3g}</td><td>{w['tv']:.3g}</td>"
        f"<td>{w['sampled_rank']}</td><td class=\"text\">{_entries(w['engine'], tokens)}</td>"
        f"<td class=\"text\">{_entries(w['train'], tokens)}</td></tr>" for w in section["worst"])
    return "\n".join([
        '<h2 id="distribution">Beyond the sampled token</h2>',
        f'<p class="sub">The engine\'s top-{section["top_k"]} at every position against the training '
        "forward's full row under the same processing; KL and TV are lower bounds "
        "(docs/DISTRIBUTION.md).</p>",
        f'<div class="row"><table class="kv">{summary}</table>',
        figure_img(kl_position_figure(section["kl_train_engine"], section["kl_engine_train"]),
                   "KL per position"), "</div>",
        "<h3>Worst positions (largest KL(train || engine))</h3>",
        '<table class="worst"><tr><th>rollout</th><th>position</th><th>sampled</th><th>KL(t||e)</th>'
        "<th>KL(e||t)</th><th>TV</th><th>rank in trainer</th><th>engine top-5</th><th>trainer top-5</th></tr>"
        f"{rows}</table>",
    ])


def _value(value: Any) -> str:
    return number_text(value, 4) if isinstance(value, float) else html.escape(str(value))
