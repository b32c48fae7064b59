"""The bound search (a counted logprob above `MAX_LOGPROB`: probabilities or logits passed) runs once
per array in a report: `build_report` checks its arrays and hands the checked `TokenArrays` on, the
correction's check is the metrics' one (`check_logprob_bound`), and the gold breakdown passes checked
arrays to `drift_by_position`. The same refusals and messages as before; direct callers of the
correction are still checked."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import parity.assess.reporting as reporting
import parity.core.logprobs as logprobs
import parity.correction.apply as apply
import parity.drift.token_arrays as token_arrays_module
from parity.assess.accuracy import gold_by_position
from parity.assess.reporting import build_report
from parity.core.errors import ConfigError, InputError
from parity.core.types import Rollout
from parity.correction import rollout_correction
from parity.drift.metrics import token_arrays
from parity.drift.token_arrays import check_logprob_bound
from parity.drift.tolerance import Tolerance

ROWS, COLS = 6, 12


def _sides(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    rollout = (-rng.exponential(0.5, (ROWS, COLS)) - 0.01).astype(np.float32)
    train = np.minimum(rollout + rng.normal(0, 0.02, rollout.shape), 0).astype(np.float32)
    gold = np.minimum(rollout + rng.normal(0, 0.01, rollout.shape), 0)
    return train, rollout, gold


def _report(train: np.ndarray, rollout: np.ndarray, gold: np.ndarray | None = None, **kw):
    rollouts = [Rollout(f"r{i}", 0, (1, 2), tuple(range(3, 3 + COLS)), tuple(map(float, rollout[i])),
                        "length", "fake") for i in range(ROWS)]
    return build_report(rollouts, list(train), tolerance=Tolerance(),
                        gold_logprobs=None if gold is None else list(gold), **kw)


@pytest.fixture
def searches(monkeypatch) -> dict[str, int]:
    """Counts of the bound searches: every one (`first_above_bound`), the correction's and the
    metrics' tensor checks (`check_logprob_bound`, as each imports it)."""
    counts = {"all": 0, "tensor": 0}
    real = logprobs.first_above_bound

    def counted(values, mask):
        counts["all"] += 1
        return real(values, mask)

    monkeypatch.setattr(logprobs, "first_above_bound", counted)
    monkeypatch.setattr(reporting, "first_above_bound", counted)
    # the correction's name for it and the metrics' own
    for module in (apply, token_arrays_module):
        monkeypatch.setattr(module, "check_logprob_bound", _counting(module.check_logprob_bound, counts))
    return counts


def _counting(real, counts):
    def check(*args):
        counts["tensor"] += 1
        return real(*args)
    return check


# --- 1. the report's correction does not search its checked arrays again -------------------------------

def test_a_report_searches_no_tensor_again(searches) -> None:
    train, rollout, gold = _sides()
    _report(train, rollout)
    assert searches["tensor"] == 0  # was 2: the correction searched both sides again
    _report(train, rollout, gold)
    assert searches["tensor"] == 0  # was 2 + 4: and drift_by_position twice a side on the gold's


def test_the_gold_adds_one_search_per_array_it_reads(searches) -> None:
    train, rollout, gold = _sides()
    _report(train, rollout)
    plain = searches["all"]
    _report(train, rollout, gold)
    # the gold side once (its token mask computed once per report: was once per gold figure, 5) and
    # each side once more for its breakdown: was 7
    assert searches["all"] - 2 * plain == 3


def test_direct_correction_calls_are_still_searched(searches) -> None:
    train, rollout, _ = _sides()
    mask = np.ones(train.shape, bool)
    rollout_correction(train, rollout, mask)
    assert searches["tensor"] == 2
    rollout_correction(token_arrays(train, rollout, mask))  # token_arrays does not search: checked here
    assert searches["tensor"] == 4


@pytest.mark.parametrize("options", [None, {"rollout_is": "sequence", "rollout_is_threshold": 5.0,
                                            "rollout_rs": "token_k1", "rollout_rs_threshold": 3.0}])
def test_the_report_metrics_are_the_correction_s(options) -> None:
    train, rollout, _ = _sides(1)
    train[2, 3] = -np.inf  # outside the support: left out of the metrics, as before
    report = _report(train, rollout, correction=options)
    scored = np.isfinite(train)
    want = rollout_correction(np.where(scored, train, 0), np.where(scored, rollout, 0), scored,
                              **(options or {"rollout_is": "token", "rollout_is_threshold": 2.0}))[2]
    assert report.metrics == want


def test_a_bad_correction_option_is_still_refused() -> None:
    train, rollout, _ = _sides()
    with pytest.raises(ConfigError, match="rollout_is"):
        _report(train, rollout, correction={"rollout_is": "tokens"})


def test_the_report_still_names_the_side_and_rollout() -> None:
    train, rollout, gold = _sides()
    rollout[4, 7] = 0.25
    message = r"rollout_logprobs\[4, 7\] \(rollout 'r4'/0, token 7\) is 0\.25 > 0\.0001"
    with pytest.raises(InputError, match=message):
        _report(train, rollout, gold)


# --- 2. one tensor check: the correction's is the metrics' ---------------------------------------------

def test_the_correction_checks_with_the_metrics_function() -> None:
    assert apply.check_logprob_bound is check_logprob_bound  # was a torch twin of its own


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_same_messages_in_every_dtype(dtype) -> None:
    train, rollout, _ = (torch.from_numpy(a) for a in _sides())
    train = train.to(dtype)
    train[3, 5] = 0.5
    mask = torch.ones(train.shape, dtype=torch.long)
    with pytest.raises(InputError, match=r"^train_logprobs\[3, 5\] is 0\.5 > 0\.0001: looks like probab"):
        rollout_correction(train, rollout.to(dtype), mask, rollout_is="token")


def test_the_tensor_search_finds_the_first_counted_value_row_major() -> None:
    values = torch.full((3, 4), -1.0, dtype=torch.bfloat16)
    mask = torch.ones(3, 4, dtype=torch.bool)
    values[0, 1] = 7.0  # padding may hold anything
    mask[0, 1] = False
    values[2, 0], values[1, 3] = 2.0, 0.75
    with pytest.raises(InputError, match=r"x\[1, 3\] is 0\.75 "):
        check_logprob_bound(values, mask, "x")
    mask[1, 3] = mask[2, 0] = False
    check_logprob_bound(values, mask, "x")  # only padding above the bound
    # the bound in the values' own precision, as NumPy compares a float16 or float32 array: bfloat16's
    # 1e-4 (1.0014e-4) is the bound, allowed (was refused by the metrics, allowed by the correction)
    values[1, 1] = 1e-4
    check_logprob_bound(values, mask, "x")
    check_logprob_bound(torch.tensor([[1e-4]], dtype=torch.float16), torch.ones(1, 1, dtype=torch.bool), "x")


def test_a_nan_does_not_hide_a_counted_value_on_the_device_path() -> None:
    values = torch.full((2, 3), -1.0, dtype=torch.bfloat16)  # bfloat16: NumPy cannot read it
    mask = torch.ones(2, 3, dtype=torch.bool)
    values[0, 0], mask[0, 0] = math.nan, False  # NaN in padding: torch's max is NaN
    values[1, 2] = 3.0
    with pytest.raises(InputError, match=r"y\[1, 2\] is 3\.0"):  # was accepted: the max NaN hid it
        check_logprob_bound(values, mask, "y")


# --- 3. the gold breakdown: checked arrays to drift_by_position, each side named -----------------------

@pytest.mark.parametrize("side", [0, 1])
def test_gold_by_position_names_the_side_above_the_bound(side) -> None:
    arrays = list(_sides())
    arrays[side][2, 4] = 0.6
    name = ("train", "rollout")[side]
    # was "train_logprobs[2, 4]" for either side: the side passed to drift_by_position first
    with pytest.raises(InputError, match=rf"^gold: {name} logprob\[2, 4\] is 0\.6"):
        gold_by_position(*arrays, np.ones((ROWS, COLS), bool))


def test_gold_by_position_is_unchanged_and_searches_no_tensor(searches) -> None:
    train, rollout, gold = _sides(2)
    mask = np.ones((ROWS, COLS), bool)
    mask[1, 6:] = False
    train[1, 8] = 5.0  # padding may hold anything
    rows = gold_by_position(train, rollout, gold, mask)
    assert searches["tensor"] == 0  # was 4: drift_by_position searched each pair again
    from parity.drift.metrics import drift_by_position

    g = np.where(mask, gold, 0.0)
    want = drift_by_position(np.where(mask, rollout.astype(np.float64), 0.0), g, mask)
    assert rows["rollout"] == want and sum(r["num_tokens"] for r in rows["train"]) == int(mask.sum())
