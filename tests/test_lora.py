"""LoRA adapters: validation from files, the built-in adapters, and the numerics of applying one.

Rollout == training forward bit for bit with an adapter (dense and MoE, fp32 and bf16, many batch
compositions), with a negative control that runs the adapter's products on stock kernels; the
documented order equals peft's `lora.Linear` bit for bit on stock kernels; a run-time swap gives
a fresh engine's bits; the merged checkpoint's difference is measured.
"""

import dataclasses
import json
import random
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from parity import Request, SamplingParams
from parity.core.errors import AdapterError, ConfigError, InputError
from parity.engine import ReferenceEngine, train_forward
from parity.models import patches as patches_module
from parity.models import resolve_model
from parity.models.loading import load_model, swap_adapter
from parity.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, check_adapter, merge_adapter, resolve_adapter
from parity.models.lora_builtins import BUILTIN_ADAPTERS, adapter_config, adapter_weights, write_adapter

pytestmark = pytest.mark.usefixtures("one_thread")

#: (adapter, model): dense at rank 8 (alpha / r) and 64 (rsLoRA), MoE attention-only at both.
CASES = [("tiny-llama-lora-r8", "tiny-llama"), ("tiny-qwen3-lora-r64", "tiny-qwen3"),
         ("tiny-qwen3-moe-lora-r8", "tiny-qwen3-moe"), ("tiny-mixtral-lora-r64", "tiny-mixtral")]


def step_adapter(tmp_path, name, *, seed, alpha=None, directory="step"):
    """A new adapter of built-in `name`'s rank and modules (an RL step's next adapter): other weights
    drawn with `seed`, optionally another lora_alpha, written to tmp_path/directory."""
    spec = BUILTIN_ADAPTERS[name]
    path = resolve_model(spec.model)
    config = adapter_config(spec.model, spec.rank, spec.alpha if alpha is None else alpha, spec.use_rslora,
                            spec.targets)
    return write_adapter(tmp_path / directory, config,
                         adapter_weights(path, spec.rank, spec.scaling, spec.targets, seed))


def copy_adapter(tmp_path, name="tiny-llama-lora-r8"):
    """A writable copy of a built-in adapter, to break in one way per test."""
    target = tmp_path / "adapter"
    shutil.copytree(resolve_adapter(name), target)
    return target


def edit_config(path, **changes):
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    config.update(changes)
    (path / ADAPTER_CONFIG).write_text(json.dumps(config))


# -- the built-in adapters ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BUILTIN_ADAPTERS))
def test_builtin_adapters_fit_their_models(name):
    spec = BUILTIN_ADAPTERS[name]
    checked = check_adapter(name, spec.model)
    assert checked.rank == spec.rank in (8, 64)
    assert checked.scaling == 2.0  # r8: alpha 16 / r; r64: rsLoRA, alpha 16 / sqrt(r)
    moe = spec.model in ("tiny-qwen3-moe", "tiny-mixtral")
    want = {"q_proj", "k_proj", "v_proj", "o_proj"}
    want |= set() if moe else {"gate_proj", "up_proj", "down_proj"}
    assert set(checked.targets) == want
    assert len(checked.modules) == 2 * len(want)  # every layer of the 2-layer checkpoints


def test_builtin_adapter_bytes_are_deterministic(tmp_path, monkeypatch):
    """Generated again in an empty cache (the base checkpoint linked in), the same bytes."""
    cached = resolve_adapter("tiny-qwen3-lora-r8")
    base = resolve_model("tiny-qwen3")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / base.name).symlink_to(base)
    monkeypatch.setenv("PARITY_CACHE", str(tmp_path))
    fresh = resolve_adapter("tiny-qwen3-lora-r8")
    assert fresh != cached
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        assert (fresh / name).read_bytes() == (cached / name).read_bytes()


# -- bad input: named errors from files alone -----------------------------------------------------


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(AdapterError, match=r"not a directory nor a built-in adapter.*tiny-llama-lora-r8"):
        check_adapter(tmp_path / "nope", "tiny-llama")
    path = copy_adapter(tmp_path)
    (path / ADAPTER_WEIGHTS).rename(path / "adapter_model.bin")
    with pytest.raises(AdapterError, match=r"no adapter_model.safetensors.*safe_serialization"):
        check_adapter(path, "tiny-llama")
    (path / ADAPTER_CONFIG).unlink()
    with pytest.raises(AdapterError, match=r"no adapter_config.json"):
        check_adapter(path, "tiny-llama")


def test_adapter_for_another_base_model(tmp_path):
    """Other shapes, other module names, more layers: each refused, naming the module."""
    path = copy_adapter(tmp_path)
    weights = load_file(str(path / ADAPTER_WEIGHTS))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    narrow = {**weights, key: np.zeros((8, 64), np.float32)}  # a model of hidden size 64
    save_file(narrow, str(path / ADAPTER_WEIGHTS))
    with pytest.raises(AdapterError, match=r"q_proj.*lora_A \[8, 64\].*needs \[8, 128\].*another base model"):
        check_adapter(path, "tiny-llama")
    deeper = {**weights, "base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight": weights[key]}
    save_file(deeper, str(path / ADAPTER_WEIGHTS))
    with pytest.raises(AdapterError, match=r"layers.2.self_attn.q_proj.*another base model"):
        check_adapter(path, "tiny-llama")
    save_file(weights, str(path / ADAPTER_WEIGHTS))
    edit_config(path, target_modules=["c_attn", "c_proj"])  # GPT-2's names
    with pytest.raises(AdapterError, match=r"target module 'c_attn' matches no linear layer.*another base"):
        check_adapter(path, "tiny-llama")
    edit_config(path, target_modules=["q_proj"])
    with pytest.raises(AdapterError, match=r"which target_modules does not select"):
        check_adapter(path, "tiny-llama")


def test_unsupported_target_modules(tmp_path):
    with pytest.raises(AdapterError, match=r"experts.*not supported.*attention projections of a MoE model"):
        check_adapter("tiny-llama-lora-r8", "tiny-qwen3-moe")  # MLP targets on a MoE model
    path = copy_adapter(tmp_path)
    edit_config(path, target_modules=["q_proj", "lm_head"])
    with pytest.raises(AdapterError, match=r"'lm_head' is not supported"):
        check_adapter(path, "tiny-llama")
    edit_config(path, target_modules=["mlp.gate"])  # the Qwen3-MoE router
    with pytest.raises(AdapterError, match=r"mlp.gate' is not supported"):
        check_adapter(path, "tiny-qwen3-moe")


@pytest.mark.parametrize("option", [{"use_dora": True}, {"bias": "all"}, {"rank_pattern": {"q_proj": 4}},
                                    {"modules_to_save": ["lm_head"]}, {"layers_to_transform": [0]},
                                    {"peft_type": "IA3"}, {"r": 0}, {"lora_alpha": -1}])
def test_unsupported_peft_options(tmp_path, option):
    path = copy_adapter(tmp_path)
    edit_config(path, **option)
    with pytest.raises(AdapterError, match=next(iter(option))):
        check_adapter(path, "tiny-llama")


def test_incomplete_adapter(tmp_path):
    path = copy_adapter(tmp_path)
    weights = load_file(str(path / ADAPTER_WEIGHTS))
    del weights["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    save_file(weights, str(path / ADAPTER_WEIGHTS))
    with pytest.raises(AdapterError, match=r"no lora_B weight for 'model.layers.1.mlp.down_proj'"):
        check_adapter(path, "tiny-llama")


def test_validation_needs_no_torch(tmp_path):
    """Checked from the config and the safetensors headers: a fresh interpreter never imports torch."""
    import subprocess
    import sys

    code = ("import sys; from parity.models.lora import check_adapter; "
            "check_adapter('tiny-qwen3-moe-lora-r64', 'tiny-qwen3-moe'); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the documented order is peft's ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adapted_linear_equals_peft_on_stock_kernels(dtype):
    """With every kernel family off, parity's adapted linear computes peft's `lora.Linear` forward
    (float32 adapter weights, its default) bit for bit: the order `parity.models.lora` documents."""
    from peft import PeftModel

    from parity import kernels
    from parity.models.patches import ParityLinear

    lm = load_model("tiny-llama", dtype=str(dtype).removeprefix("torch."), lora="tiny-llama-lora-r8")
    ours = lm.model.get_submodule("model.layers.1.mlp.down_proj")
    assert isinstance(ours, ParityLinear) and ours.parity_lora is not None
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-llama"), dtype=dtype)
    peft_model = PeftModel.from_pretrained(hf, str(resolve_adapter("tiny-llama-lora-r8")))
    theirs = peft_model.base_model.model.model.layers[1].mlp.down_proj
    assert theirs.lora_A["default"].weight.dtype == torch.float32
    x = torch.randn(2, 9, 256, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad(), kernels.native():
        assert torch.equal(ours(x), theirs(x))
        base = torch.nn.functional.linear(x, ours.weight)
        a, b = ours.parity_lora.a, ours.parity_lora.b
        by_hand = (base.float() + (x.float() @ a.T) @ b.T * 2.0).to(dtype)
        assert (ours(x) - by_hand).abs().max() <= (1e-6 if dtype == torch.float32 else 2e-2)


# -- rollout == training forward, bit for bit ------------------------------------------------------


@st.composite
def workloads(draw):
    """Requests and the engine and trainer settings that must not change any token's numbers."""
    requests = []
    for i in range(draw(st.integers(1, 4))):
        rng = random.Random(draw(st.integers(0, 2**16)))
        prompt = tuple(rng.randrange(3, 512) for _ in range(draw(st.integers(1, 40))))
        sampling = SamplingParams(
            n=draw(st.integers(1, 3)), temperature=draw(st.sampled_from([0.0, 0.7, 1.0])),
            top_p=draw(st.sampled_from([1.0, 0.9])), max_tokens=draw(st.integers(1, 8)),
            seed=draw(st.integers(0, 2**16)), logprobs_mode=draw(st.sampled_from(["processed", "raw"])))
        requests.append(Request(prompt, sampling, request_id=f"r{i}"))
    return {"requests": draw(st.permutations(requests)), "max_num_seqs": draw(st.integers(1, 5)),
            "chunk_size": draw(st.integers(1, 24)), "micro_batch_size": draw(st.integers(1, 6)),
            "layout": draw(st.sampled_from(["right", "left", "packed"]))}


def rollout_and_train(adapter, model, dtype, work, kernels="invariant"):
    with ReferenceEngine(model, dtype=dtype, kernels=kernels, lora=adapter, max_num_seqs=work["max_num_seqs"],
                         chunk_size=work["chunk_size"]) as engine:
        rollouts = engine.generate(work["requests"])
    scored = train_forward(model, rollouts, dtype=dtype, kernels=kernels, layout=work["layout"],
                           micro_batch_size=work["micro_batch_size"]).logprobs
    return rollouts, scored


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("adapter", "model"), CASES)
@given(work=workloads())
@pytest.mark.slow
def test_rollout_equals_train_forward_bitwise_with_adapter(adapter, model, dtype, work):
    rollouts, scored = rollout_and_train(adapter, model, dtype, work)
    assert all(r.meta["lora"]["hash"] == check_adapter(adapter, model).hash for r in rollouts)
    for rollout, score in zip(rollouts, scored, strict=True):
        assert torch.equal(score, torch.tensor(rollout.logprobs, dtype=torch.float32))


def test_stock_adapter_products_break_parity(monkeypatch):
    """Negative control: the base layers on invariant kernels, only the adapter's two products on
    stock `F.linear` (batch-variant on CPU), and the same comparison finds a difference."""

    def stock_delta(x, lora):
        linear = torch.nn.functional.linear
        return linear(linear(x.float(), lora.a), lora.b) * lora.scaling

    monkeypatch.setattr(patches_module, "lora_delta", stock_delta)
    found = False
    for seed in range(8):
        rng = random.Random(seed)
        requests = [Request(tuple(rng.randrange(3, 512) for _ in range(rng.randrange(5, 40))),
                            SamplingParams(n=2, max_tokens=6, seed=i), request_id=str(i)) for i in range(4)]
        work = {"requests": requests, "max_num_seqs": 3, "chunk_size": 7, "micro_batch_size": 8,
                "layout": "right"}
        rollouts, scored = rollout_and_train("tiny-llama-lora-r8", "tiny-llama", "float32", work)
        if any(not torch.equal(s, torch.tensor(r.logprobs, dtype=torch.float32))
               for r, s in zip(rollouts, scored)):
            found = True
            break
    assert found, "stock adapter products never broke parity: this control cannot fail the real test"


def test_adapter_changes_logprobs():
    """The adapter is applied: the base model scores the adapter's rollouts differently."""
    work = {"requests": [Request((5, 6, 7, 8, 9), SamplingParams(n=2, max_tokens=8, seed=1), "a")],
            "max_num_seqs": 2, "chunk_size": 8, "micro_batch_size": 2, "layout": "right"}
    rollouts, scored = rollout_and_train("tiny-llama-lora-r8", "tiny-llama", "float32", work)
    base = train_forward("tiny-llama", [(r.prompt_ids, r.token_ids) for r in rollouts],
                         dtype="float32", temperature=1.0).logprobs
    assert float(torch.cat(scored).sub(torch.cat(base)).abs().mean()) > 0.05


# -- run-time swap ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_swap_gives_a_fresh_engines_bits(tmp_path, dtype):
    """After `load_adapter`, the engine samples what a new engine on the new adapter samples, and
    the training forward follows the adapter the rollouts record."""
    step = step_adapter(tmp_path, "tiny-llama-lora-r8", seed=7)
    requests = [Request((5, 6, 7, 8 + i), SamplingParams(n=2, max_tokens=8, seed=i), str(i))
                for i in range(3)]
    with ReferenceEngine("tiny-llama", dtype=dtype, lora="tiny-llama-lora-r8") as engine:
        before = engine.generate(requests)
        engine.load_adapter(step)
        after = engine.generate(requests)
    with ReferenceEngine("tiny-llama", dtype=dtype, lora=str(step)) as fresh:
        expected = fresh.generate(requests)
    assert [r.token_ids for r in after] == [r.token_ids for r in expected]
    assert [r.logprobs for r in after] == [r.logprobs for r in expected]
    assert [r.token_ids for r in after] != [r.token_ids for r in before]
    assert after[0].meta["lora"]["hash"] == check_adapter(step, "tiny-llama").hash
    for rollout, score in zip(after, train_forward("tiny-llama", after, dtype=dtype).logprobs):
        assert torch.equal(score, torch.tensor(rollout.logprobs, dtype=torch.float32))
    # the swap changed the engine's own adapter only: load_model's shared model still applies the first
    again = train_forward("tiny-llama", before, dtype=dtype).logprobs
    assert all(torch.equal(s, torch.tensor(r.logprobs, dtype=torch.float32)) for r, s in zip(before, again))


def test_swap_refuses_another_rank(tmp_path):
    with ReferenceEngine("tiny-llama", lora="tiny-llama-lora-r8") as engine, \
            pytest.raises(AdapterError, match=r"rank 64.*rank 8.*new engine"):
        engine.load_adapter("tiny-llama-lora-r64")
    with ReferenceEngine("tiny-llama") as engine, \
            pytest.raises(AdapterError, match=r"without a LoRA adapter"):
        engine.load_adapter("tiny-llama-lora-r8")
    with pytest.raises(AdapterError, match=r"load_model's shared one"):
        swap_adapter(load_model("tiny-llama", lora="tiny-llama-lora-r8"), "tiny-llama-lora-r8")


def test_scoring_follows_the_recorded_adapter(tmp_path):
    requests = [Request((5, 6, 7), SamplingParams(n=1, max_tokens=5, seed=0), "a")]
    with ReferenceEngine("tiny-llama", lora="tiny-llama-lora-r8") as engine:
        rollouts = engine.generate(requests)
    with pytest.raises(ConfigError, match=r"contradicts the rollouts' record"):
        train_forward("tiny-llama", rollouts, lora="tiny-llama-lora-r64")
    moved = rollouts[0].meta["lora"] | {"path": str(tmp_path / "gone")}
    gone = dataclasses.replace(rollouts[0], meta={**rollouts[0].meta, "lora": moved})
    with pytest.raises(ConfigError, match=r"cannot be read here.*pass lora="):
        train_forward("tiny-llama", [gone])
    plain = dataclasses.replace(rollouts[0], meta={})
    with pytest.raises(InputError, match=r"different LoRA adapters"):
        train_forward("tiny-llama", [rollouts[0], plain])
    with pytest.raises(AdapterError, match=r"without tensor parallelism"):
        train_forward("tiny-llama", [((5, 6, 7), (8,))], lora="tiny-llama-lora-r8", tensor_parallel_size=1)


# -- against the merged checkpoint ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merged_checkpoint_is_close_not_bitwise(tmp_path, dtype):
    """The merged weights (W + scaling B A, rounded once) give other bits; the measured difference
    is in docs/PERF.md (this bounds it well above what was measured)."""
    merged = merge_adapter("tiny-llama", "tiny-llama-lora-r8", tmp_path / "merged")
    requests = [Request(tuple(range(5 + i, 30 + i)), SamplingParams(n=2, max_tokens=16, seed=i), str(i))
                for i in range(4)]
    with ReferenceEngine("tiny-llama", dtype=dtype, lora="tiny-llama-lora-r8") as engine:
        rollouts = engine.generate(requests)
    pairs = [(r.prompt_ids, r.token_ids) for r in rollouts]
    adapter = torch.cat(train_forward("tiny-llama", rollouts, dtype=dtype).logprobs)
    whole = torch.cat(train_forward(str(merged), pairs, dtype=dtype, temperature=1.0).logprobs)
    diff = float((adapter - whole).abs().max())
    assert 0 < diff < (1e-3 if dtype == "float32" else 0.5)


def test_the_gold_forward_merges_the_recorded_adapter(tmp_path):
    """The gold of LoRA rollouts is the adapted model's: equal (to float32 rounding of the merged
    checkpoint's weights) to the gold of the merged checkpoint, and far from the base model's gold
    (the negative control: a gold that ignored the adapter would fail the first bound)."""
    from parity.engine.gold import gold_logprobs

    merged = merge_adapter("tiny-llama", "tiny-llama-lora-r8", tmp_path / "merged")
    requests = [Request(tuple(range(5 + i, 20 + i)), SamplingParams(n=1, max_tokens=8, seed=i), str(i))
                for i in range(3)]
    with ReferenceEngine("tiny-llama", dtype="float32", lora="tiny-llama-lora-r8") as engine:
        rollouts = engine.generate(requests)
    pairs = [(r.prompt_ids, r.token_ids) for r in rollouts]
    adapted = np.concatenate(gold_logprobs("tiny-llama", rollouts))
    whole = np.concatenate(gold_logprobs(str(merged), pairs, temperature=1.0))
    base = np.concatenate(gold_logprobs("tiny-llama", pairs, temperature=1.0))
    assert np.abs(adapted - whole).max() < 1e-5
    assert np.abs(adapted - base).max() > 1e-3
    given = np.concatenate(gold_logprobs("tiny-llama", pairs, temperature=1.0, lora="tiny-llama-lora-r8"))
    np.testing.assert_array_equal(given, adapted)
    with pytest.raises(ConfigError, match=r"contradicts the rollouts' record"):
        gold_logprobs("tiny-llama", rollouts, lora="tiny-llama-lora-r64")


def test_a_cached_model_records_the_callers_copy_of_its_adapter(tmp_path):
    """load_model's cache is keyed by the adapter's content; a hit gives the caller's own directory
    (the first caller's may be gone: the RL loop writes its adapters into a temporary directory)."""
    from parity.models.loading import load_model

    first = load_model("tiny-llama", dtype="float32", lora="tiny-llama-lora-r8")
    copy = shutil.copytree(first.lora.path, tmp_path / "copy")
    again = load_model("tiny-llama", dtype="float32", lora=copy)
    assert again.lora.path == copy and again.lora.hash == first.lora.hash and again.model is first.model
