"""One scan of a batch's blocks for several metrics (`TokenArrays.scan`, the monitor's step record):
the same numbers, bit for bit, as each metric alone; the blocks' shared arrays never written; the
worst tokens exact, ties included."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import batches

import parity.drift.token_arrays as token_arrays_module
from parity.correction import rollout_correction
from parity.correction.config import CorrectionConfig
from parity.drift.metrics import drift_by_position, summarize
from parity.drift.token_arrays import Block, token_arrays
from parity.monitor.summary import WorstPass, step_record, worst_tokens

TIS = CorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)


@given(batches(), st.sampled_from([1, 16, 1 << 16]))
def test_one_scan_gives_each_metric_s_own_numbers(data, block_tokens):
    """The step record's summary, `rollout_corr/*` and drift by position are exactly what
    `summarize`, `rollout_correction` and `drift_by_position` give alone: blocks of one row, of a
    few rows, of the whole batch; drifts beyond the ±20 clamp included (`batches` draws σ = 30)."""
    train, rollout, mask = data
    with mock.patch.object(token_arrays_module, "BLOCK_TOKENS", block_tokens):
        record = step_record(token_arrays(train, rollout, mask), correction=TIS, responses=None, advice=False)
        assert record["summary"] == summarize(train, rollout, mask)
        assert record["rollout_corr"] == rollout_correction(train, rollout, mask, rollout_is="token",
                                                            rollout_is_threshold=2.0)[2]
        assert record["by_position"] == drift_by_position(train, rollout, mask)
    assert record["worst_tokens"] == _worst_by_sorting(train, rollout, mask)


class _Check:
    """A pass that checks each block's shared arrays against a fresh computation."""

    def __init__(self) -> None:
        self.checked = 0

    def add(self, b: Block) -> None:
        fresh = Block(b.rows, b.train, b.rollout, b.log_ratio, b.mask, b.dense)
        for name in ("abs_log_ratio", "row_abs_max", "row_log_ratio_sum", "clamped", "abs_clamped",
                     "exp_clamped", "ratio", "exp_log_ratio", "maskf"):
            assert torch.equal(getattr(b, name), getattr(fresh, name)), name
        assert torch.equal(b.log_ratio, b.train - b.rollout)
        self.checked += 1


class _Rogue:
    """A pass that breaks the rule: it writes into a shared array."""

    def add(self, b: Block) -> None:
        b.abs_log_ratio.mul_(2.0)


def test_no_pass_writes_into_a_block_s_shared_arrays():
    """Scanned with every pass of the step record, each block's shared arrays still hold what
    they were computed as; the negative control (a pass that writes into one) is caught."""
    from parity.correction.apply import CorrectionPass
    from parity.drift.metrics import PositionPass, SummaryPass

    rng = np.random.default_rng(0)
    rollout = -rng.exponential(2.0, (300, 64))
    train = rollout + rng.normal(0.0, 0.5, rollout.shape)
    train[3, 5] = rollout[3, 5] + 25.0  # one block beyond the clamp
    mask = np.arange(64)[None, :] < rng.integers(1, 65, 300)[:, None]
    mask[:100] = True  # dense blocks too
    tok = token_arrays(train, rollout, mask)
    options = {"rollout_is": "token", "rollout_rs": "token_k3", "rollout_rs_threshold": 0.5}
    check = _Check()
    with mock.patch.object(token_arrays_module, "BLOCK_TOKENS", 64 * 50):
        tok.scan(SummaryPass(tok), CorrectionPass(CorrectionConfig(**options), tok), PositionPass(tok),
                 WorstPass(tok), check)
        assert check.checked == 6
        try:
            tok.scan(_Rogue(), _Check())
        except AssertionError as exc:
            assert "abs_log_ratio" in str(exc)
        else:
            raise AssertionError("the rogue pass's write went unnoticed")


def _worst_by_sorting(train: np.ndarray, rollout: np.ndarray, mask: np.ndarray, k: int = 10) -> list[dict]:
    """The k valid tokens of largest |Δ| > 0, ties by row then position, by sorting every token."""
    t, r = torch.as_tensor(train), torch.as_tensor(rollout)
    drift = np.where(mask, np.abs(t.double().numpy() - r.double().numpy()), 0.0).reshape(-1)
    flat = np.arange(drift.size)
    order = np.lexsort((flat, -drift))
    seq = mask.shape[1]
    return [{"row": int(i) // seq, "position": int(i) % seq, "token_id": None,
             "trainer_logprob": float(t.reshape(-1)[i]), "rollout_logprob": float(r.reshape(-1)[i]),
             "logprob_diff": float(t.reshape(-1)[i]) - float(r.reshape(-1)[i])}
            for i in order[:k] if drift[i] > 0]


@given(st.integers(0, 2**32 - 1), st.integers(1, 40), st.integers(1, 30),
       st.sampled_from(["ties", "one row", "mostly equal", "spread"]))
def test_worst_tokens_are_exact_with_ties_and_few_rows(seed, batch, seq, kind):
    """The worst tokens looked for in the rows of largest row maximum only are those of a sort of
    every token: drifts from a few values (many ties, every row a candidate), rows fewer than k,
    most tokens identical."""
    rng = np.random.default_rng(seed)
    shape = (batch, seq)
    rollout = -rng.integers(1, 80, shape) / 8.0  # eighths: every drift below is exact, ties tie
    drift = {"ties": rng.choice([0.0, 0.125, 0.25], shape),
             "one row": np.where(np.arange(batch)[:, None] == 0, 0.375, 0.0) * np.ones(shape),
             "mostly equal": np.where(rng.random(shape) < 0.9, 0.0, rng.choice([0.5, -0.5], shape)),
             "spread": rng.normal(0.0, 1.0, shape)}[kind]
    train = rollout + drift
    mask = rng.random(shape) < 0.8
    mask[0, 0] = True
    tok = token_arrays(train, rollout, mask)
    assert worst_tokens(tok, None) == _worst_by_sorting(train, rollout, mask)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")
def test_the_step_record_of_cuda_tensors_is_the_cpu_one():
    """CUDA tensors take the device paths (torch counts, device buffers, host copies for the tail
    quantiles and the worst tokens): the same record as on CPU, to the float rounding of CUDA's
    exp and reductions; the counts, extremes and worst tokens exactly."""
    rng = np.random.default_rng(0)
    rollout = np.log(rng.uniform(1e-6, 1.0, (1024, 256)))
    train = np.minimum(rollout + rng.normal(0.0, 0.05, rollout.shape), 0.0)
    train[5, 7] = rollout[5, 7] + 25.0  # beyond the clamp
    mask = np.arange(256)[None, :] < rng.integers(1, 257, 1024)[:, None]
    cpu = step_record(token_arrays(train, rollout, mask), correction=TIS, responses=None, advice=False)
    gpu = step_record(token_arrays(*(torch.from_numpy(x).cuda() for x in (train, rollout, mask))),
                      correction=TIS, responses=None, advice=False)
    assert gpu["worst_tokens"] == cpu["worst_tokens"]
    for part in ("summary", "rollout_corr"):
        assert gpu[part].keys() == cpu[part].keys()
        for key, value in cpu[part].items():
            assert gpu[part][key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    for key in ("max_abs_logprob_diff", "is_ratio_min", "is_ratio_max", "num_tokens", "num_sequences",
                "frac_tokens_ratio_gt_2"):
        assert gpu["summary"][key] == cpu["summary"][key], key
