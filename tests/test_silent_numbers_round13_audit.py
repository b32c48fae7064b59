"""Round 13: an audit's batch-invariance verdict reads the same on its page as in its text (the checks
beside it that differ, which of its checks ran), and the nightly holds parity's reference engine to
its documented claim of identical on every check (no engine starts)."""

from __future__ import annotations

import importlib
import re
from types import SimpleNamespace

from test_silent_numbers_round12_gold import make_check, make_result

from parity.audit import AuditResult, CheckResult
from parity.audit.result import RESULT_KEYS
from parity.render.audit import audit_html

MODEL = "tiny-llama"
ONE_REQUEST = CheckResult.skip("one request: there is no other order")


def _badges(result: AuditResult) -> list[tuple[str, str]]:
    return re.findall(r'<span class="verdict (\w+)">([^<]*)</span>', audit_html(result.to_dict()))


def test_the_page_badge_names_a_differing_check_beside_the_verdict_as_the_text_does():
    result = make_result(prefill_decode=make_check(False, 3))
    # old: the badge read a bare "batch-invariant: yes" while the text said what the yes covers
    assert ("yes", "batch-invariant: yes (batch and order; prefill_decode differs)") in _badges(result)
    assert "batch-invariant yes (batch and order; prefill_decode differs);" in result.summary_text()
    no = make_result(batch=make_check(False, 1), prefix_cache=make_check(False, 2))
    assert ("no", "batch-invariant: no (batch and order; prefix_cache differs)") in _badges(no)
    assert "batch-invariant NO (batch and order; prefix_cache differs);" in no.summary_text()
    assert ("yes", "batch-invariant: yes") in _badges(make_result())  # nothing beside it differs: bare yes


def test_a_skipped_order_beside_an_identical_batch_says_what_ran():
    result = make_result(order=ONE_REQUEST)
    first = result.summary_text().splitlines()[0]
    # old: a bare "not checked", as if the batch check had not run either
    assert "batch-invariant partly checked (batch identical, order not checked);" in first
    assert ("unchecked", "batch-invariant: partly checked (batch identical, order not checked)") \
        in _badges(result)
    both = make_result(order=ONE_REQUEST, prefill_decode=make_check(False, 1))
    assert "partly checked (batch identical, order not checked; prefill_decode differs);" \
        in both.summary_text()
    # the stored keys and verdicts are as before
    d = result.to_dict()
    assert tuple(d) == RESULT_KEYS and d["batch_invariant"] is False
    assert not result.measured("batch_invariant")
    assert AuditResult.from_json(result.to_json()).to_dict() == d


def test_nothing_ran_still_reads_not_checked():
    skipped = CheckResult.skip("not asked for (checks=...)")
    result = make_result(batch=skipped, order=skipped)
    assert "batch-invariant not checked;" in result.summary_text()
    assert ("unchecked", "batch-invariant: not checked") in _badges(result)


def _row(monkeypatch, result: AuditResult, name: str, invariant: bool = True):
    from parity.nightly.noise import audit_row
    from parity.nightly.rows import RowKey

    monkeypatch.setattr(importlib.import_module("parity.audit"), "audit", lambda *a, **k: result)
    return audit_row("r1", RowKey("noise", name, "float32"), SimpleNamespace(model=MODEL),
                     SimpleNamespace(name=name, meta={"batch_invariant": invariant}), {}, {})


def test_the_reference_engine_fails_a_nightly_audit_on_a_differing_prefill_decode(monkeypatch):
    row = _row(monkeypatch, make_result(prefill_decode=make_check(False, 3)), "reference")
    # old: pass; docs/DESIGN.md says the reference is identical on every check
    assert row.status == "fail"
    [violation] = row.violations
    assert "prefill_decode" in violation["metric"] and violation["value"] == 3.0
    cache = _row(monkeypatch, make_result(prefix_cache=make_check(False, 2)), "reference")
    assert cache.status == "fail" and "prefix_cache" in cache.violations[0]["metric"]


def test_only_the_invariant_reference_is_held_to_every_check(monkeypatch):
    beside = make_result(prefill_decode=make_check(False, 3))
    assert _row(monkeypatch, beside, "vllm").status == "pass"  # its claim is batch and order
    assert _row(monkeypatch, beside, "reference", invariant=False).status == "pass"  # stock kernels
    no_cache = make_result(prefix_cache=CheckResult.skip("the backend has no prefix cache"))
    assert _row(monkeypatch, no_cache, "reference").status == "pass"
