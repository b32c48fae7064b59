"""The page of one RL loop run from its JSON alone: drift per backend on a symmetric-log axis (the
reference's exact 0 must show as 0), reward and KL from the start.
"""

from __future__ import annotations

import html
import warnings
from typing import Any

import numpy as np

from parity.core.tables import nonfinite_restored
from parity.render.figures import BLUE, GREY, ORANGE, RED, figure_img, new_figure
from parity.render.report_page import key_value_table

_COLORS = (BLUE, ORANGE, RED, GREY)
_CSS = ("body { font-family: system-ui, sans-serif; margin: 24px; } table { border-collapse: collapse; "
        "font-size: 13px; } th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; } "
        "img.plot { width: 560px; max-width: 100%; } .row { display: flex; flex-wrap: wrap; gap: 12px; } "
        ".bad { color: #b00; font-weight: bold; }")
#: the per-backend summary columns: (header, key of `backend_summary`).
_SUMMARY_COLUMNS = (("backend", "backend"), ("steps", "steps"), ("trained on", "trained_on"),
                    ("bitwise every step", "bitwise"), ("in sync every step", "in_sync"),
                    ("max |Δlogp| (all steps)", "max_abs_logprob_diff"),
                    ("mean |Δlogp| (mean of steps)", "mean_abs_logprob_diff"), ("k3 KL (max)", "k3_kl"),
                    ("reward (last step)", "reward_mean"))
#: the summary columns taken over steps, which a step without a finite value would leave silently.
_DRIFT_KEYS = ("max_abs_logprob_diff", "mean_abs_logprob_diff", "k3_kl")


def backend_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One backend's rows over every step -> the page's summary line; `unmeasured`: per drift column,
    the steps without a finite value (an infinite one counts in the max and mean: inf; a NaN or null one,
    which a record older than its "nonfinite" entry wrote for infinities too, is left out)."""
    return _summary([nonfinite_restored(row, f"step {row.get('step')} of {row.get('backend')}")
                     for row in rows])


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """`backend_summary` of rows whose infinities are restored already (`_by_backend`'s)."""

    def values(key: str) -> np.ndarray:
        return np.array([row[key] if row.get(key) is not None else np.nan for row in rows], dtype=float)

    drift = {key: values(key) for key in _DRIFT_KEYS}
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # every step unmeasured: NaN, shown with its count
        return {"backend": rows[0]["backend"], "steps": len(rows),
                "trained_on": bool(rows[0].get("trained_on")),
                "bitwise": all(row.get("bitwise") for row in rows),
                "in_sync": all(row.get("weights_in_sync") for row in rows),
                "max_abs_logprob_diff": float(np.nanmax(drift["max_abs_logprob_diff"])),
                "mean_abs_logprob_diff": float(np.nanmean(drift["mean_abs_logprob_diff"])),
                "k3_kl": float(np.nanmax(drift["k3_kl"])), "reward_mean": rows[-1].get("reward_mean"),
                "unmeasured": {key: int((~np.isfinite(v)).sum()) for key, v in drift.items()}}


def _by_backend(document: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in document.get("backends", [])}
    for row in document.get("steps", []):
        row = nonfinite_restored(row, f"loop record: step {row.get('step')} of {row.get('backend')}")
        out.setdefault(row["backend"], []).append(row)
    return {name: rows for name, rows in out.items() if rows}


def _series_figure(series: dict[str, list[dict[str, Any]]], keys: tuple[tuple[str, str], ...], *, title: str,
                   ylabel: str, symlog: bool = False) -> Any:
    """One line per (backend, key): `keys` holds (row key, line style)."""
    fig, ax = new_figure()
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    for color, (name, rows) in zip(_COLORS * 4, series.items()):
        steps = [row["step"] for row in rows]
        for key, style in keys:
            ys = [row[key] if row.get(key) is not None else np.nan for row in rows]
            label = name if len(keys) == 1 else f"{name} {key.split('_')[0]}"
            ax.plot(steps, ys, style, color=color, marker="o", markersize=2, linewidth=1, label=label)
    if symlog:
        ax.set_yscale("symlog", linthresh=1e-4)
    ax.legend(fontsize=7)
    return fig


def loop_plots(document: dict[str, Any]) -> list[str]:
    """The page's figures as inline `<img>` tags: drift per backend, reward, policy KL."""
    series = _by_backend(document)
    if not series:
        return []
    trained = {document.get("train_on", ""): series.get(document.get("train_on", ""), [])}
    return [
        figure_img(_series_figure(series, (("max_abs_logprob_diff", "-"), ("mean_abs_logprob_diff", "--")),
                                  title="drift: rollout vs training forward at the step's weights",
                                  ylabel="|Δlogp| (nats, symlog)", symlog=True), "drift per backend"),
        figure_img(_series_figure(series, (("k3_kl", "-"),), title="k3 KL(rollout || training forward)",
                                  ylabel="nats per token (symlog)", symlog=True), "k3 KL per backend"),
        figure_img(_series_figure(series, (("reward_mean", "-"),), title="reward mean", ylabel="reward"),
                   "reward per backend"),
        figure_img(_series_figure({k: v for k, v in trained.items() if v}, (("policy_kl_from_start", "-"),),
                                  title="policy KL from step 0 (k3, on step 0's rollouts)",
                                  ylabel="nats per token"), "policy KL from start"),
    ]


def _summary_table(series: dict[str, list[dict[str, Any]]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h, _ in _SUMMARY_COLUMNS)
    body = []
    for rows in series.values():
        s = _summary(rows)  # restored by `_by_backend`: restoring again would be a no-op
        cells = []
        for _, key in _SUMMARY_COLUMNS:
            value = s[key]
            # out of sync is always wrong; not bitwise only on the reference engine
            bad = value is False and (key == "in_sync" or (key == "bitwise" and s["backend"] == "reference"))
            text = f"{value:.4g}" if isinstance(value, float) else str(value)
            missing = s["unmeasured"].get(key, 0)
            if missing:  # not the max/mean of every step: say how many are out, in red
                text += f" ({missing} of {s['steps']} steps with no finite value)"
                bad = True
            cells.append(f'<td class="{"bad" if bad else ""}">{html.escape(text)}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def loop_page(document: dict[str, Any]) -> str:
    """The self-contained HTML page of a loop record's JSON document."""
    title = f"parity loop: {document.get('model', '?')}, {', '.join(document.get('backends', []))}"
    series = _by_backend(document)
    status = document.get("status", "?")
    error = document.get("error")
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p>status: <b>{html.escape(str(status))}</b>"
        + (f' · <span class="bad">{html.escape(str(error))}</span>' if error else "")
        + f" · trained on {html.escape(str(document.get('train_on', '?')))}</p>",
        _summary_table(series) if series else "<p>no steps recorded</p>",
        '<h2>Per step</h2><div class="row">', *loop_plots(document), "</div>",
        "<h2>Settings</h2>", key_value_table(document.get("config", {})),
        "<h2>Provenance</h2>", key_value_table(document.get("provenance", {})),
        "</body></html>",
    ]
    return "\n".join(p for p in parts if p)
