"""The RL loop with an adapter-only update (`lora_rank`): the reference engine's rollouts equal the
training forward bit for bit at every step with the adapter, only the adapter changes (the base
weights' digests stay), the adapter moves (and with lr 0 it does not), a skipped adapter push is
caught, bad input is refused before any engine starts."""

import json

import pytest
import torch

import parity
from parity.backends import get_backend
from parity.backends.reference import ReferenceBackend
from parity.cli import main
from parity.core.errors import ConfigError
from parity.core.schema import LORA_MOE_TARGETS, LORA_TARGETS
from parity.engine import train_forward
from parity.loop import run as loop_run
from parity.loop.adapter import initial_adapter
from parity.loop.config import LoopConfig
from parity.loop.record import ADAPTER_UPDATE_KEYS, UPDATE_KEYS, LoopRecord
from parity.models.checkpoints import resolve_model
from parity.models.lora import check_adapter

pytestmark = pytest.mark.usefixtures("one_thread")

#: a short run's settings: 4 prompts x 4 responses x 8 tokens (a learning rate that moves the adapter).
SMALL = {"prompts": 4, "n": 4, "max_tokens": 8, "lr": 1e-2}


def token_sum_reward(rollout):
    """A reward with variance in every group, so every update moves the adapter."""
    return float(sum(rollout.token_ids) % 7)


def _no_trainer(*args, **kwargs):
    raise AssertionError("the trainer started")


@pytest.mark.parametrize(("model", "targets"), [("tiny-llama", LORA_TARGETS),
                                                ("tiny-qwen3-moe", LORA_MOE_TARGETS)])
def test_the_step_0_adapter_computes_the_base_model(model, targets, tmp_path):
    """peft's initialisation (B = 0): the adapted model's logprobs are the base model's, bit for bit;
    dense models are adapted on attention and MLP, MoE models on attention only."""
    path = initial_adapter(resolve_model(model), model, 8, 0, tmp_path / "a")
    spec = check_adapter(path, model)
    assert spec.rank == 8 and spec.scaling == 1.0 and spec.targets == tuple(sorted(targets))
    pairs = [((1, 5, 9, 2), (7, 3, 11)), ((4, 4), (8, 1, 2, 6, 9))]
    base = train_forward(model, pairs).logprobs
    adapted = train_forward(model, pairs, lora=path).logprobs
    assert all(torch.equal(b, a) for b, a in zip(base, adapted))
    # the same A is drawn for the same seed: the bytes are reproducible
    again = check_adapter(initial_adapter(resolve_model(model), model, 8, 0, tmp_path / "b"), model)
    assert again.hash == spec.hash


def test_adapter_loop_is_bitwise_and_moves_only_the_adapter(tmp_path):
    """A borrowed reference engine (started with an adapter of its own): at every step its rollouts
    equal the training forward bit for bit and the push is verified; after every push the engine's
    base weights have their starting digests while the adapter it applies is the new one; at the
    end it gets its own adapter back."""
    own = check_adapter(initial_adapter(resolve_model("tiny-llama"), "tiny-llama", 8, 99, tmp_path / "own"),
                        "tiny-llama")
    engine = get_backend("reference", "tiny-llama", dtype="float32", lora=str(own.path))
    base = engine.weight_checksums()
    seen = []

    def progress(rows):
        seen.append((engine.weight_checksums(), engine.meta["lora"]["hash"]))

    record = parity.loop("tiny-llama", [engine], steps=4, lora_rank=8, seed=1, reward=token_sum_reward,
                         json=tmp_path / "loop.json", progress=progress, **SMALL)
    assert record.status == "complete"
    rows = record.rows("reference")
    assert all(row["bitwise"] and row["max_abs_logprob_diff"] == 0.0 for row in rows)
    assert all(row["weights_in_sync"] for row in rows)
    assert all(update["forward_bitwise"] for update in record.updates)
    kl = [row["policy_kl_from_start"] for row in rows]
    assert kl[0] == 0.0 and all(k > 0 for k in kl[1:])
    hashes = [update["adapter_hash"] for update in record.updates]
    assert len({*hashes, record.provenance["adapter"]["hash"]}) == 5  # a new adapter every step
    assert all(checksums == base for checksums, _ in seen)  # the base never moves
    assert [applied for _, applied in seen[:3]] == hashes[:3]  # the push after step t sends update t's
    assert engine.meta["lora"]["hash"] == own.hash and engine.weight_checksums() == base
    stored = json.loads((tmp_path / "loop.json").read_text())
    assert stored["config"]["lora_rank"] == 8 and stored["provenance"]["adapter"]["r"] == 8
    assert all(set(u) == {*UPDATE_KEYS, *ADAPTER_UPDATE_KEYS} and u["adapter_bytes"] > 0
               for u in stored["updates"])


def test_with_lr_0_the_adapter_stays():
    """Negative control of "the adapter moves": with lr 0 every update writes the step-0 adapter's
    bytes again (same hash) and the policy stays where it started."""
    record = parity.loop("tiny-llama", ["reference"], steps=3, lora_rank=8, reward=token_sum_reward,
                         **{**SMALL, "lr": 0.0})
    assert {update["adapter_hash"] for update in record.updates} == {record.provenance["adapter"]["hash"]}
    assert all(row["policy_kl_from_start"] == 0.0 and row["bitwise"] for row in record.steps)


@pytest.mark.parametrize("skip", ["load_adapter", "_load_adapter"])
def test_a_skipped_adapter_push_is_caught(monkeypatch, skip):
    """Negative controls of the push after step 1: skipped whole (the engine still reports the old
    adapter), step 2's row is out of sync; loaded in name only (the engine reports the new adapter
    but applies the old one), the sync check cannot see it and step 2's rollouts are off the
    trained policy's bits instead."""
    calls = []
    real = getattr(ReferenceBackend, skip)

    def flaky(self, *args):
        calls.append(1)
        if len(calls) != 3:  # the 1st is the starting sync, the 2nd after step 0, the 3rd after step 1
            return real(self, *args)
        return None

    monkeypatch.setattr(ReferenceBackend, skip, flaky)
    record = parity.loop("tiny-llama", ["reference"], steps=4, lora_rank=8, reward=token_sum_reward, **SMALL)
    in_sync = [row["weights_in_sync"] for row in record.steps]
    bitwise = [row["bitwise"] for row in record.steps]
    if skip == "load_adapter":
        assert in_sync == [True, True, False, True]
        assert "adapter (applies" in record.steps[2]["sync_detail"]
    else:
        assert all(in_sync)
    assert bitwise == [True, True, False, True]


@pytest.mark.parametrize(("value", "match"), [(0, "lora_rank must be an integer >= 1"), (-8, "lora_rank"),
                                              (2.5, "lora_rank"), (True, "lora_rank")])
def test_a_bad_rank_is_refused(value, match):
    with pytest.raises(ConfigError, match=match):
        LoopConfig(model="tiny-llama", lora_rank=value)
    with pytest.raises(ConfigError, match="drop the lora option"):
        LoopConfig(model="tiny-llama", lora_rank=8, backend_options={"reference": {"lora": "x"}})


def test_a_backend_that_cannot_take_adapters_is_refused_before_step_0(monkeypatch):
    monkeypatch.setattr(loop_run, "Trainer", _no_trainer)
    monkeypatch.setattr(loop_run, "lora_backends", lambda: ["reference"])  # as if vLLM had no LoRA
    with pytest.raises(ConfigError, match="backend 'vllm' cannot apply adapters; drop 'vllm'"):
        parity.loop("tiny-llama", ["reference", "vllm"], steps=2, lora_rank=8)
    plain = get_backend("reference", "tiny-llama")
    with pytest.raises(ConfigError, match="started without a LoRA adapter"):
        parity.loop("tiny-llama", [plain], steps=2, lora_rank=8)


def test_command_line(tmp_path):
    out = tmp_path / "loop.json"
    code = main(["loop", "--model", "tiny-llama", "--steps", "2", "--prompts", "2", "--n", "2",
                 "--max-tokens", "4", "--lora-rank", "4", "--json", str(out)])
    assert code == 0
    record = LoopRecord.read(out)
    assert record.config["lora_rank"] == 4 and record.provenance["adapter"]["r"] == 4
    assert main(["loop", "--model", "tiny-llama", "--steps", "1", "--lora-rank", "0"]) == 2


@pytest.mark.slow
def test_moe_adapter_loop_is_bitwise():
    """tiny-qwen3-moe: the adapter on the attention projections, rollouts bitwise at every step."""
    record = parity.loop("tiny-qwen3-moe", ["reference"], steps=3, lora_rank=8, reward=token_sum_reward,
                         **SMALL)
    assert all(row["bitwise"] and row["weights_in_sync"] for row in record.steps)
    assert record.provenance["adapter"]["target_modules"] == sorted(LORA_MOE_TARGETS)
    assert record.steps[-1]["policy_kl_from_start"] > 0
