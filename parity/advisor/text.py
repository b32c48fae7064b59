"""The advice as terminal text: recommendation, reason, config to paste, and the candidates table.

Reads the JSON section (`Advice.to_dict()`), so a stored report's advice prints like a fresh one.
"""

from __future__ import annotations

import json
from typing import Any

from parity.advisor.export import verl_overrides
from parity.core.schema import ADVICE_COLUMNS, advice_cell


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
    if d.get("gold"):
        lines.append(f"note: {d['gold']}")
    header = ["candidate", *(h for h, _, _, _ in ADVICE_COLUMNS)]
    cells = [header] + [[row["name"], *(advice_cell(row, k, f) for _, _, k, f in ADVICE_COLUMNS)]
                        for row in d["candidates"]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines.append(f"candidates ({len(d['candidates'])}; bias against untruncated IS, {d['bootstrap']} "
                 "bootstrap resamples of sequences):")
    for r in cells:
        lines.append("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                      for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)
