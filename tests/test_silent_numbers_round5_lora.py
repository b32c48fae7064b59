"""Round 5, LoRA adapters: numbers that were silently wrong.

- an adapter saved by peft after a PiSSA (OLoRA, CorDA, LoftQ, LoRA-GA) initialization, without
  peft's conversion, was applied to the plain base model, while peft applies it to the residual
  base the initialization left (W - scaling * B0 A0): 2.5 nats off peft on tiny-llama;
- a `LoraSpec` checked against one model was taken as checked by `load_model` (so `train_forward`,
  the engines) on any other, running an adapter made for another base model;
- `base_model_name_or_path` naming another built-in model by its checkpoint directory (what peft
  records for a model loaded from a path) was not compared;
- `adapter_deltas` (the gold forward's merged weights, `merge_adapter`) crashed on a BF16 adapter
  that `check_adapter` accepts (peft's default for a bf16 model).
"""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from parity.core.errors import AdapterError
from parity.engine import train_forward
from parity.models import resolve_model
from parity.models.checkpoints import builtin_dir
from parity.models.loading import load_model
from parity.models.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_deltas,
    check_adapter,
    merge_adapter,
    resolve_adapter,
)

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny-llama"
SEQ = [((1, 5, 9, 12), (7, 3, 22, 4))]


def _copy(tmp_path, name="adapter", source="tiny-llama-lora-r8", **config):
    out = tmp_path / name
    shutil.copytree(resolve_adapter(source), out)
    data = json.loads((out / ADAPTER_CONFIG).read_text())
    (out / ADAPTER_CONFIG).write_text(json.dumps({**data, **config}))
    return out


def test_a_pissa_adapter_saved_by_peft_is_refused(tmp_path):
    """peft's own PiSSA adapter: peft re-derives the residual base on load; parity would add the
    adapter to the plain base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(resolve_model(MODEL), dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights="pissa"))
    peft_model.save_pretrained(tmp_path / "pissa")
    with pytest.raises(AdapterError, match=r"adapter_config.json: init_lora_weights='pissa'.*residual.*"
                                           r"path_initial_model_for_weight_conversion"):
        check_adapter(tmp_path / "pissa", MODEL)
    with pytest.raises(AdapterError, match="init_lora_weights='pissa'"):
        train_forward(MODEL, SEQ, lora=tmp_path / "pissa")


@pytest.mark.parametrize("init", ["pissa_niter_4", "olora", "corda", "loftq", "lora_ga", "unknown"])
def test_initializations_that_move_the_base_are_refused(tmp_path, init):
    with pytest.raises(AdapterError, match=f"init_lora_weights='{init}'"):
        check_adapter(_copy(tmp_path, init_lora_weights=init), MODEL)


@pytest.mark.parametrize("init", [True, False, "gaussian", "eva", "orthogonal", "mica"])
def test_initializations_that_keep_the_base_load(tmp_path, init):
    check_adapter(_copy(tmp_path, init_lora_weights=init), MODEL)


def test_a_spec_checked_against_another_model_is_checked_again():
    """The MoE model's attention-only adapter fits tiny-llama's attention shapes; its spec was
    accepted as checked and ran (logprobs moved by ~1 nat)."""
    spec = check_adapter("tiny-qwen3-moe-lora-r8", "tiny-qwen3-moe")
    with pytest.raises(AdapterError, match=r"base_model_name_or_path 'tiny-qwen3-moe' names another"):
        train_forward(MODEL, SEQ, lora=spec)
    with pytest.raises(AdapterError, match="base_model_name_or_path 'tiny-qwen3-moe'"):
        load_model(MODEL, lora=spec)
    own = check_adapter("tiny-llama-lora-r8", MODEL)
    assert load_model(MODEL, lora=own).lora == own  # checked against this checkpoint: taken as is


def test_a_spec_on_a_copy_of_its_checkpoint_is_accepted(tmp_path):
    spec = check_adapter(_copy(tmp_path, base_model_name_or_path="/ckpt/llama-base"), MODEL)
    copy = tmp_path / "copy"
    shutil.copytree(resolve_model(MODEL), copy)
    got = load_model(copy, lora=spec).lora
    assert got.hash == spec.hash and got.checkpoint == copy.resolve()


def test_a_changed_adapter_behind_a_spec_is_refused(tmp_path):
    path = _copy(tmp_path, base_model_name_or_path="/ckpt/llama-base")
    spec = check_adapter(path, MODEL)
    weights = load_file(str(path / ADAPTER_WEIGHTS))
    save_file({k: v * 2 for k, v in weights.items()}, str(path / ADAPTER_WEIGHTS))
    copy = tmp_path / "copy"
    shutil.copytree(resolve_model(MODEL), copy)
    with pytest.raises(AdapterError, match="changed since it was checked"):
        load_model(copy, lora=spec)


def test_base_model_named_by_another_builtins_directory_is_refused(tmp_path):
    other = str(builtin_dir("tiny-qwen2"))
    with pytest.raises(AdapterError, match=r"base_model_name_or_path .*tiny-qwen2.* names another built-in"):
        check_adapter(_copy(tmp_path, "other", base_model_name_or_path=other), MODEL)
    check_adapter(_copy(tmp_path, "own", base_model_name_or_path=str(resolve_model(MODEL))), MODEL)


def test_a_bf16_adapter_merges(tmp_path):
    path = _copy(tmp_path)
    weights = load_file(str(path / ADAPTER_WEIGHTS))
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, str(path / ADAPTER_WEIGHTS))
    spec = check_adapter(path, MODEL)
    deltas = adapter_deltas(spec)
    key = "model.layers.0.self_attn.q_proj"
    a = weights[f"base_model.model.{key}.lora_A.weight"].to(torch.bfloat16).double().numpy()
    b = weights[f"base_model.model.{key}.lora_B.weight"].to(torch.bfloat16).double().numpy()
    np.testing.assert_array_equal(deltas[f"{key}.weight"], spec.scaling * (b @ a))
    merged = merge_adapter(MODEL, path, tmp_path / "merged")
    assert (merged / "model.safetensors").is_file()
