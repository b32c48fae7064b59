"""Round 6, model loading and checkpoints: numbers that were silently wrong.

- a checkpoint missing a tensor its config needs (lm_head with untied embeddings) loaded with that
  tensor randomly initialized; a tensor the config does not use (a q_proj bias on a bias-free
  Llama) was dropped; one of another shape crashed with transformers' RuntimeError;
- config.json tying the LM head to the embedding while the weights hold a different lm_head:
  transformers uses the stored head, vLLM the embedding;
- a sliding attention window (Mixtral `sliding_window`, Qwen2 `use_sliding_window`) was ignored:
  parity's reference attends to every position, 10-13 nats off transformers past the window, with
  the context still max_position_embeddings;
- `num_experts_per_tok` 0 ran every MoE layer as zero; above the expert count it crashed in torch;
- the reference engine stopped at config.json's EOS while every backend stops at
  generation_config.json's (Llama-3-Instruct's <|eot_id|>);
- `model_hash` read no `.bin` weights: two pytorch_model.bin checkpoints with one config had one
  hash, so rollouts were scored with another model unrefused;
- `load_model` served its cached model after the checkpoint was rewritten in place.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from parity.backends.base import eos_token_ids
from parity.core.errors import ConfigError, InputError
from parity.core.types import Request, SamplingParams
from parity.models import check_sampled_with, model_hash, model_limits
from parity.models.checkpoints import builtin_path
from parity.models.loading import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


def copy_of(name: str, where: Path, config: dict | None = None, edit=None) -> Path:
    """A copy of built-in checkpoint `name` with config.json fields `config` and weights edited by `edit`."""
    shutil.copytree(builtin_path(name), where)
    if config:
        cfg = json.loads((where / "config.json").read_text())
        (where / "config.json").write_text(json.dumps({**cfg, **config}))
    if edit is not None:
        weights = load_file(str(where / "model.safetensors"))
        edit(weights)
        save_file(weights, str(where / "model.safetensors"), metadata={"format": "pt"})
    return where


def test_a_missing_tensor_is_refused_not_randomly_initialized(tmp_path):
    path = copy_of("tiny-llama", tmp_path / "m", edit=lambda w: w.pop("lm_head.weight"))
    with pytest.raises(ConfigError, match=r"lacks tensor 'lm_head\.weight'"):
        load_model(str(path))


def test_an_unused_tensor_is_refused(tmp_path):
    def add_bias(w):
        w["model.layers.0.self_attn.q_proj.bias"] = torch.ones(128)

    path = copy_of("tiny-llama", tmp_path / "m", edit=add_bias)
    with pytest.raises(ConfigError, match=r"holds tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"):
        load_model(str(path))


def test_a_tensor_of_another_shape_is_a_config_error_naming_it(tmp_path):
    def narrow(w):
        w["lm_head.weight"] = w["lm_head.weight"][:, :64].contiguous()

    path = copy_of("tiny-llama", tmp_path / "m", edit=narrow)
    with pytest.raises(ConfigError, match=r"another shape for tensor 'lm_head\.weight'"):
        load_model(str(path))


def test_a_tied_config_over_a_distinct_lm_head_is_refused(tmp_path):
    path = copy_of("tiny-llama", tmp_path / "m", config={"tie_word_embeddings": True})
    with pytest.raises(ConfigError, match="tie_word_embeddings=true"):
        load_model(str(path))


def test_a_truly_tied_checkpoint_still_loads(tmp_path):
    path = copy_of("tiny-llama", tmp_path / "m", config={"tie_word_embeddings": True},
                   edit=lambda w: w.pop("lm_head.weight"))
    lm = load_model(str(path))
    assert lm.model.lm_head.weight is lm.model.model.embed_tokens.weight


WINDOWED = [("tiny-mixtral", {"sliding_window": 4}),
            ("tiny-qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0})]


@pytest.mark.parametrize(("name", "config"), WINDOWED)
def test_a_sliding_window_bounds_the_context(tmp_path, name, config):
    path = copy_of(name, tmp_path / "m", config=config)
    limits = model_limits(path)
    assert (limits.max_positions, limits.sliding_window) == (4, 4)
    assert load_model(str(path)).max_len == 4
    request = Request(prompt_ids=[1, 5, 6], sampling=SamplingParams(max_tokens=2), request_id="r")
    with pytest.raises(InputError, match=r"allows 4 \(its sliding window"):
        limits.check([request])


def test_the_reference_is_exact_up_to_the_window_and_wrong_past_it(tmp_path):
    """Why the window bounds the context: transformers attends to the last 4 positions, parity to all."""
    path = copy_of("tiny-mixtral", tmp_path / "m", config={"sliding_window": 4})
    ids = torch.tensor([[1, *range(10, 17)]])
    with torch.no_grad():
        eager = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
        hf = eager(ids).logits.log_softmax(-1)
        ours = load_model(str(path)).model(ids).logits.log_softmax(-1)
    gap = (hf - ours).abs().amax(dim=-1)[0]
    assert gap[:4].max() < 1e-4 and gap[4:].min() > 0.1


@pytest.mark.parametrize("config", [
    {"use_sliding_window": False, "sliding_window": 4},  # Qwen2's default: the window is off
    {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2},  # no layer from 2 on
])
def test_a_window_transformers_does_not_apply_keeps_the_context(tmp_path, config):
    path = copy_of("tiny-qwen2", tmp_path / "m", config=config)
    assert model_limits(path).max_positions == 512
    assert load_model(str(path)).max_len == 512


@pytest.mark.parametrize("top_k", [0, 9])
def test_experts_per_token_outside_the_experts_is_refused(tmp_path, top_k):
    path = copy_of("tiny-qwen3-moe", tmp_path / "m", config={"num_experts_per_tok": top_k})
    with pytest.raises(ConfigError, match=f"num_experts_per_tok={top_k} with 8 experts"):
        model_limits(path)
    with pytest.raises(ConfigError, match=f"num_experts_per_tok={top_k} with 8 experts"):
        load_model(str(path))


def test_the_reference_stops_where_the_backends_stop(tmp_path):
    path = copy_of("tiny-llama", tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 7]}))
    assert eos_token_ids(path) == (2, 7)
    assert load_model(str(path)).eos_token_ids == (2, 7)


def test_model_hash_reads_bin_weights(tmp_path):
    src = builtin_path("tiny-llama")
    dirs = []
    for i, scale in enumerate((1.0, 2.0)):
        d = tmp_path / f"bin{i}"
        d.mkdir()
        shutil.copy(src / "config.json", d)
        torch.save({k: v * scale for k, v in load_file(str(src / "model.safetensors")).items()},
                   d / "pytorch_model.bin")
        dirs.append(d)
    assert model_hash(dirs[0]) != model_hash(dirs[1])
    with pytest.raises(ConfigError, match="is not the model"):
        check_sampled_with(dirs[1], hashes=[model_hash(dirs[0])])


def test_a_checkpoint_rewritten_in_place_is_loaded_again(tmp_path):
    path = copy_of("tiny-llama", tmp_path / "m")
    first = load_model(str(path))
    assert load_model(str(path)) is first
    halved = {k: v * 0.5 for k, v in load_file(str(path / "model.safetensors")).items()}
    save_file(halved, str(path / "model.safetensors"), metadata={"format": "pt"})
    again = load_model(str(path))
    assert again is not first and again.model_hash == model_hash(path) != first.model_hash
    assert torch.equal(again.model.lm_head.weight.detach(), halved["lm_head.weight"])
