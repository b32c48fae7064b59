"""Round 7, tolerances and drift inputs: numbers that were silently wrong.

- A case's partial `[tolerance]` table filled the limits it does not name with the bfloat16
  defaults whatever the row's dtype: a float32 case that set only `k3_kl_max` was judged at a mean
  |Δ| limit of 0.07 (float32's is 1e-5), and its reference rows at 6.0 nats instead of exactly.
- `router_agreement` took a route row naming an expert twice ([3, 3] of a top-2):
  two such rows read as agreement 1.0, and {3, 5} vs {3, 5} as [3, 5, 5] vs [3, 3, 5] read as 0.0.
  Sequences of different [moe_layers, top_k], or ragged rows, died in NumPy (a ValueError).
- `summarize`, `bootstrap_ci` and the `drift_by_*` breakdowns called with arrays took
  probabilities for logprobs (a plausible k3 of 0.003, every token in the 0.99-1 bucket).
- `drift_by_turn` broadcast a `[seq]` turns row over every sequence, and dropped float turns.
"""

from __future__ import annotations

import importlib
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import parity.drift.token_arrays as token_arrays_module
from parity.compare import _given_tolerance
from parity.core.errors import InputError
from parity.drift.metrics import (
    bootstrap_ci,
    drift_by_position,
    drift_by_probability,
    drift_by_turn,
    summarize,
)
from parity.drift.routes import check_routes, router_agreement, same_choice
from parity.drift.token_arrays import token_arrays
from parity.drift.tolerance import DEFAULTS, Tolerance
from parity.workload.cases import load_case

ROOT = Path(__file__).resolve().parent.parent

CASE = """
    model = "tiny-llama"
    dtypes = ["float32"]
    [prompts]
    token_ids = [[3, 4, 5], [6, 7]]
    [tolerance]
    k3_kl_max = 1e-9
    [tolerance.hf]
    max_abs_logprob_diff = 0.001
"""


def _case(tmp_path: Path, body: str = CASE, name: str = "partial.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return load_case(path)


# --- 1. a partial [tolerance] table: the rest are the row's dtype defaults -------------------------


def test_partial_table_fills_the_rest_from_the_rows_dtype(tmp_path: Path) -> None:
    case = _case(tmp_path)
    f32 = DEFAULTS["float32"]
    vllm = Tolerance.resolve(_given_tolerance(None, case.tolerance_for("vllm")), "vllm", "float32")
    assert vllm.k3_kl_max == 1e-9  # the case's own
    assert vllm.mean_abs_logprob_diff == f32["mean_abs_logprob_diff"] == 1e-5  # was bf16's 0.07
    assert vllm.max_abs_logprob_diff == f32["max_abs_logprob_diff"]
    assert vllm.is_ratio_mean_tol == f32["is_ratio_mean_tol"]
    hf = Tolerance.resolve(case.tolerance_for("hf"), "hf", "float32")
    assert (hf.max_abs_logprob_diff, hf.k3_kl_max) == (0.001, 1e-9)
    assert hf.mean_abs_logprob_diff == f32["mean_abs_logprob_diff"]
    # the same limits a case without a [tolerance] table gets, apart from those it names
    assert {**Tolerance.for_backend("vllm", "float32").to_dict(), "k3_kl_max": 1e-9} == vllm.to_dict()


def test_partial_table_keeps_the_reference_exact(tmp_path: Path) -> None:
    ref = Tolerance.resolve(_case(tmp_path).tolerance_for("reference"), "reference", "float32")
    assert ref == Tolerance(**{**Tolerance.exact().to_dict(), "k3_kl_max": 1e-9})  # was 6.0 nats max


def test_partial_table_follows_the_dtype_picked_at_run_time(tmp_path: Path) -> None:
    limits = _case(tmp_path).tolerance_for("vllm")
    for dtype in ("bfloat16", "float16", "float32"):  # --dtype, or a dtypes list's row
        got = Tolerance.resolve(limits, "vllm", dtype)
        assert got.mean_abs_logprob_diff == DEFAULTS[dtype]["mean_abs_logprob_diff"]
        assert got.k3_kl_max == 1e-9
    # a float32 trainer against bf16 rollouts is judged as bf16 drifts (`pair_dtype`)
    mixed = Tolerance.resolve(limits, "vllm", "float32", "bfloat16")
    assert mixed.mean_abs_logprob_diff == DEFAULTS["bfloat16"]["mean_abs_logprob_diff"]


def test_a_tolerance_dict_over_a_partial_case_stays_partial(tmp_path: Path) -> None:
    given = _given_tolerance({"is_ratio_mean_tol": 1e-6}, _case(tmp_path).tolerance_for("vllm"))
    limits = Tolerance.resolve(given, "vllm", "float32")
    assert (limits.is_ratio_mean_tol, limits.k3_kl_max) == (1e-6, 1e-9)
    assert limits.mean_abs_logprob_diff == 1e-5  # was bf16's 0.07


def test_a_case_tolerance_still_equals_the_tolerance_of_its_values(tmp_path: Path) -> None:
    case = _case(tmp_path)
    assert case.tolerance == Tolerance(k3_kl_max=1e-9)  # the public Case/Tolerance API is unchanged
    assert isinstance(case.tolerance, Tolerance)
    assert case.tolerance.to_dict() == Tolerance(k3_kl_max=1e-9).to_dict()
    assert hash(case.tolerance) == hash(Tolerance(k3_kl_max=1e-9))
    full = Tolerance(mean_abs_logprob_diff=0.5)  # a Tolerance built in Python is used as given
    assert Tolerance.resolve(full, "vllm", "float32") is full


def test_a_nightly_loop_row_judges_a_partial_table_at_its_dtype(tmp_path: Path, monkeypatch) -> None:
    from parity.nightly.execute import loop_row
    from parity.nightly.rows import RowKey

    body = (ROOT / "cases" / "loop.toml").read_text() + "\n[tolerance]\nk3_kl_max = 0.5\n"
    case = _case(tmp_path, body, "loop.toml")
    step = {"step": 0, "backend": "vllm", "max_abs_logprob_diff": 0.001, "mean_abs_logprob_diff": 0.001,
            "is_ratio_mean": 1.0, "k3_kl": 1e-7, "weights_in_sync": True, "bitwise": False,
            "policy_kl_from_start": 0.0, "reward_mean": 0.5}
    record = SimpleNamespace(rows=lambda backend: [step], steps=[step], to_dict=lambda: {})
    # `parity.loop` the attribute is the function; loop_row imports it from the module
    monkeypatch.setattr(importlib.import_module("parity.loop"), "loop", lambda *a, **k: record)
    row = loop_row("r", RowKey(case.name, "vllm", "float32"), case, None, {}, {}, "cpu")
    # float32's mean limit is 1e-5; bf16's 0.07 passed the row
    assert row.status == "fail"
    assert {v["metric"] for v in row.violations} >= {"mean_abs_logprob_diff"}


# --- 2. routes naming an expert twice -----------------------------------------------------------


def test_router_agreement_refuses_a_repeated_expert() -> None:
    good = np.array([[[1, 2]], [[0, 3]]], np.int32)
    bad = np.array([[[1, 2]], [[3, 3]]], np.int32)
    with pytest.raises(InputError, match=r"reference\[0\]: position 1, MoE layer 0 .*once.*\[3, 3\]"):
        router_agreement([bad], [bad])  # was agreement 1.0
    with pytest.raises(InputError, match=r"other\[1\]: position 1, MoE layer 0"):
        router_agreement([good, good], [good, bad])


def test_agreement_refuses_a_repeated_expert_instead_of_a_multiset_compare() -> None:
    a, b = np.array([[[3, 5, 5]]]), np.array([[[3, 3, 5]]])  # the same set {3, 5}: was agreement 0.0
    with pytest.raises(InputError, match=r"reference\[0\]: position 0, MoE layer 0"):
        router_agreement([a], [b])
    with pytest.raises(InputError, match=r"mine: position 0"):
        same_choice(np.array([[[1, 3, 5]]]), b, ("theirs", "mine"))
    assert same_choice(np.array([[[5, 3, 1]]]), np.array([[[1, 3, 5]]])).tolist() == [[True]]
    # without names, rows are only compared: an audit asks whether two runs returned the same rows
    assert same_choice(b, b).tolist() == [[True]] and same_choice(a, b).tolist() == [[False]]


def test_router_agreement_refuses_sequences_of_different_layers() -> None:
    one = np.tile(np.array([0, 1], np.int32), (2, 1, 1))
    two = np.tile(np.array([0, 1], np.int32), (2, 2, 1))
    with pytest.raises(InputError, match=r"reference\[1\] has shape \(2, 2, 2\).*\[moe_layers, top_k\]"):
        router_agreement([one, two], [one, two])  # was NumPy's ValueError from concatenate


def test_ragged_routes_are_an_input_error() -> None:
    with pytest.raises(InputError, match=r"other\[0\] is not a rectangular \[positions, moe_layers, top_k\]"):
        router_agreement([[[[0, 1]], [[2, 3]]]], [[[[0, 1]], [[2]]]])  # was NumPy's ValueError


def test_check_routes_message_is_unchanged() -> None:
    with pytest.raises(InputError, match=r"r: position 0, MoE layer 1 names expert\(s\) more than once"):
        check_routes([[[0, 1], [2, 2]]], positions=1, moe_layers=2, top_k=2, num_experts=4, where="r")


# --- 3. probabilities passed as logprobs to the metrics -----------------------------------------


PROBS = np.array([[-0.1, -0.5, -0.2], [-0.3, 0.6, -2.0]])
ROLL = np.full((2, 3), -0.4)
MASK = np.ones((2, 3), bool)


@pytest.mark.parametrize("call", [
    lambda t, r, m: summarize(t, r, m),
    lambda t, r, m: bootstrap_ci(t, r, m, n_resamples=5),
    lambda t, r, m: drift_by_position(t, r, m),
    lambda t, r, m: drift_by_probability(t, r, m),
    lambda t, r, m: drift_by_turn(t, r, m, turns=np.zeros(m.shape, int),
                                  after_injection=np.zeros(m.shape, bool)),
], ids=["summarize", "bootstrap_ci", "by_position", "by_probability", "by_turn"])
def test_the_metrics_refuse_a_positive_logprob(call) -> None:
    with pytest.raises(InputError, match=r"train_logprobs\[1, 1\] is 0.6 > 0.0001: looks like probabilities"):
        call(PROBS, ROLL, MASK)
    with pytest.raises(InputError, match=r"rollout_logprobs\[1, 1\] is 0.6"):
        call(ROLL, PROBS, MASK)
    call(PROBS, ROLL, MASK & (PROBS <= 0))  # padding may hold anything
    call(torch.tensor(PROBS).clamp(max=0), torch.tensor(ROLL), torch.tensor(MASK))


def test_a_bf16_tensor_is_checked_too() -> None:
    with pytest.raises(InputError, match=r"rollout_logprobs\[1, 1\] is 0.6"):
        summarize(torch.tensor(ROLL, dtype=torch.bfloat16), torch.tensor(PROBS, dtype=torch.bfloat16), MASK)


def test_a_checked_token_arrays_is_not_searched_again(monkeypatch) -> None:
    calls = []
    real = token_arrays_module.check_logprob_array
    monkeypatch.setattr(token_arrays_module, "check_logprob_array", lambda *a: calls.append(1) or real(*a))
    tok = token_arrays(PROBS.clip(max=0), ROLL, MASK)  # build_report's path: checked upstream, once
    summarize(tok)
    drift_by_position(tok)
    assert calls == []
    summarize(PROBS.clip(max=0), ROLL, MASK)
    assert len(calls) == 2  # one search per side


# --- 4. drift_by_turn's per-token inputs --------------------------------------------------------


def test_drift_by_turn_refuses_turns_of_another_shape() -> None:
    train = np.array([[-0.1, -0.1, -0.1], [-1.0, -1.0, -1.0]])
    zero = np.zeros((2, 3))
    with pytest.raises(InputError, match=r"turns has shape \(3,\); it must be \[batch, seq\] \(2, 3\)"):
        drift_by_turn(train, zero, MASK, turns=np.array([0, 0, 1]), after_injection=np.zeros((2, 3), bool))
    with pytest.raises(InputError, match=r"after_injection has shape \(1, 3\)"):
        drift_by_turn(train, zero, MASK, turns=np.zeros((2, 3), int), after_injection=np.zeros((1, 3), bool))
    with pytest.raises(InputError, match=r"turns must hold integer turn indices"):
        drift_by_turn(train, zero, MASK, turns=np.array([[0, 0, 0.7], [0, 1, 1]]),
                      after_injection=np.zeros((2, 3), bool))
    out = drift_by_turn(train, zero, MASK, turns=np.array([[0, 0, 1], [0, 1, 1]]),
                        after_injection=np.zeros((2, 3), bool))
    assert [r["num_tokens"] for r in out["by_turn"]] == [3, 3]
