"""The monitor's page, `out_dir/index.html`: per-step trend charts (naming the steps they leave out, with
no finite value, and where the thresholds changed), alerts, restarts, and details of chosen steps (the
latest and the `WORST_STEPS` of largest k3_kl, or `--step N`). Drawn from the store alone and written
atomically; `PageRenderer` draws off the critical path and a failed drawing never touches the store.
NumPy and matplotlib, no torch.
"""

from __future__ import annotations

import datetime as _dt
import html
import logging
import math
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from parity.monitor.background import Background
from parity.monitor.store import MonitorStore, appended_by
from parity.render.advice import framework_blocks
from parity.render.figures import breakdown_figure, figure_img, step_trend_figure
from parity.render.report_page import PAGE_CSS, key_value_table

#: the page's file name inside a monitor directory.
PAGE_FILE = "index.html"
#: metrics charted over steps (those a step has), before any other a threshold names.
TREND_KEYS: tuple[str, ...] = (
    "max_abs_logprob_diff", "mean_abs_logprob_diff", "k3_kl", "is_ratio_mean", "is_ratio_std",
    "rollout_probs_diff_max", "rollout_probs_pearson", "frac_tokens_ratio_gt_2",
    "frac_tokens_outside_support",
    "rollout_corr/rollout_is_eff_sample_size", "rollout_corr/rollout_is_ratio_fraction_high",
    "distribution/kl_train_engine_mean", "distribution/tv_mean", "distribution/top_k_overlap",
)
#: alerts listed on the page, newest first (every alert stays in the store).
ALERTS_SHOWN = 50
#: how much lower than the training process the child that draws the page runs (`os.nice`).
PAGE_NICENESS = 10
#: steps of largest k3_kl detailed on the page besides the latest.
WORST_STEPS = 3
#: steps named per kind of value a trend chart leaves out (the rest are counted).
GAPS_SHOWN = 5

log = logging.getLogger("parity.monitor")

_MONITOR_CSS = """
ul.alerts li { color: #c62828; }
.flag { color: #fff; background: #c62828; padding: 1px 6px; border-radius: 3px; }
.trends { display: flex; flex-wrap: wrap; gap: 8px; } .trends img.plot { width: 340px; }
"""


def flat_values(record: dict[str, Any]) -> dict[str, Any]:
    """One step's scalar values by name: the summary keys and the `rollout_corr/*` names."""
    return {**record.get("summary", {}), **record.get("rollout_corr", {})}


def monitor_html(run: dict[str, str], steps: list[dict[str, Any]], *, log_scale: bool = False,
                 detail: list[int] | None = None, problems: list[str] | None = None) -> str:
    """The whole self-contained page of a run's stored steps (`MonitorStore.steps()`); `detail`:
    the steps detailed (default: the latest and the `WORST_STEPS` of largest k3_kl); `problems`:
    lines naming stored rows that could not be read."""
    name = run.get("run_name", "?")
    title = f"parity monitor: {name}"
    broken = [s for s in steps if "undecodable" in s]
    steps = [s for s in steps if "undecodable" not in s]
    alerts = [(s["step"], a) for s in steps for a in s.get("alerts", [])]
    if steps:
        last = steps[-1]
        when = _dt.datetime.fromtimestamp(last["logged_at"], _dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        versions = appended_by(run)  # steps a later parity appended are not the creator's
        sub = (f"{len(steps)} steps ({steps[0]['step']}–{last['step']}), last logged {when} · "
               + (f"parity {versions[0]}" if len(versions) == 1 else
                  f"steps by parity {', '.join(versions)} (created by {versions[0]})"))
    else:
        sub = "no step logged yet"
    flag = f' <span class="flag">{len(alerts)} alert(s)</span>' if alerts else ""
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{html.escape(title)}</title><style>{PAGE_CSS}{_MONITOR_CSS}</style></head><body>",
             f"<h1>{html.escape(title)}{flag}</h1>", f'<div class="sub">{html.escape(sub)}</div>']
    lines = list(problems or []) or [f"step {s['step']} (attempt {s.get('attempt', 0)}) does not decode: "
                                     f"{s['undecodable']}" for s in broken]
    if lines:
        parts.append('<h2>Unreadable steps</h2><ul class="alerts">'
                     + "".join(f"<li>{html.escape(x)}</li>" for x in lines) + "</ul>")
    if steps:
        by_step = {s["step"]: s for s in steps}
        chosen = detail_steps(steps) if detail is None else [d for d in detail if d in by_step]
        # any step's thresholds: a session continued without them leaves the earlier steps' checks
        bounded = next((s["thresholds"] for s in reversed(steps) if s.get("thresholds")), None)
        parts += [_alerts_html(alerts, bounded), _restarts(steps), "<h2>Trends</h2>",
                  _trends(steps, log_scale), _index(chosen, by_step)]
        parts += [_detail(by_step[d], latest=d == steps[-1]["step"]) for d in chosen]
        parts.append(_recommendation_changes(steps))
    parts.append("</body></html>")
    return "\n".join(p for p in parts if p)


def detail_steps(steps: list[dict[str, Any]]) -> list[int]:
    """The steps detailed by default: the latest, then the `WORST_STEPS` of largest k3_kl (an infinite
    one first; a NaN one is not ranked)."""
    ranked = sorted((s for s in steps if _number(s.get("summary", {}).get("k3_kl")) is not None),
                    key=lambda s: -s["summary"]["k3_kl"])
    out = [steps[-1]["step"]]
    out += [s["step"] for s in ranked if s["step"] != out[0]][:WORST_STEPS]
    return out


def _index(chosen: list[int], by_step: dict[int, dict[str, Any]]) -> str:
    links = " · ".join(f'<a href="#step-{d}">step {d}</a> (k3_kl '
                       f'{_fmt(by_step[d].get("summary", {}).get("k3_kl"))})' for d in chosen)
    return (f'<p class="sub">Detailed below: {links}. Any other step: <code>parity monitor OUT_DIR --step N'
            "</code>.</p>")


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, (int, float)) else "?"


def _number(value: Any) -> float | None:
    """`value` as a float that orders (an infinity included), None for NaN, null or a non-number."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    return float(value) if ok else None


def _gaps(key: str, steps: list[dict[str, Any]], values: list[Any]) -> str | None:
    """What a trend chart of `key` leaves out: the steps that store `key` with no finite value (a gap
    in the line, as a step without the key), by kind; None where there is none."""
    kinds: dict[str, list[int]] = {}
    for s, v in zip(steps, values):
        if v is None or (isinstance(v, float) and not math.isfinite(v)):
            kinds.setdefault("null (not measured)" if v is None else str(v), []).append(s["step"])
    if not kinds:
        return None
    parts = [f"{kind} at step{'s' if len(at) > 1 else ''} {', '.join(map(str, at[:GAPS_SHOWN]))}"
             + (f" and {len(at) - GAPS_SHOWN} more" if len(at) > GAPS_SHOWN else "")
             for kind, at in kinds.items()]
    return (f"{key}: {sum(map(len, kinds.values()))} of the {len(steps)} steps storing it not charted "
            f"({'; '.join(parts)})")


def _bound_changes(steps: list[dict[str, Any]]) -> list[str]:
    """Where a resumed or continued run changed a metric's thresholds: the charts draw the latest."""
    out: list[str] = []
    before: dict[str, Any] = {}
    for i, s in enumerate(steps):
        now = s.get("thresholds") or {}
        for key in sorted(set(before) | set(now)) if i else ():
            if before.get(key) != now.get(key):
                out.append(f"{key}: {_band(before.get(key))} up to step {steps[i - 1]['step']}, "
                           f"{_band(now.get(key))} from step {s['step']}")
        before = now
    return out


def _band(bound: Any) -> str:
    if not bound:
        return "no threshold"
    low, high = ("open" if b is None else f"{b:.4g}" for b in bound)
    return f"threshold [{low}, {high}]"


def _restarts(steps: list[dict[str, Any]]) -> str:
    rows = [f"<li>step {s['step']}: attempt {s['restart']['attempt']} (the run was resumed; it supersedes "
            f"{s['restart'].get('superseded', 0)} stored step(s) from here on, kept in the store)</li>"
            for s in steps if s.get("restart")]
    return f"<h2>Restarts</h2><ul>{''.join(rows)}</ul>" if rows else ""


def _alerts_html(alerts: list[tuple[int, dict[str, Any]]], thresholds: dict[str, Any] | None) -> str:
    if not thresholds and not alerts:
        return ('<p class="sub">No alerts: no absolute thresholds set (Monitor(thresholds=...)), and no '
                'step jumped above its relative bound (Monitor(jumps=...)).</p>')
    if not alerts:
        return '<h2>Alerts</h2><p class="sub">None: every step within its thresholds.</p>'
    shown = alerts[::-1][:ALERTS_SHOWN]
    items = "".join(f"<li>step {step}: {html.escape(a['message'])}</li>" for step, a in shown)
    more = f'<p class="sub">{len(alerts) - len(shown)} older alert(s) in the store.</p>' \
        if len(alerts) > len(shown) else ""
    return f'<h2>Alerts</h2><ul class="alerts">{items}</ul>{more}'


def _trends(steps: list[dict[str, Any]], log_scale: bool) -> str:
    flats = [flat_values(s) for s in steps]
    bounds: dict[str, list[Any]] = steps[-1].get("thresholds") or {}
    keys = [k for k in TREND_KEYS if any(k in f for f in flats)]
    # a key an earlier session bounded too: its alerts are flagged on its chart
    keys += [k for k in dict.fromkeys(k for s in steps for k in (s.get("thresholds") or {})) if k not in keys]
    xs = [s["step"] for s in steps]
    restarts = [s["step"] for s in steps if s.get("restart")]
    charts = []
    gaps = []
    for key in keys:
        flagged = {s["step"] for s in steps for a in s.get("alerts", []) if a["key"] == key}
        low, high = bounds.get(key, (None, None))
        fig = step_trend_figure(xs, [f.get(key) for f in flats], title=key, low=low, high=high,
                                flagged=flagged, log_scale=log_scale, restarts=restarts)
        charts.append(figure_img(fig, f"{key} over steps"))
        stored = [(s, f[key]) for s, f in zip(steps, flats) if key in f]
        gap = _gaps(key, [s for s, _ in stored], [v for _, v in stored])
        if gap is not None:
            gaps.append(gap)
    notes = [("Not charted: steps with no finite value (a gap in the line)", gaps),
             ("Thresholds changed during the run (the charts draw the latest)", _bound_changes(steps))]
    return f'<div class="trends">{"".join(charts)}</div>' + "".join(
        f'<p class="sub">{html.escape(title)}:</p><ul class="alerts">'
        + "".join(f"<li>{html.escape(x)}</li>" for x in lines[:ALERTS_SHOWN]) + "</ul>"
        for title, lines in notes if lines)


def _detail(step: dict[str, Any], *, latest: bool) -> str:
    worst = step.get("worst_tokens", [])
    head = ("uid", "row", "position", "token id", "text", "trainer logprob", "rollout logprob", "Δlogp")
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in (
            w.get("uid", ""), w["row"], w["position"], "" if w["token_id"] is None else w["token_id"],
            repr(w["text"]) if "text" in w else "",
            f"{w['trainer_logprob']:.6f}", f"{w['rollout_logprob']:.6f}", f"{w['logprob_diff']:+.3e}"))
        + "</tr>" for w in worst)
    if not body:
        body = f'<tr><td class="identical" colspan="{len(head)}">all tokens identical</td></tr>'
    table = ('<table class="worst"><thead><tr>' + "".join(f"<th>{h}</th>" for h in head)
             + f"</tr></thead><tbody>{body}</tbody></table>")
    rec = step.get("recommendation")
    advice = "" if rec is None else (
        f'<h2>Recommended correction</h2><p class="advice"><b>{html.escape(rec["name"])}</b>. '
        f'{html.escape(rec["reason"])}</p>' + framework_blocks(rec["frameworks"]))
    position = figure_img(breakdown_figure(step.get("by_position", []), title="drift by response position",
                                           xlabel="response position"), "drift by position")
    context = {k: step[k] for k in ("sampling", "correction", "meta", "policy") if step.get(k)}
    label = "Latest step" if latest else "Step"
    return "\n".join([
        f'<h2 id="step-{step["step"]}">{label}: {step["step"]}</h2>',
        '<div class="row"><div><h3>Summary</h3>', key_value_table(step.get("summary", {})), "</div>",
        "<div><h3>Rollout correction (verl rollout_corr/*)</h3>",
        key_value_table(step.get("rollout_corr", {})),
        "</div>", f"<div>{position}</div></div>",
        "<h3>Worst tokens</h3>", table, _distribution_table(step.get("distribution")),
        key_value_table(context) if context else "",
        advice,
    ])


def _distribution_table(section: dict[str, Any] | None) -> str:
    """The step's worst positions by KL(train || rollout) bound, both sides' top entries side by side."""
    if not section or not section.get("worst"):
        return ""

    def entries(side: dict[str, Any]) -> str:
        names = side.get("text") or [str(t) for t in side["ids"]]
        return "<br>".join(f"{html.escape(repr(n) if 'text' in side else n)} {v:.4f}"
                           for n, v in zip(names, side["logprobs"]))

    head = ("uid", "row", "position", "token id", "KL(train‖rollout) ≥", "TV ≥", "sampled rank",
            f"rollout top-{len(section['worst'][0]['rollout']['ids'])}", "trainer top")
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in (
        html.escape(str(w.get("uid", ""))), w["row"], w["position"], w["token_id"],
        f"{w['kl_train_engine']:.3e}", f"{w['tv']:.3e}", w["sampled_rank"],
        entries(w["rollout"]), entries(w["train"]))) + "</tr>" for w in section["worst"])
    return (f"<h3>Worst positions, full distribution (rollout top-{section['top_k']} against the "
            "trainer)</h3>"
            '<table class="worst"><thead><tr>' + "".join(f"<th>{h}</th>" for h in head)
            + f"</tr></thead><tbody>{body}</tbody></table>")


def _recommendation_changes(steps: list[dict[str, Any]]) -> str:
    rows, previous = [], None
    for s in steps:
        rec = s.get("recommendation")
        if rec is not None and rec["name"] != previous:
            rows.append(f"<tr><td>{s['step']}</td><td>{html.escape(rec['name'])}</td></tr>")
            previous = rec["name"]
    if not rows:
        return ""
    return ("<h2>Recommendation changes</h2><table><thead><tr><th>step</th><th>recommended</th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>")


def write_page(out_dir: str | Path, path: str | Path | None = None, *, log_scale: bool = False,
               detail: list[int] | None = None,
               read: tuple[dict[str, str], list[dict[str, Any]], list[str]] | None = None) -> Path:
    """Draw the page of monitor directory `out_dir` into `path` (default `out_dir/index.html`),
    atomically; returns the path. `log_scale`, `detail`: as `monitor_html`. `read`: the store's
    (run_info, steps, problems) as the caller already read them (a live run's store moves on)."""
    if read is None:
        store = MonitorStore.open(out_dir)
        try:
            read = store.run_info(), store.steps(), store.problems
        finally:
            store.close()
    text = monitor_html(read[0], read[1], log_scale=log_scale, detail=detail, problems=read[2])
    target = Path(path) if path is not None else Path(out_dir) / PAGE_FILE
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the page is an ordinary file
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _draw_in_a_child(out_dir: Path, log_scale: bool) -> None:
    """`write_page` in a child Python process (its own GIL); RuntimeError with its last error line."""
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH"))
                                                         if p)}
    # the child yields the CPU to the training process (nice +PAGE_NICENESS): on a loaded machine the
    # page may come later, the step does not wait behind it
    code = (f"import os, sys; os.nice({PAGE_NICENESS}); from parity.monitor.page import write_page; "
            "write_page(sys.argv[1], log_scale=sys.argv[2] == '1')")
    done = subprocess.run([sys.executable, "-c", code, str(out_dir), "1" if log_scale else "0"], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
        raise RuntimeError(lines[-1])


class PageRenderer:
    """Redraws a monitor's page in a background thread: `request()` returns at once (requests during a
    drawing coalesce), a failed drawing is logged, `close()` draws a last time and joins.
    """

    def __init__(self, out_dir: str | Path, *, log_scale: bool = False, background: Background | None = None
                 ) -> None:
        self.out_dir = Path(out_dir)
        self.log_scale = log_scale
        self._background = background
        self.failures = 0
        self._wanted = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="parity-monitor-page", daemon=True)
        self._thread.start()

    def request(self) -> None:
        self._wanted.set()

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            self.draw()
            if self._closing and not self._wanted.is_set():
                return

    def draw(self) -> bool:
        """Draw now, in this thread; False (and a warning) when the drawing failed."""
        try:
            if self._background is not None and self._background.mode == "process":
                _draw_in_a_child(self.out_dir, self.log_scale)
            else:
                write_page(self.out_dir, log_scale=self.log_scale)
        except Exception as exc:  # the page is a view: a failure to draw it never stops training
            self.failures += 1
            log.warning("parity monitor: could not draw %s (%s: %s); the steps are stored, the next "
                        "redraw tries again", self.out_dir / PAGE_FILE, type(exc).__name__, exc)
            return False
        return True

    def close(self, timeout: float | None = None) -> None:
        """Draw the final page and stop the thread (waits at most `timeout` seconds)."""
        self._closing = True
        self._wanted.set()
        self._thread.join(timeout)
