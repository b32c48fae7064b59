"""Nightly rows judged on numbers that were not theirs (round 10): a loop row whose NaN step vanished
from its worst figures depending on step order, that had no limits without a [tolerance] table, or
whose steps averaged into a pass; a LoRA or tensor-parallel row given the plain engine's audit noise;
two scored dumps that differ only in their response masks, top-k logprobs or routes under one
`case_hash`. No engine starts: rows and rollouts are built by hand.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from parity.core.types import Request, Rollout, SamplingParams
from parity.drift.tolerance import Tolerance
from parity.nightly import execute
from parity.nightly.execute import execute_row, loop_row
from parity.nightly.noise import AUDIT, ENGINE_OPTIONS, backend_noise
from parity.nightly.rows import RowKey, RowResult
from parity.scoring import Source, _rollouts_hash
from parity.workload.cases import Case

MODEL = "tiny-llama"
NAN = math.nan


# --- 1-3. loop rows: NaN steps, default limits, the worst step judged ----------------------------


def _step(i: int, worst: float = 0.5, mean: float = 0.001, ratio: float = 1.0, k3: float = 1e-4) -> dict:
    return {"step": i, "backend": "vllm", "max_abs_logprob_diff": worst, "mean_abs_logprob_diff": mean,
            "is_ratio_mean": ratio, "k3_kl": k3, "weights_in_sync": True, "bitwise": False,
            "policy_kl_from_start": 0.0, "reward_mean": 0.5}


def _loop_row(monkeypatch: pytest.MonkeyPatch, steps: list[dict],
              tolerance: Tolerance | None = None) -> RowResult:
    record = SimpleNamespace(rows=lambda backend: steps, steps=steps, to_dict=lambda: {})
    monkeypatch.setattr(importlib.import_module("parity.loop"), "loop", lambda *a, **k: record)
    case = Case("loop", MODEL, (Request((3, 4)),), kind="loop", tolerance=tolerance)
    return loop_row("r", RowKey("loop", "vllm", "bfloat16"), case, None, {}, {}, "cpu")


@pytest.mark.parametrize("order", [0, 1])
def test_a_nan_loop_step_fails_the_row_in_either_order(monkeypatch, order) -> None:
    steps = [_step(0, worst=1.0, k3=1e-3), _step(1, worst=NAN, k3=NAN)]
    row = _loop_row(monkeypatch, steps if order == 0 else steps[::-1], Tolerance())
    # was: NaN first -> fail, NaN second -> pass with max |dlogp| 1.0 and k3 1e-3 (Python's max)
    assert math.isnan(row.summary["max_abs_logprob_diff"]) and math.isnan(row.summary["k3_kl"])
    assert row.status == "fail"
    assert {v["metric"] for v in row.violations} == {"max_abs_logprob_diff", "k3_kl"}


def test_a_loop_case_without_a_tolerance_table_gets_the_row_defaults(monkeypatch) -> None:
    row = _loop_row(monkeypatch, [_step(0, worst=50.0, mean=3.0, k3=2.0)])
    # was: "pass" with no violation at all; bf16 defaults are 6 / 0.07 / 0.02, as a compare row gets
    assert row.status == "fail"
    assert {(v["metric"], v["limit"]) for v in row.violations} == {
        ("max_abs_logprob_diff", 6.0), ("mean_abs_logprob_diff", 0.07), ("k3_kl", 0.02)}


def test_a_loop_reference_row_without_a_table_is_held_to_exact_equality(monkeypatch) -> None:
    steps = [{**_step(0, worst=0.0, mean=0.0, k3=0.0), "backend": "reference", "bitwise": True}]
    record = SimpleNamespace(rows=lambda backend: steps, steps=steps, to_dict=lambda: {})
    monkeypatch.setattr(importlib.import_module("parity.loop"), "loop", lambda *a, **k: record)
    case = Case("loop", MODEL, (Request((3, 4)),), kind="loop")
    row = loop_row("r", RowKey("loop", "reference", "float32"), case, None, {}, {}, "cpu")
    assert row.status == "pass", row.violations  # bitwise steps still pass


def test_loop_steps_either_side_of_one_do_not_average_into_a_pass(monkeypatch) -> None:
    row = _loop_row(monkeypatch, [_step(0, ratio=1.2), _step(1, ratio=0.8)], Tolerance())
    assert row.summary["is_ratio_mean"] == pytest.approx(1.0)  # the figure shown stays the mean step
    assert row.status == "fail"  # was "pass": |1.0 - 1| <= 0.06, yet each step is 0.2 away
    assert row.violations == [{"metric": "is_ratio_mean", "value": 1.2, "limit": 0.06}]
    nan = _loop_row(monkeypatch, [_step(0, ratio=1.5), _step(1, ratio=NAN)], Tolerance())
    assert [v["metric"] for v in nan.violations] == ["is_ratio_mean"]
    assert math.isnan(nan.violations[0]["value"])


def test_the_loop_tolerance_judges_the_worst_step_mean(monkeypatch) -> None:
    row = _loop_row(monkeypatch, [_step(0, mean=0.2), _step(1), _step(2)], Tolerance())
    assert row.summary["mean_abs_logprob_diff"] == pytest.approx(0.202 / 3)  # shown: the mean step
    # was "pass": the mean of step means (0.067) under 0.07 hid a step at 0.2
    assert row.status == "fail"
    assert row.violations == [{"metric": "mean_abs_logprob_diff", "value": 0.2, "limit": 0.07}]
    good = _loop_row(monkeypatch, [_step(0), _step(1, ratio=1.01)], Tolerance())
    assert good.status == "pass" and good.violations == []


# --- 4. audit noise only for the engine it measured ---------------------------------------------


REPEAT = {"skipped": None, "identical": False, "mean_abs_logprob_diff": 0.05, "max_abs_logprob_diff": 0.3,
          "differing_requests": 3, "requests": 4}


def _ran(monkeypatch: pytest.MonkeyPatch, key: RowKey, case: Case) -> RowResult:
    """`execute_row` with the engine and the case's work faked: the row keeps the provenance it got."""
    def fake(run_id: str, key: RowKey, case: Case, options: dict, provenance: dict[str, Any],
             **kwargs: Any) -> RowResult:
        extra = {"kind": AUDIT, AUDIT: {"checks": {"repeat": REPEAT}}} if case.kind == AUDIT else {}
        return RowResult(run_id, key, "pass", provenance={**provenance, **extra})
    monkeypatch.setattr(execute, "_run_row", fake)
    return execute_row("r", key, case, reference="invariant")


def test_a_lora_row_is_not_judged_by_the_plain_engines_audit_noise(monkeypatch) -> None:
    prompts = (Request((3, 4, 5)),)
    audit = _ran(monkeypatch, RowKey("audit", "vllm", "bfloat16"), Case("audit", MODEL, prompts, kind=AUDIT))
    plain = _ran(monkeypatch, RowKey("plain", "vllm", "bfloat16"), Case("plain", MODEL, prompts))
    lora = _ran(monkeypatch, RowKey("lora", "vllm", "bfloat16"),
                Case("lora", MODEL, prompts, lora="tiny-llama-lora-r8"))
    assert lora.provenance[ENGINE_OPTIONS] == {"lora": "tiny-llama-lora-r8"}
    assert backend_noise([audit], plain) is not None  # the plain engine's rows keep their noise
    # was: the plain engine's repeat noise (0.05 nats) judged the adapter engine's row
    assert backend_noise([audit], lora) is None


def test_a_lora_row_does_not_wait_for_an_audit_that_will_not_judge_it(monkeypatch) -> None:
    from parity.nightly.runner import waits_for_audit

    prompts = (Request((3, 4, 5)),)
    audit_key, audit_case = RowKey("audit", "vllm", "bfloat16"), Case("audit", MODEL, prompts, kind=AUDIT)
    plain_case = Case("plain", MODEL, prompts)
    lora_case = Case("lora", MODEL, prompts, lora="tiny-llama-lora-r8")
    plain = _ran(monkeypatch, RowKey("plain", "vllm", "bfloat16"), plain_case)
    lora = _ran(monkeypatch, RowKey("lora", "vllm", "bfloat16"), lora_case)
    cases = {plain.key: plain_case, lora.key: lora_case, audit_key: audit_case}
    assert waits_for_audit(plain, cases, {audit_key: audit_case})
    # was: held until the plain engine's audit finished, whose noise (above) no longer judges it
    assert not waits_for_audit(lora, cases, {audit_key: audit_case})


def test_a_tensor_parallel_reference_row_is_not_judged_by_the_single_process_audit(monkeypatch) -> None:
    prompts = (Request((3, 4, 5)),)
    audit = _ran(monkeypatch, RowKey("audit", "reference", "float32"),
                 Case("audit", MODEL, prompts, kind=AUDIT))
    tp = _ran(monkeypatch, RowKey("tp", "reference", "float32"),
              Case("tp", MODEL, prompts, reference_tensor_parallel_size=2))
    assert tp.provenance[ENGINE_OPTIONS] == {"tensor_parallel_size": 2}
    assert backend_noise([audit], tp) is None


# --- 5. the scored rollouts' hash ---------------------------------------------------------------


def _rollout(**changes: Any) -> Rollout:
    base = dict(request_id="a", sample_index=0, prompt_ids=(3, 4), token_ids=(5, 6), logprobs=(-0.5, -1.25),
                finish_reason="stop", backend="vllm", sampling=SamplingParams(seed=7))
    return Rollout(**{**base, **changes})


def _hash(*rollouts: Rollout) -> str:
    return _rollouts_hash(Source(Path("d.jsonl"), "dump", rollouts))


def test_rollouts_without_the_new_fields_hash_as_before() -> None:
    # the value the hash had before masks, top-k logprobs and routes entered it
    old = _hash(_rollout(), _rollout(sample_index=1, sampling=None, logprobs_mode="raw"))
    assert old == "82851b77c9ba9dcc"
    assert _hash(_rollout(response_mask=(1, 1))) == _hash(_rollout()) == "39c099bca7acd96f"  # all generated


def test_dumps_differing_only_in_mask_top_k_or_routes_hash_apart() -> None:
    # each pair hashed as one before
    assert _hash(_rollout(response_mask=(1, 0))) != _hash(_rollout())

    def top_k(second: float) -> Rollout:
        return _rollout(top_k_ids=np.array([[5, 9], [6, 8]]),
                        top_k_logprobs=np.array([[-0.5, second], [-1.25, -2.0]]))
    assert len({_hash(top_k(-1.0)), _hash(top_k(-1.1)), _hash(_rollout())}) == 3

    def routes(expert: int) -> Rollout:
        return _rollout(routed_experts=np.array([[[0, 1]], [[2, 3]], [[1, expert]]]))
    assert len({_hash(routes(2)), _hash(routes(3)), _hash(_rollout())}) == 3


def test_of_two_audits_of_one_engine_the_noise_does_not_depend_on_which_finished_first(monkeypatch) -> None:
    prompts = (Request((3, 4, 5)),)
    key = RowKey("b-audit", "vllm", "bfloat16")
    first = _ran(monkeypatch, RowKey("a-audit", "vllm", "bfloat16"),
                 Case("a-audit", MODEL, prompts, kind=AUDIT))
    quiet = {AUDIT: {"checks": {"repeat": {**REPEAT, "mean_abs_logprob_diff": 0.001}}}}
    second = _ran(monkeypatch, key, Case("b-audit", MODEL, prompts, kind=AUDIT))
    second = RowResult("r", key, "pass", provenance={**second.provenance, **quiet})
    plain = _ran(monkeypatch, RowKey("plain", "vllm", "bfloat16"), Case("plain", MODEL, prompts))
    # was: 0.05 or 0.001 nats by the order the (parallel) executor stored the two audit rows
    assert backend_noise([first, second], plain) == backend_noise([second, first], plain)
    assert backend_noise([second, first], plain).source == "a-audit / vllm / bfloat16"
