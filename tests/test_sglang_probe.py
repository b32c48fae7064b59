"""The SGLang probe's reading of SGLang's per-pass tensor dumps, on dumps written the way SGLang
writes them (no SGLang needed; tests/test_sglang_live.py runs it against a real server)."""

import types

import pytest
import torch

from parity.backends.sglang_probe import PassDumps, pass_stages, probe_samples, sample_stages
from parity.core.errors import BackendError, UnsupportedError

KINDS = ("embed", "attn", "mlp", "layer", "norm", "logits")
HIDDEN, VOCAB, LAYERS = 8, 16, 3


def bf16(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def pass_modules(tokens, seed, fused=False):
    """One pass's leaf outputs as SGLang dumps them: the transformers implementation ([1, tokens,
    width], separate residual adds) or the native one (fused add-RMSNorm returning [normed, residual],
    with a residual that is not the plain sum, so reading it is told apart from rebuilding it)."""
    shape = (tokens, HIDDEN) if fused else (1, tokens, HIDDEN)
    modules = {"model.embed_tokens": bf16(*shape, seed=seed), "model.rotary_emb": [bf16(*shape, seed=1)] * 2}
    for i in range(LAYERS):
        modules[f"model.layers.{i}.self_attn.o_proj"] = bf16(*shape, seed=seed + 10 + i)
        modules[f"model.layers.{i}.mlp.down_proj"] = bf16(*shape, seed=seed + 20 + i)
        normed = bf16(*shape, seed=seed + 30 + i)
        modules[f"model.layers.{i}.input_layernorm"] = [normed, bf16(*shape, seed=seed + 40 + i)] \
            if fused and i > 0 else normed
    modules["model.norm"] = [bf16(*shape, seed=seed + 50), bf16(*shape, seed=seed + 60)] if fused \
        else bf16(*shape, seed=seed + 50)
    return modules


def test_layer_outputs_are_rebuilt_by_the_models_own_adds_without_a_fused_norm():
    modules = pass_modules(5, seed=100)
    stages = pass_stages(modules, KINDS)
    hidden = modules["model.embed_tokens"][0]
    for i in range(LAYERS):
        attn, mlp = (modules[f"model.layers.{i}.{n}"][0] for n in ("self_attn.o_proj", "mlp.down_proj"))
        hidden = (hidden + attn) + mlp
        assert torch.equal(stages[f"layer.{i}"], hidden) and torch.equal(stages[f"layer.{i}.attn"], attn)
    assert torch.equal(stages["norm"], modules["model.norm"][0]) and stages["embed"].shape == (5, HIDDEN)
    assert list(pass_stages(modules, ["layer"])) == [f"layer.{i}" for i in range(LAYERS)]


def test_a_fused_norms_residual_is_the_layer_output():
    modules = pass_modules(4, seed=200, fused=True)
    stages = pass_stages(modules, KINDS)
    for i in range(LAYERS - 1):
        assert torch.equal(stages[f"layer.{i}"], modules[f"model.layers.{i + 1}.input_layernorm"][1])
    assert torch.equal(stages[f"layer.{LAYERS - 1}"], modules["model.norm"][1])
    assert torch.equal(stages["norm"], modules["model.norm"][0])
    rebuilt = (modules["model.embed_tokens"] + modules["model.layers.0.self_attn.o_proj"]) \
        + modules["model.layers.0.mlp.down_proj"]
    assert not torch.equal(stages["layer.0"], rebuilt)  # the dumped residual, not a sum


def test_an_moe_layer_is_refused_by_name():
    modules = pass_modules(2, seed=1)
    del modules["model.layers.1.mlp.down_proj"]
    with pytest.raises(UnsupportedError, match="dense decoder layers only"):
        pass_stages(modules, KINDS)


def logits_of(n):
    return torch.full((1, VOCAB), float(n))


def test_rows_concatenate_over_passes_and_each_logits_row_comes_from_the_next_file():
    # a 5-token prompt in two prefill chunks (3 + 2), then two decode steps: 3 response tokens
    passes = [pass_modules(tokens, seed=n + 1) for n, tokens in enumerate((3, 2, 1, 1))]
    for n, modules in enumerate(passes):
        modules["logits_processor"] = logits_of(n - 1)  # the previous pass's logits, as SGLang writes them
    following = {"logits_processor": logits_of(3)}
    stages = sample_stages(passes, following, prompt_len=5, kinds=KINDS)
    assert stages["layer.2"].shape == (7, HIDDEN) and stages["embed"].shape == (7, HIDDEN)
    assert torch.equal(stages["embed"][3:5], passes[1]["model.embed_tokens"][0])
    # the first chunk sampled nothing; the prompt's end and each decode step gave one row
    assert stages["logits"][:, 0].tolist() == [1.0, 2.0, 3.0]


def fake_server(dumps):
    """Writes pass files as SGLang does for requests sent one at a time: per pass a file with the
    previous pass's logits and this pass's modules; returns run(tokens_per_pass) and the logits
    value each pass computed."""
    folder = dumps.root / "TP0_PP0_Rank0_pid1"
    folder.mkdir()
    state = {"passes": 0, "pending": None}

    def forward(tokens):
        modules = pass_modules(tokens, seed=state["passes"])
        if state["pending"] is not None:
            modules["logits_processor"] = state["pending"]
        torch.save(modules, folder / f"Pass{state['passes']:05d}.pt")
        state["pending"] = logits_of(state["passes"])
        state["passes"] += 1

    return forward


def test_probe_samples_reads_each_captured_sample_and_leaves_no_files():
    dumps = PassDumps()
    try:
        forward = fake_server(dumps)
        forward(1)  # the server's warm-up pass
        jobs = [types.SimpleNamespace(request=types.SimpleNamespace(prompt_ids=(1,) * p)) for p in (4, 3, 2)]
        answers = {0: [4, 1, 1], 1: [3, 1], 2: [2, 1, 1, 1]}  # passes per sample: prefill, decodes

        def run_one(i):
            for tokens in answers[i]:
                forward(tokens)
            return f"rollout {i}"

        results, states = probe_samples(dumps, jobs, [0, 2], KINDS, run_one, flush=lambda: forward(1))
        assert results == ["rollout 0", "rollout 1", "rollout 2"] and sorted(states) == [0, 2]
        # sample 0 ran passes 1-3, sample 2 passes 6-9: each logits row is its own pass's
        assert states[0]["logits"][:, 0].tolist() == [1.0, 2.0, 3.0]
        assert states[2]["logits"][:, 0].tolist() == [6.0, 7.0, 8.0, 9.0]
        assert states[2]["layer.0"].shape == (5, HIDDEN) and dumps.files() == []
    finally:
        dumps.close()
    assert not dumps.root.exists()


def test_logits_the_sampler_overwrote_with_probabilities_are_refused():
    # on CPU SGLang's sampler softmaxes the logits tensor its dump holds (no copy) before it is saved
    passes = [pass_modules(3, seed=1), pass_modules(1, seed=2)]
    probabilities = torch.softmax(torch.randn(1, VOCAB), -1)
    passes[1]["logits_processor"] = probabilities
    with pytest.raises(UnsupportedError, match="greedy requests"):
        sample_stages(passes, {"logits_processor": probabilities}, prompt_len=3, kinds=KINDS)
    assert "logits" not in sample_stages(passes, {}, prompt_len=3, kinds=KINDS[:-1])


def test_an_extra_pass_past_the_response_is_refused_with_the_cause():
    # SGLang's overlap scheduler on CUDA ran one more decode pass of a 2-token request (H200, 2026-12-05)
    passes = [pass_modules(tokens, seed=n + 1) for n, tokens in enumerate((3, 1, 1))]
    for n, modules in enumerate(passes):
        modules["logits_processor"] = logits_of(n - 1)
    following = {"logits_processor": logits_of(2)}
    assert sample_stages(passes, following, prompt_len=3, kinds=KINDS, response_len=3)["logits"].shape[0] == 3
    with pytest.raises(BackendError, match="--disable-overlap-schedule"):
        sample_stages(passes, following, prompt_len=3, kinds=KINDS, response_len=2)


def test_the_probes_server_and_engine_run_without_the_overlap_scheduler():
    dumps = PassDumps()
    try:
        assert dumps.server_args() == ["--debug-tensor-dump-output-folder", str(dumps.root),
                                       "--disable-radix-cache", "--disable-overlap-schedule"]
        assert dumps.engine_kwargs()["disable_overlap_schedule"] is True
    finally:
        dumps.close()
