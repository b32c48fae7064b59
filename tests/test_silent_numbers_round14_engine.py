"""Round 14, engine views, assess, the reference backend, the loop page and the nightly loop row:
the trainer's top-k ids broken to the lower id as the engine's; the gold token mask computed once per
report; a NaN logprob beside the other side's -inf refused rather than counted outside the support;
the reference backend's EOS ids the ones its engine stops on; the loop page restoring each row once;
a loop row naming the step of each figure its tolerance judged."""

from __future__ import annotations

import importlib
import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from parity.assess import accuracy, reporting
from parity.core.errors import InputError
from parity.core.types import Request, Rollout
from parity.drift.distribution import trainer_view
from parity.drift.tolerance import Tolerance
from parity.engine.sampler import top_k_rows
from parity.engine.views import device_view

# --- 1. the trainer's top-k ids: ties to the lower id, as the engine's ------------------------------


def _tied_table() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A greedy row (one id finite: every other id ties at -inf) and a row of four tied ids."""
    table = torch.full((2, 1000), -math.inf, dtype=torch.float64)
    table[0, 489] = 0.0
    table[1, [700, 3, 900, 5]] = math.log(0.25)
    return table, torch.tensor([[489, 0, 1], [3, 5, 700]]), torch.tensor([489, 3])


def test_the_trainer_view_breaks_ties_to_the_lower_id_as_the_engine_does() -> None:
    table, engine_ids, sampled = _tied_table()
    view = device_view(table, engine_ids, sampled)
    want = [[489, 0, 1], [3, 5, 700]]
    # was [[489, 1, 0], [700, 5, 3]]: torch.topk's own order, beside the engine's [[489, 0, 1], ...]
    assert view.top_ids.tolist() == want == top_k_rows(table, 3)[0]
    numpy_view = trainer_view(table.numpy(), engine_ids.numpy(), sampled.numpy())
    assert view.top_ids.tolist() == numpy_view.top_ids.tolist()
    assert view.top_ids.dtype == np.int64 and view.top_logprobs.dtype == np.float64
    assert view.top_logprobs[1].tolist() == [math.log(0.25)] * 3


def test_the_trainer_view_of_no_position_and_k_above_the_vocabulary() -> None:
    empty = device_view(torch.zeros((0, 8), dtype=torch.float64), torch.zeros((0, 0), dtype=torch.int64),
                        torch.zeros(0, dtype=torch.int64))
    assert empty.top_ids.shape == (0, 0) and empty.top_logprobs.shape == (0, 0)
    rows = torch.log_softmax(torch.tensor([[1.0, 2.0, 2.0]], dtype=torch.float64), dim=1)
    view = device_view(rows, torch.tensor([[1, 2, 0, 0]]), torch.tensor([2]))
    assert view.top_ids.tolist() == [[1, 2, 0]]  # min(k, V) entries, the tie to the lower id


# --- 2. the gold token mask, computed once per report ----------------------------------------------


def _rollout(i: int, tokens: list[int], logprobs: list[float]) -> Rollout:
    return Rollout(f"r{i}", 0, (1, 2), tuple(tokens), tuple(logprobs), "length", "x")


def test_build_report_computes_the_gold_tokens_once(monkeypatch) -> None:
    rollouts = [_rollout(0, [3, 4, 5], [-1.0, -0.5, -2.0]), _rollout(1, [6, 7], [-0.25, -3.0])]
    train = [np.array([-1.1, -0.5, -2.2]), np.array([-0.3, -2.5])]
    gold = [np.array([-1.05, -0.45, -2.1]), np.array([-0.2, -2.8])]
    want = reporting.build_report(rollouts, train, tolerance=Tolerance(), gold_logprobs=gold)
    calls = []
    real = accuracy.gold_tokens

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(accuracy, "gold_tokens", counted)
    monkeypatch.setattr(reporting, "gold_tokens", counted)
    got = reporting.build_report(rollouts, train, tolerance=Tolerance(), gold_logprobs=gold)
    assert len(calls) == 1  # was 3: the report, then gold_summary and gold_by_position again
    assert got.summary == want.summary and got.breakdowns == want.breakdowns
    assert got.summary["gold/num_tokens"] == 5


# --- 3. a NaN logprob beside the other side's -inf ------------------------------------------------


def test_a_nan_train_logprob_where_the_rollout_gives_minus_inf_is_refused() -> None:
    rollouts = [_rollout(0, [3, 4, 5], [-1.0, -math.inf, -0.5])]
    with pytest.raises(InputError, match=r"train_logprobs\[0, 1\] \(rollout 'r0'/0, token 1\) is nan"):
        # was: accepted, the NaN token counted as 1 outside the support and the rest measured
        reporting.build_report(rollouts, [np.array([-1.1, math.nan, -0.5])], tolerance=Tolerance())


def test_a_nan_rollout_logprob_where_the_trainer_gives_minus_inf_is_refused() -> None:
    rollouts = [_rollout(0, [3, 4], [-1.0, math.nan])]
    with pytest.raises(InputError, match=r"rollout_logprobs contains NaN or \+inf: rollout_logprobs\[0, 1\]"):
        reporting.build_report(rollouts, [np.array([-1.1, -math.inf])], tolerance=Tolerance())


def test_nan_at_an_injected_token_and_minus_inf_still_pass() -> None:
    injected = Rollout("t", 0, (1,), (3, 4, 5), (-1.0, math.nan, -0.5), "length", "x",
                       response_mask=(1, 0, 1))
    report = reporting.build_report([injected], [np.array([-1.0, -2.0, -0.5])], tolerance=Tolerance())
    assert report.summary["num_tokens"] == 2
    outside = reporting.build_report([_rollout(0, [3, 4], [-1.0, -0.5])], [np.array([-1.0, -math.inf])],
                                     tolerance=Tolerance())
    assert outside.summary["num_tokens_outside_support"] == 1


# --- 4. the reference backend's EOS ids: the engine's -----------------------------------------------


def test_the_reference_backend_reports_the_eos_ids_its_engine_stops_on(tmp_path: Path, monkeypatch) -> None:
    from parity.backends import reference
    from parity.models import resolve_model

    model = tmp_path / "m"
    shutil.copytree(resolve_model("tiny-llama"), model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))

    class Engine:  # an engine whose model load_model cached before generation_config.json was edited
        def __init__(self, path: Path, config: object) -> None:
            self.lm = SimpleNamespace(eos_token_ids=(2,))

    monkeypatch.setattr(reference, "ReferenceEngine", Engine)
    backend = reference.ReferenceBackend(model, dtype="float32")
    assert backend.eos_ids == (2,)  # was (7, 8, 2): read again from the file, not what the engine stops on


# --- 5. the loop page restores each row once -------------------------------------------------------


def _loop_document() -> dict:
    steps = [{"step": i, "backend": "vllm", "max_abs_logprob_diff": None, "mean_abs_logprob_diff": 0.01 * i,
              "k3_kl": 1e-4, "weights_in_sync": True, "bitwise": False, "reward_mean": 0.5,
              "policy_kl_from_start": 0.0, "nonfinite": {"max_abs_logprob_diff": "inf"}} for i in range(3)]
    return {"model": "m", "backends": ["vllm"], "train_on": "vllm", "steps": steps}


def test_the_loop_page_restores_each_row_once_and_keeps_its_numbers(monkeypatch) -> None:
    from parity.core.tables import nonfinite_restored
    from parity.render import loop as page

    document = _loop_document()
    summary = page.backend_summary(document["steps"])  # raw rows: restored here
    assert summary["max_abs_logprob_diff"] == math.inf
    assert summary["mean_abs_logprob_diff"] == pytest.approx(0.01)
    calls = []

    def counted(row, where):
        calls.append(where)
        return nonfinite_restored(row, where)

    monkeypatch.setattr(page, "nonfinite_restored", counted)
    monkeypatch.setattr(page, "loop_plots", lambda document: [])
    html = page.loop_page(document)
    assert len(calls) == 3  # was 6: `_by_backend`, then `backend_summary` again (a no-op the second time)
    assert '<td class="bad">inf (3 of 3 steps' in html and '<td class="">0.01</td>' in html


# --- 6. a loop row names the step of each judged figure -------------------------------------------


def _step(i: int, mean: float = 0.001, ratio: float = 1.0, worst: float = 0.5) -> dict:
    return {"step": i, "backend": "vllm", "max_abs_logprob_diff": worst, "mean_abs_logprob_diff": mean,
            "is_ratio_mean": ratio, "k3_kl": 1e-4, "weights_in_sync": True, "bitwise": False,
            "policy_kl_from_start": 0.0, "reward_mean": 0.5}


def _loop_row(monkeypatch, steps: list[dict]):
    from parity.nightly.execute import loop_row
    from parity.nightly.rows import RowKey
    from parity.workload.cases import Case

    record = SimpleNamespace(rows=lambda backend: steps, steps=steps, to_dict=lambda: {})
    monkeypatch.setattr(importlib.import_module("parity.loop"), "loop", lambda *a, **k: record)
    case = Case("loop", "tiny-llama", (Request((3, 4)),), kind="loop", tolerance=Tolerance())
    return loop_row("r", RowKey("loop", "vllm", "bfloat16"), case, None, {}, {}, "cpu")


def test_a_loop_row_shows_the_worst_step_its_violation_names(monkeypatch) -> None:
    row = _loop_row(monkeypatch, [_step(0), _step(1, mean=0.2, ratio=0.9, worst=0.7), _step(2, ratio=1.01)])
    # unchanged: the violations (their stored form) and the row's mean-of-steps figures
    assert row.violations == [{"metric": "mean_abs_logprob_diff", "value": 0.2, "limit": 0.07},
                              {"metric": "is_ratio_mean", "value": 0.9, "limit": 0.06}]
    assert row.summary["mean_abs_logprob_diff"] == pytest.approx(0.202 / 3)
    # was: no figure on the row equal to the violation's 0.2 or 0.9, and no step named
    assert row.summary["loop_worst_step_mean_abs_logprob_diff"] == 0.2
    assert row.summary["loop_worst_step_is_ratio_mean"] == 0.9
    assert row.summary["loop_worst_steps"] == (
        "max_abs_logprob_diff 0.7 at step 1; mean_abs_logprob_diff 0.2 at step 1; k3_kl 0.0001 at step 0; "
        "is_ratio_mean 0.9 at step 1")


def test_a_loop_row_names_its_first_nan_step_and_still_renders(monkeypatch) -> None:
    from parity.nightly.charts import trend_metrics
    from parity.nightly.html_report import _row_section
    from parity.nightly.markdown_report import render_summary

    row = _loop_row(monkeypatch, [_step(0), _step(1, mean=math.nan), _step(2, mean=math.nan)])
    assert math.isnan(row.summary["loop_worst_step_mean_abs_logprob_diff"])
    assert "mean_abs_logprob_diff nan at step 1" in row.summary["loop_worst_steps"]
    assert "loop_worst_step_mean_abs_logprob_diff" in trend_metrics([row.summary])
    assert "loop_worst_steps" not in trend_metrics([row.summary])  # a string: no chart
    assert "mean_abs_logprob_diff" in _row_section(row)
    run = SimpleNamespace(run_id="r", config={})
    assert r"tolerance: mean\_abs\_logprob\_diff = nan" in render_summary(run, [row])
