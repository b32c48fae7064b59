"""The "Which side moved" section: each side's error from the gold, per token and by position, from
the stored report alone.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

import numpy as np

from parity.core.schema import GOLD_SUMMARY_KEYS, GOLD_VERDICT_KEY
from parity.render.figures import BLUE, GREY, ORANGE, figure_img, new_figure
from parity.report.document import number_text

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from parity.report.document import ParityReport

#: errors below this (nats) are drawn at it on the log axes: float64 agreement, or exactly 0.
ERROR_FLOOR = 1e-9


def gold_scatter(train_error: np.ndarray, rollout_error: np.ndarray) -> Figure:
    """Each token's rollout error against its train error (nats, `[tokens]`), log-log, rasterized."""
    train = np.maximum(np.asarray(train_error, np.float64), ERROR_FLOOR)
    rollout = np.maximum(np.asarray(rollout_error, np.float64), ERROR_FLOOR)
    fig, ax = new_figure()
    above = int((rollout > train).sum())
    ax.set_title(f"error from the gold per token ({train.size} tokens, {above} with the rollout farther)",
                 fontsize=10)
    ax.set_xlabel("train error |logp_train - logp_gold| (nats)")
    ax.set_ylabel("rollout error (nats)")
    if train.size == 0:
        ax.text(0.5, 0.5, "no tokens", ha="center", va="center", transform=ax.transAxes)
        return fig
    ax.scatter(train, rollout, s=4, color=BLUE, alpha=0.4, linewidths=0, rasterized=True)
    low = min(train.min(), rollout.min())
    high = max(train.max(), rollout.max())
    ax.plot([low, high], [low, high], color=GREY, linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    return fig


def gold_position_figure(by_position: dict[str, list[dict[str, Any]]]) -> Figure:
    """Each side's mean error from the gold per response-position bucket
    (`parity.assess.accuracy.gold_by_position`), on a log axis."""
    fig, ax = new_figure()
    ax.set_title("error from the gold by response position", fontsize=10)
    ax.set_xlabel("response position")
    ax.set_ylabel("mean |logp - logp_gold| (nats)")
    rows = by_position.get("train", [])
    if not rows:
        ax.text(0.5, 0.5, "no tokens", ha="center", va="center", transform=ax.transAxes)
        return fig
    x = np.arange(len(rows))
    for side, color in (("train", BLUE), ("rollout", ORANGE)):
        mean = [np.nan if r["mean_abs_logprob_diff"] is None else r["mean_abs_logprob_diff"]
                for r in by_position[side]]
        ax.plot(x, np.maximum(mean, ERROR_FLOOR), color=color, marker="o", markersize=3, label=side)
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    crowded = len(rows) > 6
    ax.set_xticks(x, [f"{r['lo']:g}–{r['hi']:g}" for r in rows], rotation=45 if crowded else 0,
                  ha="right" if crowded else "center", fontsize=7)
    return fig


def gold_plots(report: ParityReport) -> list[str]:
    """The two gold figures of a report as inline <img> tags; none when it has no gold."""
    errors = report.gold_errors()
    if errors is None:
        return []
    return [figure_img(gold_scatter(errors[0], errors[1]), "error from the gold per token"),
            figure_img(gold_position_figure(report.breakdowns.get("gold_by_position", {})),
                       "error from the gold by position")]


def gold_html(report: ParityReport) -> str:
    """The "Which side moved" section of a report page: the verdict, each side's error from the gold
    and the figures; for a report without a gold, why it did not run (when the report says)."""
    how = report.extras.get("gold", {})
    if report.gold_logprobs is None:
        if how.get("ran") is False:
            return (f'<h2 id="gold">Which side moved</h2><p class="sub">The gold forward did not run: '
                    f'{html.escape(str(how.get("reason", "")))}. Pass gold=True (--gold) to run it.</p>')
        return ""
    summary = report.summary
    if GOLD_VERDICT_KEY not in summary:  # it ran, but no token is finite on all three sides
        return ('<h2 id="gold">Which side moved</h2><p class="sub">The gold forward ran, but no token has a '
                'finite logprob on all three sides (trainer, rollout, gold): nothing was measured.</p>')
    figures = {key: summary[key] for key in GOLD_SUMMARY_KEYS if key in summary and key != GOLD_VERDICT_KEY}
    table = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(_value(v))}</td></tr>"
                    for k, v in figures.items())
    sub = ", ".join(f"{k} {v}" for k, v in how.items() if k != "ran" and isinstance(v, (str, int, float)))
    return "\n".join([
        '<h2 id="gold">Which side moved</h2>',
        f'<p class="advice">{html.escape(str(summary[GOLD_VERDICT_KEY]))}.</p>',
        f'<p class="sub">gold forward: {html.escape(sub)}</p>' if sub else "",
        f'<table class="kv">{table}</table>', '<div class="row">', *gold_plots(report), "</div>",
    ])


def _value(value: Any) -> str:
    if isinstance(value, float):
        return number_text(value, 4)
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return str(value)
