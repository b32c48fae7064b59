"""Tables and bar charts of drift attribution, for the terminal and for HTML pages, from the JSON
forms alone (pyplot-free figures inlined by `figure_img`).
"""

from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from parity.core.schema import percent
from parity.render.figures import BLUE, GREY, ORANGE, RED, figure_img, new_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: ops table columns: (header, function of a family row).
_OPS_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("family", lambda r: r["family"]),
    ("share", lambda r: percent(r["share"], 1)),
    ("added mean|Δ|", lambda r: f"{r['added']:.3e}"),
    ("native-only max|Δ|", lambda r: f"{r['native_only']['max_abs_logprob_diff']:.3e}"),
    ("native-only mean|Δ|", lambda r: f"{r['native_only']['mean_abs_logprob_diff']:.3e}"),
    ("native-only k3", lambda r: f"{r['native_only']['k3_kl']:.3e}"),
    ("removed mean|Δ|", lambda r: f"{r['removed']:.3e}"),
    ("invariant-only mean|Δ|", lambda r: f"{r['invariant_only']['mean_abs_logprob_diff']:.3e}"),
)
_LAYER_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("stage", lambda s: s["stage"]),
    ("rel error", lambda s: f"{s['rel_error']:.3e}"),
    ("max|Δ|", lambda s: f"{s['max_abs']:.3e}"),
    ("differing", lambda s: f"{s['differing']}/{s['elements']}"),
)


def _drift_line(name: str, drift: dict[str, float]) -> str:
    return (f"{name}: max|Δlogp| {drift['max_abs_logprob_diff']:.3e}, mean|Δlogp| "
            f"{drift['mean_abs_logprob_diff']:.3e}, k3 KL {drift['k3_kl']:.3e} (nats)")


def _note(ops: dict[str, Any]) -> str:
    """A hint when every family's share is zero but stock kernels drift all together, else ""."""
    if any(r["share"] for r in ops["families"]) or \
            ops["all_native"]["mean_abs_logprob_diff"] <= ops["baseline"]["mean_abs_logprob_diff"]:
        return ""
    return ("No family drifts on its own, yet all native does: the drift needs several stock ops at once, "
            "or (on CPU) from stock ops splitting their work across threads by the batch's shape.")


def _text_table(columns: tuple[tuple[str, Any], ...], rows: list[dict[str, Any]]) -> str:
    cells = [[h for h, _ in columns]] + [[str(fn(r)) for _, fn in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def ops_text(ops: dict[str, Any]) -> str:
    """Terminal table of an `OpAttribution.to_dict()`: sides, baseline, all native, one row per family."""
    lines = [
        f"A: {ops['setting_a']['label']}", f"B: {ops['setting_b']['label']}",
        f"{ops['num_sequences']} sequences, {ops['num_tokens']} response tokens",
        _drift_line("all invariant (baseline)", ops["baseline"]),
        _drift_line("all native", ops["all_native"]),
        _text_table(_OPS_COLUMNS, ops["families"]),
    ]
    note = _note(ops)
    return "\n".join([*lines, note] if note else lines)


def layers_text(layers: dict[str, Any]) -> str:
    """Terminal table of a `LayerDiff.to_dict()`: one row per stage and the first differing stage."""
    first = layers["first_differing"]
    return "\n".join([
        f"A: {layers['setting_a']['label']}", f"B: {layers['setting_b']['label']}",
        f"first differing stage: {first if first is not None else 'none (bitwise equal everywhere)'}",
        _text_table(_LAYER_COLUMNS, layers["stages"]),
    ])


def ops_figure(ops: dict[str, Any], *, title: str = "drift by kernel family") -> Figure:
    """Bars per family: mean |Δlogp| with only it native and only it invariant, against dashed lines at
    the all-invariant and all-native drift.
    """
    rows = ops["families"]
    fig, ax = new_figure()
    ax.set_title(title, fontsize=10)
    ax.set_ylabel("mean |Δlogp| (nats)")
    x = np.arange(len(rows))
    native = [r["native_only"]["mean_abs_logprob_diff"] for r in rows]
    invariant = [r["invariant_only"]["mean_abs_logprob_diff"] for r in rows]
    ax.bar(x - 0.2, native, width=0.4, color=RED, label="only this family native")
    ax.bar(x + 0.2, invariant, width=0.4, color=BLUE, label="only this family invariant")
    ax.axhline(ops["baseline"]["mean_abs_logprob_diff"], color=GREY, linestyle="--", linewidth=0.8,
               label="all invariant")
    ax.axhline(ops["all_native"]["mean_abs_logprob_diff"], color=ORANGE, linestyle="--", linewidth=0.8,
               label="all native")
    top = max([*native, *invariant, ops["baseline"]["mean_abs_logprob_diff"],
               ops["all_native"]["mean_abs_logprob_diff"]])
    ax.set_ylim(0.0, 1.15 * top if top > 0 else 1.0)
    ax.set_xticks(x, [f"{r['family']}\n{percent(r['share'], 0)}" for r in rows], fontsize=7)
    ax.legend(fontsize=7, loc="upper right")
    return fig


def layers_figure(layers: dict[str, Any], *, title: str = "relative error by stage") -> Figure:
    """Relative error of B against A per stage on a log axis; bitwise-equal stages are marked "=",
    the first differing stage is drawn in red."""
    stages = layers["stages"]
    fig, ax = new_figure()
    ax.set_title(title, fontsize=10)
    ax.set_ylabel("||b - a|| / ||a||")
    x = np.arange(len(stages))
    errors = np.array([s["rel_error"] for s in stages], dtype=np.float64)
    colors = [RED if s["stage"] == layers["first_differing"] else BLUE for s in stages]
    shown = np.where(errors > 0, errors, np.nan)  # a log axis cannot draw 0: those get a "=" mark
    if np.isfinite(shown).any():
        ax.bar(x, shown, color=colors)
        ax.set_yscale("log")
        ax.set_ylim(bottom=float(np.nanmin(shown)) / 10)  # so the smallest nonzero bar stays visible
    else:
        ax.set_ylim(0, 1)
    for i, s in enumerate(stages):
        if not s["differing"]:
            ax.annotate("=", (x[i], 0), xycoords=("data", "axes fraction"), ha="center", va="bottom",
                        color=GREY)
    ax.set_xticks(x, [s["stage"] for s in stages], rotation=45 if len(stages) > 8 else 0, fontsize=7)
    return fig


_ENGINE_COLUMNS: tuple[tuple[str, Any], ...] = (
    *_LAYER_COLUMNS[:3], ("share differing", lambda s: percent(s["share"], 2)),
)


def _growth(phase: dict[str, Any]) -> str:
    growth = phase["growth"]
    if growth is None:
        return "no layer output differs"
    if not math.isfinite(growth):  # no ratio: say which end is not finite
        first = next((d for d in phase["depth"] if d != 0), math.nan)  # NaN != 0: a NaN layer differs
        if math.isfinite(first):  # the last layer's error is inf or NaN, not the first differing one's
            return (f"not finite at the last layer ({phase['depth'][-1]}), from {first:.3g} at the first "
                    "differing layer (no growth ratio)")
        return "not finite at the first differing layer (no growth ratio)"
    return f"x{growth:.3g} from the first differing layer"


def _first(phase: dict[str, Any], positions: int) -> str:
    """The phase's first differing stage; "none" says why: no position compared is no evidence of
    equality (a phase the capture never reached)."""
    if phase["first_differing"] is not None:
        return phase["first_differing"]
    return "none (no position compared)" if positions == 0 else "none (bitwise equal everywhere)"


def engine_text(diff: dict[str, Any]) -> str:
    """Terminal tables of an `EngineDiff.to_dict()`: per phase, the first differing stage, the growth
    over depth and one row per stage."""
    lines = [f"A: {diff['side_a']}", f"B: {diff['side_b']}",
             f"{len(diff['sequences'])} sequences; {diff['parted']} parted (compared up to their first "
             f"differing token)"]
    for phase in diff["phases"]:
        positions = diff["positions"][phase["phase"]]
        lines += [f"-- {phase['phase']} ({positions} positions): first differing stage "
                  f"{_first(phase, positions)}; layer outputs {_growth(phase)}",
                  _text_table(_ENGINE_COLUMNS, phase["stages"])]
    return "\n".join(lines)


def depth_figure(diff: dict[str, Any], *, title: str = "relative error over depth") -> Figure:
    """Relative error of each decoder layer's output, prefill and decode, on a log axis (a phase
    whose layer outputs are all bitwise equal is drawn at the bottom, marked "=")."""
    fig, ax = new_figure()
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("||b - a|| / ||a||")
    drawn = False
    for phase, color in zip(diff["phases"], (BLUE, ORANGE)):
        depth = np.array(phase["depth"], dtype=np.float64)
        shown = np.where(depth > 0, depth, np.nan)
        if np.isfinite(shown).any():
            ax.plot(np.arange(len(depth)), shown, marker="o", color=color, label=phase["phase"])
            drawn = True
        else:
            ax.plot([], [], color=color, label=f"{phase['phase']} (=)")
    if drawn:
        ax.set_yscale("log")
    ax.legend(fontsize=7)
    return fig


def engine_html(diff: dict[str, Any]) -> str:
    """HTML fragment of an `EngineDiff.to_dict()`: the sides, the depth chart, and per phase the
    stage table and bar chart."""
    parts = ['<div class="engine-probe"><h2>Inside the engine</h2>',
             f"<p>A: {html.escape(diff['side_a'])}<br>B: {html.escape(diff['side_b'])}<br>"
             f"{len(diff['sequences'])} sequences; {diff['parted']} parted</p>"]
    if any(phase["depth"] for phase in diff["phases"]):
        parts.append(figure_img(depth_figure(diff), "relative error of each layer's output over depth"))
    for phase in diff["phases"]:
        name = phase["phase"]
        positions = diff["positions"][name]
        parts += [f"<h3>{html.escape(name)} ({positions} positions)</h3>",
                  f"<p>first differing stage: <b>{html.escape(_first(phase, positions))}</b>; layer outputs "
                  f"{html.escape(_growth(phase))}</p>",
                  _html_table(_ENGINE_COLUMNS, phase["stages"], "engine-probe-stages"),
                  figure_img(layers_figure(phase, title=f"relative error by stage ({name})"),
                             f"relative error by stage, {name}")]
    parts.append("</div>")
    return "\n".join(parts)


def _html_table(columns: tuple[tuple[str, Any], ...], rows: list[dict[str, Any]], css_class: str) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h, _ in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(fn(r)))}</td>" for _, fn in columns) + "</tr>"
                   for r in rows)
    return f'<table class="{css_class}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _sides(result: dict[str, Any]) -> str:
    return (f"<p>A: {html.escape(result['setting_a']['label'])}<br>"
            f"B: {html.escape(result['setting_b']['label'])}</p>")


def section_html(section: dict[str, Any]) -> str:
    """HTML fragment of an attribution section (`parity.attribute.attribution_section`):
    per axis, the op-family table and bar chart and the layer-probe table and chart; the engine
    probe's (`engine_html`) when the section has an "engine" entry (`parity attribute --backend`)."""
    parts = ['<div class="attribution"><h2>Drift attribution</h2>']
    if "engine" in section:
        parts.append(engine_html(section["engine"]))
    for entry in section.get("axes", []):
        axis = html.escape(entry["axis"])
        parts.append(f"<h3>Axis: {axis}</h3><p>{html.escape(entry['description'])}</p>")
        ops = entry.get("ops")
        if ops is not None:
            parts += ["<h4>Kernel families</h4>", _sides(ops),
                      f"<p>{html.escape(_drift_line('all invariant (baseline)', ops['baseline']))}<br>"
                      f"{html.escape(_drift_line('all native', ops['all_native']))}<br>"
                      f"{html.escape(_note(ops))}</p>",
                      _html_table(_OPS_COLUMNS, ops["families"], "attribution-ops"),
                      figure_img(ops_figure(ops, title=f"drift by kernel family ({entry['axis']})"),
                                 f"drift by kernel family, axis {entry['axis']}")]
        layers = entry.get("layers")
        if layers is not None:
            first = layers["first_differing"]
            parts += ["<h4>Layers</h4>", _sides(layers),
                      f"<p>first differing stage: <b>{html.escape(first or 'none')}</b></p>",
                      _html_table(_LAYER_COLUMNS, layers["stages"], "attribution-layers"),
                      figure_img(layers_figure(layers, title=f"relative error by stage ({entry['axis']})"),
                                 f"relative error by stage, axis {entry['axis']}")]
    parts.append("</div>")
    return "\n".join(parts)


def attribution_page(section: dict[str, Any], title: str) -> str:
    """A self-contained HTML page holding one attribution section (`parity attribute --html`)."""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title>"
            "<style>body { font-family: system-ui, sans-serif; margin: 24px; } "
            "table { border-collapse: collapse; font-size: 13px; } th, td { border: 1px solid #ddd; "
            "padding: 3px 8px; } img.plot { width: 560px; max-width: 100%; }</style></head><body>"
            f"<h1>{html.escape(title)}</h1>\n{section_html(section)}\n</body></html>\n")
