"""Round 7, the monitor's full-distribution path (`parity.monitor.top_k`): the trainer's top-k rows
must be log_softmax values of the processing of the step's old_log_probs, else refused with a named
`InputError` (not a made-up KL); valid trainer rows (bfloat16, a second forward pass) still pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import parity
from parity.core.errors import InputError
from parity.monitor import MonitorStore, train_top_k

BATCH, WIDTH, VOCAB, K = 4, 12, 50, 8


def case(temperature: float = 1.0, seed: int = 0) -> dict:
    """Logits, the rollout's processed rows at `temperature`, tokens sampled there, their top-k."""
    gen = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(BATCH, WIDTH, VOCAB, generator=gen)
    rows = torch.log_softmax(logits / temperature, dim=-1)
    responses = torch.multinomial(rows.exp().reshape(-1, VOCAB), 1, generator=gen).reshape(BATCH, WIDTH)
    top_lp, top_ids = torch.topk(rows, K, dim=-1)
    return {"logits": logits, "rows": rows, "responses": responses, "top": (top_ids, top_lp),
            "mask": torch.ones(BATCH, WIDTH, dtype=torch.bool),
            "lp": rows.gather(-1, responses[..., None])[..., 0]}


def log(tmp_path, c: dict, train_rows: torch.Tensor, old: torch.Tensor | None = None) -> dict:
    with parity.Monitor(tmp_path, render_every=0, advice_every=0) as monitor:
        return monitor.log(0, rollout_log_probs=c["lp"], old_log_probs=c["lp"] if old is None else old,
                           response_mask=c["mask"], responses=c["responses"], rollout_top_k=c["top"],
                           train_top_k=train_top_k(train_rows, c["top"][0], c["responses"], c["mask"]))


def test_trainer_rows_at_temperature_1_beside_rollouts_at_0_7_are_refused_not_a_made_up_kl(tmp_path):
    c = case(temperature=0.7)
    raw = torch.log_softmax(c["logits"], dim=-1)  # the trainer forgot the rollout's temperature
    with pytest.raises(InputError, match=r"train_top_k was not computed under the processing.*temperature"):
        log(tmp_path, c, raw)  # old code: accepted, kl_train_engine_mean 0.126 nats of pure processing
    assert MonitorStore.open(tmp_path).steps() == []


@pytest.mark.parametrize("variant", ["bfloat16", "second-pass", "real-drift"])
def test_valid_trainer_rows_are_still_accepted(tmp_path, variant):
    c = case(temperature=0.7)
    rows, old = c["rows"], None
    if variant == "bfloat16":  # trainer rows and its sampled logprobs both in bfloat16
        rows = rows.to(torch.bfloat16)
        old = rows.gather(-1, c["responses"][..., None])[..., 0]
    elif variant == "second-pass":  # the rows from another forward pass than old_log_probs
        gen = torch.Generator().manual_seed(5)
        noise = 2e-3 * torch.randn(c["logits"].shape, generator=gen)
        rows = torch.log_softmax((c["logits"] + noise) / 0.7, -1)
    else:  # a real train/rollout drift: old_log_probs from the trainer's own rows
        gen = torch.Generator().manual_seed(6)
        noise = 0.3 * torch.randn(c["logits"].shape, generator=gen)
        rows = torch.log_softmax((c["logits"] + noise) / 0.7, -1)
        old = rows.gather(-1, c["responses"][..., None])[..., 0]
    summary = log(tmp_path, c, rows, old)["summary"]
    assert np.isfinite(summary["distribution/kl_train_engine_mean"])


def test_bfloat16_trainer_rows_equal_to_the_rollout_give_exactly_zero(tmp_path):
    # lead: the trainer's tail mass 1 - sum(top-k) is taken in float64 of the bf16 values as given,
    # so parity adds no rounding of its own (guard; passed before this round too)
    c = case(temperature=0.7)
    rows = c["rows"].to(torch.bfloat16)
    top_lp, top_ids = torch.topk(rows, K, dim=-1)
    c["top"], c["lp"] = (top_ids, top_lp), rows.gather(-1, c["responses"][..., None])[..., 0]
    summary = log(tmp_path, c, rows)["summary"]
    for key in ("kl_train_engine_max", "kl_engine_train_max", "tv_max"):
        assert summary[f"distribution/{key}"] == 0.0


def test_a_nan_in_the_trainer_rows_is_refused_not_counted_as_agreement(tmp_path):
    c = case()
    rows = c["rows"].clone()
    rows[0, 0, c["top"][0][0, 0, 3]] = float("nan")
    with pytest.raises(InputError, match="train_top_k holds NaN at counted token 0"):
        log(tmp_path, c, rows)  # old code: KL means 0.0, the NaN position counted as "infinite KL"


def test_trainer_rows_that_are_not_log_softmax_are_refused(tmp_path):
    c = case()
    rows = c["rows"].clone()
    rows[0, 0, c["top"][0][0, 0, 5]] = 3.0  # a logprob above 0
    with pytest.raises(InputError, match=r"above 0\.0001 at counted token 0"):
        log(tmp_path, c, rows)  # old code: kl_train_engine_max 128, tv_max 10.1 (a TV above 1)
    shifted = c["rows"].clone()
    shifted[1, 2] = torch.clamp(shifted[1, 2] + np.log(1.5), max=0.0)  # every value <= 0, mass ~1.5x
    with pytest.raises(InputError, match="summing above 1"):
        log(tmp_path, c, shifted, old=c["lp"])
