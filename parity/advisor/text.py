"""The advice as terminal text: recommendation, reason, config to paste, and the candidates table.

Reads the JSON section (`Advice.to_dict()`), so a stored report's advice prints like a fresh one.
"""

from __future__ import annotations

import json
from typing import Any

from parity.advisor.export import verl_overrides

#: table columns: (header, figure key, format).
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("trunc tok", "frac_tokens_truncated", "{:.2%}"), ("trunc seq", "frac_seqs_truncated", "{:.1%}"),
    ("removed tok", "frac_tokens_removed", "{:.2%}"), ("removed seq", "frac_seqs_removed", "{:.1%}"),
    ("ESS", "ess", "{:.3f}"), ("max w", "max_weight", "{:.3g}"), ("var w", "weight_var", "{:.3g}"),
    ("mass removed", "mass_removed", "{:.3%}"), ("drift removed", "drift_removed", "{:.1%}"),
    ("bias", "bias", "{:+.2e}"), ("bias 95% CI", "", ""),
)


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    if not key:
        low, high = row["bias_low"], row["bias_high"]
        return "" if low != low else f"[{low:+.2e}, {high:+.2e}]"  # NaN: no bootstrap
    return fmt.format(row[key])


def advice_text(d: dict[str, Any]) -> str:
    """Plain text of an advice section."""
    rec = d["recommendation"]
    drift = d["drift"]
    lines = [f"recommended correction: {rec['name']}", f"reason: {rec['reason']}",
             f"({drift['tokens']} tokens in {drift['sequences']} sequences; max |Δlogp| "
             f"{drift['max_abs_log_ratio']:.3g} nats, k3 KL {drift['k3_mean']:.3g} per token)"]
    frameworks = rec["frameworks"]
    if frameworks["verl"] is not None:
        lines += ["verl:", "  " + verl_overrides(frameworks["verl"])]
    if frameworks["nemo_rl"] is not None:
        lines += ["NeMo-RL:", "  " + json.dumps(frameworks["nemo_rl"])]
    if frameworks["slime"] is not None:
        lines += ["slime:", "  " + (" ".join(frameworks["slime"]) or "(no correction flags)")]
    lines += [f"note: {note}" for note in frameworks["notes"]]
    header = ["candidate", *(h for h, _, _ in COLUMNS)]
    cells = [header] + [[row["name"], *(_cell(row, k, f) for _, k, f in COLUMNS)] for row in d["candidates"]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines.append(f"candidates ({len(d['candidates'])}; bias against untruncated IS, {d['bootstrap']} "
                 "bootstrap resamples of sequences):")
    for r in cells:
        lines.append("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                      for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)
