"""Round 17: the nightly loop row (`parity.nightly.execute.loop_row`) judges what `parity loop` judges,
and runs the sampling its case asks for."""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

import pytest

from parity.core.errors import ConfigError
from parity.core.types import Request, SamplingParams
from parity.nightly.execute import loop_row
from parity.nightly.rows import RowKey, RowResult
from parity.workload.cases import Case

MODEL = "tiny-llama"


def _step(i: int, backend: str = "reference") -> dict[str, Any]:
    return {"step": i, "backend": backend, "max_abs_logprob_diff": 0.0, "mean_abs_logprob_diff": 0.0,
            "is_ratio_mean": 1.0, "k3_kl": 0.0, "weights_in_sync": True, "bitwise": True,
            "policy_kl_from_start": 0.0, "reward_mean": 0.5}


def _row(monkeypatch: pytest.MonkeyPatch, steps: list[dict], updates: list[dict],
         case: Case | None = None, seen: dict | None = None) -> RowResult:
    record = SimpleNamespace(rows=lambda backend: [r for r in steps if r["backend"] == backend], steps=steps,
                             updates=updates, to_dict=lambda: {"steps": steps, "updates": updates})

    def fake(*args: Any, **kwargs: Any) -> SimpleNamespace:
        (seen if seen is not None else {}).update(kwargs)
        return record
    monkeypatch.setattr(importlib.import_module("parity.loop"), "loop", fake)
    case = case or Case("loop", MODEL, (Request((3, 4)),), kind="loop")
    return loop_row("r", RowKey("loop", "reference", "float32"), case, None, {}, {}, "cpu")


# --- 1. an update's forward_bitwise ----------------------------------------------------------------


def test_an_update_whose_training_forward_was_not_bitwise_fails_the_row(monkeypatch) -> None:
    updates = [{"step": 0, "forward_bitwise": True}, {"step": 1, "forward_bitwise": False},
               {"step": 2, "forward_bitwise": False}]
    row = _row(monkeypatch, [_step(0), _step(1), _step(2)], updates)
    # was: "pass" with no violation, while `parity loop` on the same record exits 1
    assert row.status == "fail"
    assert row.violations == [{"metric": "loop training forward not bitwise at steps [1, 2]", "value": 2.0,
                               "limit": 0.0}]
    assert row.provenance["loop"]["updates"] == updates


def test_bitwise_updates_keep_the_row_passing(monkeypatch) -> None:
    row = _row(monkeypatch, [_step(0), _step(1)], [{"step": 0, "forward_bitwise": True},
                                                   {"step": 1, "forward_bitwise": True}])
    assert row.status == "pass" and row.violations == []


# --- 2. sampling the loop would not do --------------------------------------------------------------


@pytest.mark.parametrize("first, second, field", [
    (SamplingParams(top_p=0.5), SamplingParams(top_p=0.5), "top_p"),
    (SamplingParams(top_k=5), SamplingParams(), "top_k"),
    (SamplingParams(), SamplingParams(max_tokens=64), "max_tokens"),
    (SamplingParams(n=4), SamplingParams(n=2), "n"),
    (SamplingParams(), SamplingParams(temperature=0.7), "temperature"),
    (SamplingParams(), SamplingParams(stop_token_ids=(2,)), "stop_token_ids"),
])
def test_a_loop_case_asking_for_sampling_the_loop_does_not_do_is_refused(monkeypatch, first, second,
                                                                          field) -> None:
    case = Case("loop", MODEL, (Request((3, 4), request_id="a", sampling=first),
                                Request((5, 6), request_id="b", sampling=second)), kind="loop")
    seen: dict = {}
    # was: the loop ran with the first request's n, temperature and max_tokens alone (top_p, top_k,
    # stops and the second request's settings dropped) and the row passed
    with pytest.raises(ConfigError, match=f"sets sampling {field} = "):
        _row(monkeypatch, [_step(0)], [], case, seen)
    assert seen == {}  # refused before the loop ran


def test_loop_sampling_differing_only_in_seed_or_top_k_logprobs_runs(monkeypatch) -> None:
    same = dict(n=2, temperature=0.8, max_tokens=8)
    requests = (Request((3, 4), request_id="a", sampling=SamplingParams(seed=7, **same)),
                Request((5, 6), request_id="b", sampling=SamplingParams(seed=9, top_k_logprobs=3, **same)))
    case = Case("loop", MODEL, requests, kind="loop")
    seen: dict = {}
    row = _row(monkeypatch, [_step(0)], [{"step": 0, "forward_bitwise": True}], case, seen)
    assert row.status == "pass"
    assert {k: seen[k] for k in ("seed", "n", "temperature", "max_tokens")} == {"seed": 7, **same}


# --- 3. the tolerance's ratio > 2 share -------------------------------------------------------------


def test_a_loop_step_row_measures_the_share_of_tokens_with_ratio_beyond_2() -> None:
    import torch

    from parity.core.types import Rollout
    from parity.loop.record import STEP_EXTRA_KEYS
    from parity.loop.run import _row
    from parity.loop.sync import SyncCheck

    rollout = Rollout("a", 0, (3, 4), (5, 6, 7, 8), (0.0, -1.0, -0.1, -0.2), "length", "vllm")
    check = SyncCheck(in_sync=True, checked=3, hidden=0, mismatched=(), mismatches=0, seconds=0.0)
    row = _row(0, "vllm", [rollout], [torch.zeros(4)], [1.0], check, False)
    # was: no such key, so the loop row had nothing to judge the limit on; one token in 4 has ratio e
    assert row["frac_tokens_ratio_gt_2"] == pytest.approx(0.25)
    assert "frac_tokens_ratio_gt_2" in STEP_EXTRA_KEYS


def test_the_loop_row_judges_the_worst_steps_ratio_beyond_2_share(monkeypatch) -> None:
    from parity.drift.tolerance import Tolerance

    steps = [{**_step(0), "frac_tokens_ratio_gt_2": 0.0}, {**_step(1), "frac_tokens_ratio_gt_2": 0.05}]
    tolerance = Tolerance(max_abs_logprob_diff=None)
    case = Case("loop", MODEL, (Request((3, 4)),), kind="loop", tolerance=tolerance)
    row = _row(monkeypatch, steps, [], case)
    # was: "pass": the case's frac_tokens_ratio_gt_2_max (0.01 here) was never applied to a loop row
    assert row.status == "fail"
    assert row.violations == [{"metric": "frac_tokens_ratio_gt_2", "value": 0.05, "limit": 0.01}]
    assert row.summary["frac_tokens_ratio_gt_2"] == 0.05
    assert "frac_tokens_ratio_gt_2 0.05 at step 1" in row.summary["loop_worst_steps"]
