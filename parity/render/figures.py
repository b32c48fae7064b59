"""Figures of parity's pages: pyplot-free matplotlib `Figure`s (thread-safe) from plain arrays,
embedded as inline base64 SVG, so pages need no network or side files.
"""

from __future__ import annotations

import base64
import html
import io
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_FIGSIZE = (6.4, 3.4)  # inches; 3 fit side by side on a wide screen, stacked on a narrow one
_SMALL_FIGSIZE = (4.4, 2.7)  # inches: small multiples (one chart per metric)
#: the colours of every parity figure (matplotlib's tab10 blue, orange, red and grey).
BLUE, ORANGE, RED, GREY = "#1f77b4", "#ff7f0e", "#d62728", "#7f7f7f"


def new_figure(*, small: bool = False) -> tuple[Figure, Any]:
    """A figure of parity's report-plot size (`small`: a small multiple's) with one axes (no
    pyplot: no global figure state)."""
    # matplotlib on first drawing: a page without figures (or `import parity`) never loads it
    from matplotlib.figure import Figure

    if not small:
        fig = Figure(figsize=_FIGSIZE, layout="constrained")
        return fig, fig.add_subplot()
    # fixed margins: constrained layout doubles the drawing time of a chart, and a page of small
    # multiples is drawn again every few training steps
    fig = Figure(figsize=_SMALL_FIGSIZE)
    fig.subplots_adjust(left=0.16, right=0.97, bottom=0.17, top=0.9)
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
    """Histogram of per-token log ratios (nats) `[num_tokens]` on a log count axis (drift lives in the
    tails); non-finite values counted in the title.
    """
    values = np.asarray(log_ratio, dtype=np.float64).ravel()
    finite = values[np.isfinite(values)]
    span = float(np.max(np.abs(finite))) if finite.size else 0.0
    notes = [f"{values.size} tokens"]
    if values.size > finite.size:
        notes.append(f"{values.size - finite.size} non-finite")
    if finite.size and span == 0.0:  # not "all": a non-finite ratio is a side's -inf, no agreement
        notes.append("all identical" if values.size == finite.size else "the finite ones identical")
    fig, ax = new_figure()
    ax.set_title(f"log ratio per token ({', '.join(notes)})", fontsize=10)
    ax.set_xlabel("logp_train - logp_rollout (nats)")
    ax.set_ylabel("tokens")
    if finite.size == 0:
        ax.text(0.5, 0.5, "no finite tokens", ha="center", va="center", transform=ax.transAxes)
        return fig
    if span == 0.0:
        # one bar at 0 says "identical" better than an empty axis
        ax.bar([0.0], [finite.size], width=1.0, color=BLUE)
        ax.set_xlim(-1.0, 1.0)
    else:
        ax.hist(finite, bins=np.linspace(-span, span, 61), color=BLUE)
        ax.set_yscale("log")
    ax.axvline(0.0, color=GREY, linewidth=0.8)
    return fig


def breakdown_figure(rows: list[dict[str, Any]], *, title: str, xlabel: str) -> Figure:
    """Mean (bars, left axis) and max (line, right axis: often 10-100x) |Δlogp| per breakdown bucket."""
    fig, ax = new_figure()
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    if not rows:
        ax.text(0.5, 0.5, "no tokens", ha="center", va="center", transform=ax.transAxes)
        return fig
    x = np.arange(len(rows))
    mean = np.array([_number(row.get("mean_abs_logprob_diff")) for row in rows])
    peak = np.array([_number(row.get("max_abs_logprob_diff")) for row in rows])
    ax.bar(x, mean, color=BLUE)
    ax.set_ylabel("mean |Δlogp| (nats)", color=BLUE)
    ax.set_ylim(bottom=0.0)
    peak_ax = ax.twinx()
    peak_ax.plot(x, peak, color=RED, marker="o", markersize=3, linewidth=1)
    peak_ax.set_ylabel("max |Δlogp| (nats)", color=RED)
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


def step_trend_figure(steps: list[int], values: list[float | None], *, title: str,
                      low: float | None = None, high: float | None = None,
                      flagged: set[int] | None = None, log_scale: bool = False,
                      restarts: list[int] | None = None) -> Figure:
    """One metric over training steps: flagged steps red, bounds dashed, restarts dotted, None as gaps;
    `log_scale` where every value is positive.
    """
    fig, ax = new_figure(small=True)
    ax.set_title(title, fontsize=9)
    y = np.array([_number(v) for v in values])
    ax.plot(steps, y, color=BLUE, linewidth=1.2, marker="o" if len(steps) <= 200 else None, markersize=3)
    hits = [(s, v) for s, v in zip(steps, y) if flagged and s in flagged]
    if hits:
        ax.plot([s for s, _ in hits], [v for _, v in hits], linestyle="none", marker="o", markersize=5,
                color=RED)
    for bound in (low, high):
        if bound is not None:
            ax.axhline(bound, color=RED, linestyle="--", linewidth=0.8)
    for step in restarts or ():
        ax.axvline(step, color="grey", linestyle=":", linewidth=1.0)
    finite = y[np.isfinite(y)]
    if log_scale and finite.size and bool((finite > 0).all()):
        ax.set_yscale("log")
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, linewidth=0.3, alpha=0.5)
    return fig
