"""The page of one audit (`AuditResult.to_dict()`): verdicts, one row per check, server settings and
provenance, from the JSON alone.
"""

from __future__ import annotations

import html
import json
from typing import Any

from parity.core.schema import AUDIT_VERDICT_CHECKS
from parity.render.report_page import key_value_table, server_settings_html

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; margin: 0 0 4px 0; } h2 { font-size: 16px; margin: 24px 0 8px 0; }
.verdict { display: inline-block; padding: 2px 10px; margin-right: 8px; border-radius: 4px; color: #fff;
           font-weight: 600; }
.yes { background: #2e7d32; } .no { background: #c62828; } .unchecked { background: #777; }
.skip { color: #777; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
td { font-variant-numeric: tabular-nums; } td.num { text-align: right; }
tr.identical td.status, tr.expected td.status { color: #2e7d32; font-weight: 600; }
tr.differs td.status { color: #c62828; font-weight: 600; }
pre { background: #f6f6f6; padding: 6px; font-size: 12px; margin: 0; white-space: pre-wrap; }
p.control { background: #ffebee; padding: 6px 10px; border-left: 4px solid #c62828; }
"""

#: what each check compares, in the page's words.
_MEANING = {
    "repeat": "the same batch twice",
    "batch": "each needle alone vs inside larger batches of other-length neighbours",
    "order": "the same batch vs the same batch shuffled",
    "prefill_decode": "sampled (decode) logprobs vs the backend's own score of the same tokens (prefill)",
    "prefix_cache": "prefix cache off vs served from a warm cache",
    "seed": "control: other seeds must give other samples",
}


#: the control check: its samples must differ.
CONTROL = "seed"
#: the checks batch invariance rests on.
INVARIANT_CHECKS = AUDIT_VERDICT_CHECKS["batch_invariant"]


def verdict_words(result: dict[str, Any]) -> tuple[str, str]:
    """The two verdicts of an audit result (its `to_dict()` form) as a person reads them: "yes",
    "NO", or "not checked" where a check the verdict rests on was skipped and none that ran
    differed (nothing measured is no NO); "partly checked (batch identical, order not checked)"
    where some ran. A check reported beside batch invariance that differs is named with it, so a
    "yes" does not read as every check identical."""
    def word(names: tuple[str, ...], flag: bool) -> str:
        checks = {n: result["checks"][n] for n in names}
        if flag:
            return "yes"
        if any(c["skipped"] is None and not c["identical"] for c in checks.values()):
            return "NO"
        ran = [n for n, c in checks.items() if c["skipped"] is None]
        if not ran:
            return "not checked"
        return "partly checked (" + ", ".join(f"{n} identical" if n in ran else f"{n} not checked"
                                              for n in names) + ")"
    invariant = word(INVARIANT_CHECKS, result["batch_invariant"])
    judged = (CONTROL, *AUDIT_VERDICT_CHECKS["deterministic"], *INVARIANT_CHECKS)
    beside = [name for name, c in result["checks"].items()
              if name not in judged and c["skipped"] is None and not c["identical"]]
    if beside:
        differ = f"{' and '.join(beside)} differ{'s' if len(beside) == 1 else ''}"
        invariant = f"{invariant[:-1]}; {differ})" if invariant.endswith(")") \
            else f"{invariant} ({' and '.join(INVARIANT_CHECKS)}; {differ})"
    return word(AUDIT_VERDICT_CHECKS["deterministic"], result["deterministic"]), invariant


def machine_clause(provenance: dict[str, Any]) -> str:
    """What an audit's verdicts are a property of: the engine and workload on this machine's CPU ISA
    and GPU (provenance `cpu_isa`, `gpu`): the same engine may differ on another ISA."""
    cpu = provenance.get("cpu_isa") or provenance.get("cpu") or "unknown CPU"
    gpu = provenance.get("gpu") or "no GPU"
    return f"a property of this engine and workload on this machine (CPU {cpu}, {gpu})"


def _sentence(text: str) -> str:
    """`text` with its first letter upper case, the rest as written (str.capitalize would lower
    the GPU's and the ISA's names: "nvidia h100", "avx-512")."""
    return text[:1].upper() + text[1:]


def _badge(label: str, word: str) -> str:
    """A verdict badge: "yes" green, "no" red, "not checked" grey; the verdict's first word decides,
    so a "yes (batch and order; prefill_decode differs)" stays green with its scope."""
    word = word.lower()
    kind = {"yes": "yes", "no": "no"}.get(word.split(" ", 1)[0], "unchecked")
    return f'<span class="verdict {kind}">{html.escape(label)}: {html.escape(word)}</span>'


def _check_row(name: str, check: dict[str, Any]) -> str:
    if check["skipped"] is not None:
        return (f'<tr class="skipped"><td>{html.escape(name)}</td>'
                f'<td>{html.escape(_MEANING.get(name, ""))}</td><td class="status skip">skipped</td>'
                f'<td colspan="4" class="skip">{html.escape(check["skipped"])}</td></tr>')
    status = row = "identical" if check["identical"] else "differs"
    if name == CONTROL:  # the control passes when the seeds' samples differ, and fails (red) when not
        status, row = ("seeds change the samples: as expected", "expected") if not check["identical"] \
            else ("identical: seeds ignored, control failed", "differs")
    first = check["first_difference"]
    detail = "" if first is None else \
        f"<pre>{html.escape(json.dumps(first, sort_keys=True, default=str))}</pre>"
    return (f'<tr class="{row}"><td>{html.escape(name)}</td><td>{html.escape(_MEANING.get(name, ""))}</td>'
            f'<td class="status">{status}</td>'
            f'<td class="num">{check["differing_requests"]} of {check["requests"]}</td>'
            f'<td class="num">{check["max_abs_logprob_diff"]:.3e}</td>'
            f'<td class="num">{check["mean_abs_logprob_diff"]:.3e}</td><td>{detail}</td></tr>')


def audit_html(result: dict[str, Any]) -> str:
    """The whole self-contained page of one audit result (its `to_dict()` form)."""
    prov = result["provenance"]
    title = f"parity audit: {result['backend']} on {result['model']} ({result['dtype']})"
    deterministic, invariant = verdict_words(result)
    seed = result["checks"]["seed"]
    control = "" if seed["skipped"] is not None or not seed["identical"] else (
        '<p class="control">Control failed: two seeds gave identical samples, so the sampling checks prove '
        "nothing (are seeds ignored?).</p>")
    head = "".join(f"<th>{h}</th>" for h in ("check", "compares", "result", "differing requests",
                                             "max |Δlogp| (nats)", "mean |Δlogp| (nats)", "first difference"))
    rows = "".join(_check_row(name, check) for name, check in result["checks"].items())
    meta = prov.get("backend_meta") or {}
    settings = {k: v for k, v in meta.items() if k != "server_settings"}
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p>{_badge('deterministic', deterministic)}{_badge('batch-invariant', invariant)}</p>",
        f"<p>{html.escape(_sentence(machine_clause(prov)))}.</p>", control,
        "<h2>Checks</h2><p>Token ids and logprobs compared bit for bit; logprobs over the common token "
        "prefix of each sample, a sample whose tokens diverge counted as differing.</p>",
        f'<table class="checks"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>',
        server_settings_html(prov),
        "<h2>How the checks ran</h2>" + key_value_table(prov["audit"]) if prov.get("audit") else "",
        "<h2>Backend settings</h2>", key_value_table(settings),
        "<h2>Provenance</h2>",
        key_value_table({k: v for k, v in prov.items() if k not in ("backend_meta", "audit")}),
        "</body></html>",
    ]
    return "\n".join(p for p in parts if p)
