"""No silent wrong numbers, round 8 (the vLLM server's start flags, the gold figures, hand-built
`TokenArrays`): each input below was read into a number nobody meant, with no word, on the old code:
probabilities passed as the train or rollout side of `gold_summary` (a verdict on them); a gold mask
of 0.5 or 2 counted as a whole token; a `TokenArrays` built by hand read as checked (a positive
logprob, a NaN, a wrong total); a `vllm serve` flag parity sets, spelled as vLLM's parser also reads
it (`--dty float16`, `--logprobs_mode`), passed on to the server. No engine starts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from parity.assess.accuracy import gold_by_position, gold_summary, gold_tokens
from parity.backends.vllm_server import VLLMServerBackend, split_server_args
from parity.core.errors import ConfigError, InputError
from parity.correction import rollout_correction
from parity.drift.metrics import drift_by_position, summarize
from parity.drift.token_arrays import TokenArrays, token_arrays

TRAIN = np.array([[-0.1, -0.3, -0.2], [-0.4, -0.5, -0.6]])
ROLLOUT = np.array([[-0.2, -0.3, -0.25], [-0.45, -0.5, -0.7]])
GOLD = np.array([[-0.15, -0.31, -0.22], [-0.42, -0.5, -0.65]])
MASK = np.ones((2, 3), bool)


# --- 1. gold_summary's train and rollout sides ----------------------------------------------------


@pytest.mark.parametrize("side", ["train", "rollout"])
def test_gold_summary_refuses_a_side_above_the_bound(side: str) -> None:
    train, rollout = TRAIN.copy(), ROLLOUT.copy()
    (train if side == "train" else rollout)[1, 2] = 0.5  # a probability: the old code gave a verdict
    with pytest.raises(InputError, match=rf"gold: {side} logprob\[1, 2\] is 0.5 > 0.0001: looks like"):
        gold_summary(train, rollout, GOLD, MASK, bootstrap=0)
    with pytest.raises(InputError, match=rf"gold: {side} logprob\[1, 2\] is 0.5"):
        gold_by_position(train, rollout, GOLD, MASK)  # the breakdown already refused it


def test_gold_summary_keeps_its_numbers_and_rounding_above_zero() -> None:
    got = gold_summary(TRAIN, ROLLOUT, GOLD, MASK, bootstrap=0)
    assert got["gold/train_mean_abs_logprob_diff"] == pytest.approx(np.abs(TRAIN - GOLD).mean())
    assert got["gold/rollout_max_abs_logprob_diff"] == pytest.approx(np.abs(ROLLOUT - GOLD).max())
    train = TRAIN.astype(np.float32)
    train[0, 0], rollout = 5e-5, ROLLOUT.copy()  # log(1) rounded a hair above 0: a logprob
    rollout[0, 1] = 7.0  # padding may hold anything
    mask = MASK.copy()
    mask[0, 1] = False
    assert gold_summary(train, rollout, GOLD, mask, bootstrap=0)["gold/num_tokens"] == 5


# --- 2. the gold's mask -----------------------------------------------------------------------------


@pytest.mark.parametrize("mask", [np.array([[0.5, 1, 1], [1, 1, 1]]), np.array([[2, 1, 1], [1, 1, 0]]),
                                  np.array([[1.0, np.nan, 1.0], [1.0, 1.0, 1.0]])])
def test_a_gold_mask_other_than_0_and_1_is_refused(mask: np.ndarray) -> None:
    # the old code counted 0.5 and 2 as whole tokens (num_tokens 6 and 5), NaN as one too
    with pytest.raises(InputError, match="gold: mask must be bool or hold only 0 and 1"):
        gold_summary(TRAIN, ROLLOUT, GOLD, mask, bootstrap=0)


def test_a_gold_mask_of_0s_and_1s_in_any_dtype_counts_alike() -> None:
    mask = np.array([[1, 0, 1], [1, 1, 1]])
    want = gold_tokens(TRAIN, ROLLOUT, GOLD, mask.astype(bool))
    for m in (mask, mask.astype(np.float32), mask.astype(np.uint8)):
        assert np.array_equal(gold_tokens(TRAIN, ROLLOUT, GOLD, m), want)
    assert gold_summary(TRAIN, ROLLOUT, GOLD, mask.astype(np.float64), bootstrap=0)["gold/num_tokens"] == 5


# --- 3. a TokenArrays built by hand -----------------------------------------------------------------


def _by_hand(train: np.ndarray, rollout: np.ndarray, mask: np.ndarray, total: float | None = None,
             mask_as: torch.dtype = torch.bool) -> TokenArrays:
    t, r, m = (torch.from_numpy(np.ascontiguousarray(a)) for a in (train, rollout, mask))
    lengths = m.sum(-1).double()
    return TokenArrays(t, r, m.to(mask_as), lengths, float(lengths.sum()) if total is None else total,
                       t.dtype, False, torch.bool)


def test_a_hand_built_token_arrays_with_a_positive_logprob_is_refused() -> None:
    train = TRAIN.copy()
    train[0, 1] = 0.7  # the old code: mean |Δ| 0.38 from it, with no word
    with pytest.raises(InputError, match=r"train_logprobs\[0, 1\] is 0.7 > 0.0001"):
        summarize(_by_hand(train, ROLLOUT, MASK))
    with pytest.raises(InputError, match=r"train_logprobs\[0, 1\] is 0.7"):
        drift_by_position(_by_hand(train, ROLLOUT, MASK))


def test_a_hand_built_token_arrays_with_nan_is_refused() -> None:
    rollout = ROLLOUT.copy()
    rollout[1, 1] = np.nan  # the old code: a summary of NaNs
    for run in (summarize, rollout_correction):
        with pytest.raises(InputError, match="rollout_logprobs contains NaN or"):
            run(_by_hand(TRAIN, rollout, MASK))


def test_a_hand_built_token_arrays_counts_its_own_tokens() -> None:
    want = summarize(TRAIN, ROLLOUT, MASK)
    mask = MASK.copy()
    assert summarize(_by_hand(TRAIN, ROLLOUT, mask, total=12.0)) == want  # the old code: a ValueError
    assert summarize(_by_hand(TRAIN, ROLLOUT, mask, mask_as=torch.float64)) == want
    mask[1, 2] = False
    lengths_wrong = _by_hand(TRAIN, ROLLOUT, mask)
    object.__setattr__(lengths_wrong, "lengths", torch.tensor([3.0, 3.0]))
    assert summarize(lengths_wrong) == summarize(TRAIN, ROLLOUT, mask)


def test_a_checked_token_arrays_is_returned_as_is_and_containers_are_kept() -> None:
    tok = token_arrays(TRAIN, ROLLOUT, MASK)
    assert token_arrays(tok) is tok
    t, r = (torch.from_numpy(a) for a in (TRAIN, ROLLOUT))
    by_hand = TokenArrays(t, r, torch.from_numpy(MASK), torch.tensor([3.0, 3.0]), 6.0, t.dtype, True,
                          np.dtype(bool))
    checked = token_arrays(by_hand)
    assert checked is not by_hand and checked.numpy and checked.mask_dtype == np.dtype(bool)
    weights, keep, _ = rollout_correction(by_hand, rollout_is="token")
    assert isinstance(weights, np.ndarray) and keep.dtype == bool


# --- 4. vLLM server flags in the spellings vLLM's parser reads --------------------------------------


@pytest.mark.parametrize("args, flag", [
    ("--dty float16", "--dtype"),  # argparse takes a unique prefix for the flag
    ("--logprobs_mode raw_logprobs", "--logprobs-mode"),  # and underscores for dashes
    ("--max_logprobs=5", "--max-logprobs"),
    ("--see 3", "--seed"),
    ("--po=8001", "--port"),
    ("--enforce-eager --logprobs-m raw_logprobs", "--logprobs-mode"),
])
def test_server_args_refuse_what_parity_sets_in_every_spelling(args: str, flag: str) -> None:
    with pytest.raises(ConfigError, match=f"server_args may not contain {flag} .spelled"):
        split_server_args(args)


def test_server_args_spelled_otherwise_refused_before_the_server_starts(monkeypatch) -> None:
    def start(*args: object, **kwargs: object) -> None:
        raise AssertionError("a vLLM server was started")

    monkeypatch.setattr(VLLMServerBackend, "_start", start)
    with pytest.raises(ConfigError, match="may not contain --dtype"):
        VLLMServerBackend("tiny-llama", server_args=["--dty", "float16"])
    with pytest.raises(ConfigError, match="api_key_env"):
        split_server_args("--api_key sk-1")


def test_server_args_parity_does_not_set_pass_in_any_spelling() -> None:
    words = "--model-impl vllm --max-num-seqs 8 --enable_prefix_caching --max-model-len=256 -tp 1 --seed-x"
    assert split_server_args(words) == tuple(words.split())
    assert split_server_args(["--served-model-name", "float16", "--", "-O3"])[1:] == ("float16", "--", "-O3")
