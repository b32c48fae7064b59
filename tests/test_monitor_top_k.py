"""`Monitor.log(..., rollout_top_k=, train_top_k=)`: the full-distribution drift of a step (the
rollout's top-k against the trainer's rows, `parity.monitor.top_k`) in the record, the history and
the page, equal to `parity.drift.distribution` run directly; exactly 0 for identical sides; each
malformed input a named error that stores nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import parity
from parity.core.errors import InputError
from parity.core.schema import DISTRIBUTION_SUMMARY_KEYS
from parity.core.top_k import TopKError
from parity.drift.distribution import position_drift, summarize_distribution, trainer_view
from parity.monitor import MonitorStore, flat_values, train_top_k

BATCH, WIDTH, VOCAB, K = 6, 10, 50, 8


class Tokenizer:
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


def step(seed: int, drift: float) -> dict:
    """Trainer rows [batch, width, vocab] (log_softmax), the rollout's (the trainer's plus `drift`
    of noise in the logits), tokens sampled from the rollout, a right-padded mask."""
    gen = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(BATCH, WIDTH, VOCAB, generator=gen)
    train = torch.log_softmax(logits, dim=-1)
    rollout = torch.log_softmax(logits + drift * torch.randn(BATCH, WIDTH, VOCAB, generator=gen), dim=-1)
    responses = torch.multinomial(rollout.exp().reshape(-1, VOCAB), 1, generator=gen).reshape(BATCH, WIDTH)
    lengths = torch.randint(1, WIDTH + 1, (BATCH,), generator=gen)
    mask = torch.arange(WIDTH)[None, :] < lengths[:, None]
    top_lp, top_ids = torch.topk(rollout, K, dim=-1)
    return {"train": train, "responses": responses, "mask": mask, "top": (top_ids, top_lp),
            "rollout_lp": rollout.gather(-1, responses[..., None])[..., 0],
            "train_lp": train.gather(-1, responses[..., None])[..., 0]}


def log(monitor: parity.Monitor, n: int, s: dict, **changes):
    kwargs = dict(rollout_log_probs=s["rollout_lp"], old_log_probs=s["train_lp"], response_mask=s["mask"],
                  responses=s["responses"], rollout_top_k=s["top"],
                  train_top_k=train_top_k(s["train"], s["top"][0], s["responses"], s["mask"]))
    kwargs.update(changes)
    return monitor.log(n, **kwargs)


@pytest.mark.parametrize("dense", [False, True], ids=["padded", "every-slot-counts"])
def test_a_step_s_distribution_keys_are_the_distribution_metrics_of_its_counted_positions(tmp_path, dense):
    s = step(0, 0.3)
    if dense:
        s["mask"] = torch.ones_like(s["mask"])
    with parity.Monitor(tmp_path, render_every=1, advice_every=0, tokenizer=Tokenizer()) as monitor:
        record = log(monitor, 0, s)
    m = s["mask"].numpy()
    rows = s["train"].double().numpy()[m]
    ids, lps = s["top"][0].numpy()[m], s["top"][1].numpy()[m]
    view = trainer_view(rows, ids, s["responses"].numpy()[m])
    direct = summarize_distribution(position_drift(lps, view), K)
    got = {k: record["summary"][k] for k in DISTRIBUTION_SUMMARY_KEYS}
    assert got == pytest.approx(direct, rel=1e-12, abs=1e-15, nan_ok=True)
    assert got["distribution/kl_train_engine_mean"] > 0
    worst = record["distribution"]["worst"]
    assert len(worst) == 10 and worst[0]["kl_train_engine"] == direct["distribution/kl_train_engine_max"]
    assert worst[0]["rollout"]["text"][0] == f"<{worst[0]['rollout']['ids'][0]}>"
    (saved,) = MonitorStore.open(tmp_path).steps()
    assert flat_values(saved)["distribution/tv_mean"] == got["distribution/tv_mean"]
    page = (tmp_path / "index.html").read_text()
    assert "Worst positions, full distribution" in page and "distribution/kl_train_engine_mean" in page


def test_identical_sides_give_exactly_zero_and_a_drift_does_not(tmp_path):
    same = step(1, 0.0)
    with parity.Monitor(tmp_path, render_every=0, advice_every=0) as monitor:
        zero = log(monitor, 0, same)["summary"]
        moved = log(monitor, 1, step(1, 1e-3))["summary"]  # negative control
    for key in ("kl_train_engine", "kl_engine_train", "tv"):
        assert zero[f"distribution/{key}_max"] == 0.0
        assert moved[f"distribution/{key}_max"] > 0.0
    assert zero["distribution/top_k_overlap"] == 1.0 and zero["distribution/argmax_agreement"] == 1.0


def _swap_first_two(s: dict) -> dict:
    ids, lps = (t.clone() for t in s["top"])
    ids[..., 1] = ids[..., 0]
    return {**s, "top": (ids, lps)}


def _hotter(s: dict) -> dict:
    ids, lps = s["top"]
    return {**s, "top": (ids, torch.log_softmax(lps / 2.0, dim=-1) - 1.0)}


@pytest.mark.parametrize("change, error, match", [
    (lambda s, kw: kw.pop("train_top_k"), InputError, "come together"),
    (lambda s, kw: kw.pop("rollout_top_k"), InputError, "come together"),
    (lambda s, kw: kw.update(rollout_top_k=(s["top"][0][..., :3], s["top"][1])), InputError, "like its ids"),
    (lambda s, kw: kw.update(rollout_top_k=_swap_first_two(s)["top"]), TopKError, "twice"),
    (lambda s, kw: kw.update(rollout_top_k=(s["top"][0], s["top"][1].flip(-1))), TopKError, "descending"),
    (lambda s, kw: kw.update(rollout_top_k=_hotter(s)["top"]), TopKError, "another temperature"),
    (lambda s, kw: kw.pop("responses"), InputError, "needs responses"),
])
def test_malformed_top_k_is_a_named_error_and_stores_nothing(tmp_path, change, error, match):
    s = step(2, 0.1)
    kwargs = dict(rollout_log_probs=s["rollout_lp"], old_log_probs=s["train_lp"], response_mask=s["mask"],
                  responses=s["responses"], rollout_top_k=s["top"],
                  train_top_k=train_top_k(s["train"], s["top"][0], s["responses"], s["mask"]))
    change(s, kwargs)
    with parity.Monitor(tmp_path, render_every=0, advice_every=0) as monitor:
        with pytest.raises(error, match=match):
            monitor.log(0, **kwargs)
        assert monitor.last_step is None
    assert MonitorStore.open(tmp_path).steps() == []


def test_train_top_k_refuses_ids_outside_the_vocabulary():
    s = step(3, 0.1)
    ids = s["top"][0].clone()
    ids[0, 0, 0] = VOCAB
    with pytest.raises(InputError, match="outside the vocabulary"):
        train_top_k(s["train"], ids, s["responses"], s["mask"])
    ids[0, 0, 0] = -1
    with pytest.raises(InputError, match="outside the vocabulary"):
        train_top_k(s["train"], ids, s["responses"], s["mask"])
    with pytest.raises(InputError, match="torch tensor"):
        train_top_k(s["train"].numpy(), s["top"][0], s["responses"], s["mask"])


def test_micro_batch_views_in_batch_order_equal_the_whole_batch_s(tmp_path):
    s = step(4, 0.2)
    halves = [train_top_k(s["train"][r], s["top"][0][r], s["responses"][r], s["mask"][r])
              for r in (slice(0, 3), slice(3, None))]
    with parity.Monitor(tmp_path / "a", render_every=0, advice_every=0) as a, \
            parity.Monitor(tmp_path / "b", render_every=0, advice_every=0) as b:
        whole = log(a, 0, s)["summary"]
        split = log(b, 0, s, train_top_k=halves)["summary"]
    for key in DISTRIBUTION_SUMMARY_KEYS:  # bit for bit (NaN where no position's entropy is computable)
        assert whole[key] == split[key] or (np.isnan(whole[key]) and np.isnan(split[key])), key


def test_micro_batch_views_out_of_batch_order_are_refused(tmp_path):
    """Halves of equal counted tokens, swapped (verl's use_dynamic_bsz reorders micro-batches): the
    count matches, the positions do not; in batch order the same views are taken."""
    s = step(5, 0.2)
    s["mask"] = torch.ones_like(s["mask"])
    halves = [train_top_k(s["train"][r], s["top"][0][r], s["responses"][r], s["mask"][r])
              for r in (slice(0, 3), slice(3, None))]
    with parity.Monitor(tmp_path, render_every=0, advice_every=0) as monitor:
        with pytest.raises(InputError, match=r"does not line up with the rollout.*batch order"):
            log(monitor, 0, s, train_top_k=halves[::-1])
        assert log(monitor, 0, s, train_top_k=halves)["step"] == 0
