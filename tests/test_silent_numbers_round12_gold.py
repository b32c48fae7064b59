"""Round 12: the automatic gold forward beside the trainer's own logprobs, and what the audit's
batch-invariance verdict covers and says when it was not measured (reference / built-in tiny models;
no engine starts)."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest

import parity
from parity.audit import CHECKS, AuditResult, CheckResult
from parity.core.errors import InputError
from parity.core.types import Rollout, SamplingParams

MODEL = "tiny-llama"


def _rollout(mode: str = "processed", sampling: SamplingParams | None = None) -> Rollout:
    return Rollout(request_id="a", sample_index=0, prompt_ids=(1, 2, 3), token_ids=(4, 5, 6),
                   logprobs=(-1.0, -2.0, -0.5), backend="x", logprobs_mode=mode, finish_reason="length",
                   sampling=sampling)


TRAINER = [[-1.0, -2.0, -0.5]]


# -- the automatic gold with the trainer's logprobs --------------------------------------------------


def test_automatic_gold_steps_aside_for_processed_rollouts_without_sampling():
    # old: InputError "pass temperature=..." although the trainer side needs no sampling
    report = parity.score([_rollout()], MODEL, trainer_logprobs=TRAINER)
    assert report.summary["max_abs_logprob_diff"] == 0.0
    how = report.extras["gold"]
    assert how["ran"] is False and "records no sampling" in how["reason"] and "--temperature" in how["reason"]
    assert "gold/verdict" not in report.summary


def test_an_explicit_gold_is_still_refused_with_both_fixes():
    with pytest.raises(InputError, match=r"gold=True.*records no sampling.*--temperature.*--no-gold"):
        parity.score([_rollout()], MODEL, trainer_logprobs=TRAINER, gold=True)


def test_the_automatic_gold_still_runs_where_it_can():
    raw = parity.score([_rollout("raw")], MODEL, trainer_logprobs=TRAINER)
    sampled = parity.score([_rollout(sampling=SamplingParams(temperature=1.0))], MODEL,
                           trainer_logprobs=TRAINER)
    assert raw.extras["gold"]["ran"] and sampled.extras["gold"]["ran"]
    assert "gold/verdict" in raw.summary and "gold/verdict" in sampled.summary


# -- the audit's verdicts ------------------------------------------------------------------------------


def make_check(identical: bool = True, differing: int = 0) -> CheckResult:
    return CheckResult(identical=identical, requests=4, differing_requests=differing, first_difference=None,
                       max_abs_logprob_diff=0.0 if identical else 0.1, mean_abs_logprob_diff=0.0)


def make_result(**given: CheckResult) -> AuditResult:
    checks = {name: given.get(name, make_check()) for name in CHECKS}
    checks["seed"] = given.get("seed", make_check(False, 4))  # the control passes
    return AuditResult(backend="fake", model=MODEL, dtype="float32", provenance={}, checks=checks)


def test_a_yes_beside_a_differing_prefill_decode_says_what_it_covers():
    result = make_result(prefill_decode=make_check(False, 3))
    first = result.summary_text().splitlines()[0]
    assert result.batch_invariant and result.to_dict()["batch_invariant"] is True  # the stored key as before
    assert "batch-invariant yes (batch and order; prefill_decode differs)" in first
    both = make_result(prefill_decode=make_check(False, 3), prefix_cache=make_check(False, 1)).summary_text()
    assert "(batch and order; prefill_decode and prefix_cache differ)" in both.splitlines()[0]
    assert "batch-invariant yes;" in make_result().summary_text().splitlines()[0]


def test_measured_tells_not_checked_from_no():
    skipped = CheckResult.skip("not asked for (checks=...)")
    assert not make_result(batch=skipped, order=skipped).measured("batch_invariant")
    one_request = CheckResult.skip("one request: there is no other order")
    assert not make_result(order=one_request).measured("batch_invariant")
    # a NO needs no more
    assert make_result(batch=make_check(False, 2), order=skipped).measured("batch_invariant")
    assert make_result().measured("batch_invariant") and make_result().measured("deterministic")


def _command_exit(monkeypatch, result: AuditResult) -> int:
    command = importlib.import_module("parity.audit.command")
    monkeypatch.setattr(command, "audit", lambda *a, **k: result)
    return command.main(["--model", MODEL, "--backend", "reference", "--checks", "repeat,seed"])


def test_the_command_fails_nothing_it_did_not_measure(monkeypatch, capsys):
    skipped = CheckResult.skip("not asked for (checks=...)")
    # old: exit 1 ("not batch-invariant") for batch-invariance nobody measured
    assert _command_exit(monkeypatch, make_result(batch=skipped, order=skipped)) == 0
    assert "batch-invariant not checked" in capsys.readouterr().out
    assert _command_exit(monkeypatch, make_result(batch=make_check(False, 1), order=skipped)) == 1
    assert _command_exit(monkeypatch, make_result(repeat=make_check(False, 1))) == 1
    assert _command_exit(monkeypatch, make_result(seed=make_check(True))) == 1  # the control failed


def test_a_nightly_audit_row_leaves_out_a_verdict_it_did_not_measure(monkeypatch):
    from parity.nightly.noise import audit_row
    from parity.nightly.rows import RowKey

    skipped = CheckResult.skip("one request: there is no other order")
    monkeypatch.setattr(importlib.import_module("parity.audit"), "audit",
                        lambda *a, **k: make_result(order=skipped))
    row = audit_row("r1", RowKey("noise", "reference", "float32"), SimpleNamespace(model=MODEL),
                    SimpleNamespace(meta={"batch_invariant": True}), {}, {})
    # old: audit_batch_invariant 0.0, a "no" on the trend chart for what was not measured
    assert "audit_batch_invariant" not in row.summary and row.summary["audit_deterministic"] == 1.0
    assert row.status == "pass"
