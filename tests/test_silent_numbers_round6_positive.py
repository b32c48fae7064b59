"""Positive "logprobs" (probabilities, logits or sign-flipped logprobs) at counted tokens are refused
by the correction, the report and the advisor as by the monitor and scoring: every number from
them would be wrong. Padding may hold anything; -inf (outside the support) stays allowed; values
up to `MAX_LOGPROB` (log(1) rounded) stay accepted."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from parity.advisor import advise
from parity.assess.reporting import build_report
from parity.core.errors import InputError
from parity.core.logprobs import MAX_LOGPROB, check_logprob_array
from parity.core.types import Rollout
from parity.correction import CorrectionConfig, apply_correction, rollout_correction
from parity.drift.metrics import token_arrays
from parity.drift.tolerance import Tolerance


def _sides(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    rollout = -rng.exponential(1.0, (3, 6)).astype(np.float32) - 0.1
    train = (rollout + rng.normal(0, 0.05, rollout.shape)).astype(np.float32)
    return np.minimum(train, 0), rollout, np.ones(rollout.shape, bool)


# -- the correction -------------------------------------------------------------------------------

@pytest.mark.parametrize("side", ["train_logprobs", "rollout_logprobs"])
def test_the_correction_refuses_a_counted_positive_logprob_naming_side_and_position(side) -> None:
    train, rollout, mask = _sides()
    (train if side == "train_logprobs" else rollout)[1, 4] = 0.7  # a probability, not a logprob
    message = rf"{side}\[1, 4\] is 0\.7 > 0\.0001: .*not logprobs.*pass the log-prob"
    with pytest.raises(InputError, match=message):
        rollout_correction(train, rollout, mask, rollout_is="token")  # was accepted: weights from e^Δ
    with pytest.raises(InputError, match=rf"{side}\[1, 4\]"):
        apply_correction(CorrectionConfig(rollout_is="sequence"), train, rollout, mask, metrics_only=True)
    with pytest.raises(InputError, match=rf"{side}\[1, 4\]"):  # a checked TokenArrays too
        rollout_correction(token_arrays(train, rollout, mask))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_the_correction_refuses_positive_tensors(dtype) -> None:
    train, rollout, mask = (torch.from_numpy(a) for a in _sides())
    train = train.to(dtype)
    train[2, 0] = 3.0  # a logit
    with pytest.raises(InputError, match=r"train_logprobs\[2, 0\] is 3\.0"):
        rollout_correction(train, rollout.to(dtype), mask.long(), rollout_is="token")


def test_the_correction_ignores_padding_keeps_minus_inf_there_and_the_rounding_allowance() -> None:
    train, rollout, mask = _sides()
    want = rollout_correction(train, rollout, mask, rollout_is="token")
    mask[0, 5] = mask[2, 1] = False
    padded_train, padded_rollout = train.copy(), rollout.copy()
    padded_train[0, 5], padded_rollout[2, 1] = 5.0, -np.inf  # padding may hold anything
    clean_train, clean_rollout = train.copy(), rollout.copy()
    clean_train[0, 5] = clean_rollout[2, 1] = -1.0
    got = rollout_correction(padded_train, padded_rollout, mask, rollout_is="token")
    same = rollout_correction(clean_train, clean_rollout, mask, rollout_is="token")
    np.testing.assert_array_equal(got[0], same[0])
    assert got[2] == same[2]
    train[1, 1] = rollout[1, 1] = np.float32(MAX_LOGPROB)  # log(1) rounded up: still a logprob
    rollout_correction(train, rollout, np.ones_like(mask), rollout_is="token")
    assert want[2]  # the unpadded batch ran


# -- the report -------------------------------------------------------------------------------------

def _rollouts(logprobs: list[list[float]],
              masks: list[tuple[int, ...] | None] | None = None) -> list[Rollout]:
    masks = masks or [None] * len(logprobs)
    return [Rollout(f"r{i}", 0, (1, 2), tuple(range(3, 3 + len(lp))), tuple(lp), "length", "fake",
                    response_mask=m) for i, (lp, m) in enumerate(zip(logprobs, masks))]


def test_build_report_refuses_positive_train_or_rollout_logprobs_naming_the_rollout() -> None:
    rollouts = _rollouts([[-0.5, -1.0, -0.2], [-0.3, -2.0]])
    train = [np.array([-0.5, -1.1, -0.25]), np.array([-0.3, 0.9])]  # 0.9: a probability
    with pytest.raises(InputError, match=r"train_logprobs\[1, 1\] \(rollout 'r1'/0, token 1\) is 0\.9"):
        build_report(rollouts, train, tolerance=Tolerance())
    train[1][1] = -2.1
    bad = _rollouts([[-0.5, -1.0, 0.6], [-0.3, -2.0]])
    with pytest.raises(InputError, match=r"rollout_logprobs\[0, 2\] \(rollout 'r0'/0, token 2\)"):
        build_report(bad, train, tolerance=Tolerance())


def test_build_report_ignores_injected_tokens_and_counts_minus_inf_apart() -> None:
    rollouts = _rollouts([[-0.5, 0.0, -0.2, -1.0], [-0.3, -2.0]], [(1, 0, 1, 1), None])
    train = [np.array([-0.5, 7.0, -np.inf, -1.1]), np.array([-0.3, -2.1])]  # 7.0 at an injected token
    report = build_report(rollouts, train, tolerance=Tolerance())
    assert report.summary["num_tokens_outside_support"] == 1
    assert report.summary["num_tokens"] == 4


# -- the advisor ------------------------------------------------------------------------------------

def test_advise_refuses_positive_arrays_even_with_nan_at_padding() -> None:
    train, rollout, mask = (a.astype(np.float64) for a in _sides())
    rollout[0, 3] = 0.4
    with pytest.raises(InputError, match=r"advise: rollout_logprobs\[0, 3\] is 0\.4"):
        advise(train, rollout, mask)
    rollout[0, 3] = -0.4
    train[2, 2], train[0, 0], mask[0, 0] = 2.5, np.nan, False  # NaN padding hid the max
    with pytest.raises(InputError, match=r"advise: train_logprobs\[2, 2\] is 2\.5"):
        advise(train, rollout, mask)
    train[2, 2], train[1, 0], mask[1, 0] = -2.5, 9.0, False  # positive padding: ignored
    assert advise(train, rollout, mask).name


def test_the_shared_check_is_not_blinded_by_nan_padding() -> None:
    values = np.array([[np.nan, -0.1, 0.5]])
    with pytest.raises(InputError, match=r"lp\[0, 2\] is 0\.5"):
        check_logprob_array(values, np.array([[False, True, True]]), "lp")
    check_logprob_array(np.array([[np.nan, -0.1, -math.inf]]), np.array([[False, True, False]]), "lp")
