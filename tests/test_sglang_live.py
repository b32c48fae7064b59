"""SGLang run for real: a server parity starts on this machine's CPU, driven through the adapter.

Needs a Python with SGLang installed, named by PARITY_SGLANG_PYTHON; `make sglang-check` builds
one (.venv-sglang, ~11 GB, ~9 min: SGLang pins a CUDA torch build, which also runs on CPU) and
runs this file. `make test` does not: the install alone would take a third of its time budget.

Only one server configuration works on a CPU without AVX-512/AMX (see the README's backend
table): torch_native attention with the transformers model implementation; the documented CPU
engine (SGLANG_USE_CPU_ENGINE=1) needs a CPU build of sgl-kernel that PyPI does not carry, and
the MoE checkpoints do not load ("No accelerator ... is available").
"""

import os

import numpy as np
import pytest

from parity import Request, SamplingParams, compare
from parity.attribute import EngineSide
from parity.backends.sglang import SGLangBackend
from parity.core.errors import BackendError, UnsupportedError
from parity.engine import train_forward
from parity.models import resolve_model
from parity.runtime.processes import LOOPBACK, ServerProcess, free_loopback_port

PYTHON = os.environ.get("PARITY_SGLANG_PYTHON")
pytestmark = [pytest.mark.sglang, pytest.mark.skipif(
    not PYTHON, reason="PARITY_SGLANG_PYTHON is not set: `make sglang-check` installs SGLang and runs this")]

#: bf16 SGLang against parity's training forward on tiny-llama. Measured: max 0.12, mean 0.017
#: nats over 1,024 tokens against the bf16 reference. SGLang's seed is not honoured on this path,
#: so every run samples other tokens: the bound leaves room.
BF16_DRIFT = 0.3


def sglang_argv(model: str, port: int) -> list[str]:
    """The launch command that serves on this CPU (every flag needed; see the module docstring)."""
    return [PYTHON, "-m", "sglang.launch_server", "--model-path", str(resolve_model(model)),
            "--device", "cpu", "--host", LOOPBACK, "--port", str(port),
            "--attention-backend", "torch_native", "--model-impl", "transformers", "--dtype", "bfloat16",
            "--skip-tokenizer-init", "--max-total-tokens", "4096", "--disable-overlap-schedule",
            "--random-seed", "0"]


@pytest.fixture(scope="module")
def server():
    port = free_loopback_port()
    process = ServerProcess(sglang_argv("tiny-llama", port), port=port, name="sglang", folder_env="TMPDIR",
                            env={"SGLANG_RETURN_ORIGINAL_LOGPROB": "1", "SGLANG_USE_CPU_ENGINE": "0"})
    process.start(timeout_s=900)
    assert any(p.is_socket() for p in process.log_path.parent.iterdir())  # SGLang's, not in /tmp
    yield process
    process.stop()
    assert process.exit_reason() is not None  # stopped, not left running
    assert not process.log_path.parent.exists()  # nor its socket files left


def test_generate_and_score_match_the_training_forward(server):
    backend = SGLangBackend("tiny-llama", base_url=server.url, logprobs_mode="raw")
    assert backend.meta["backend_version"].startswith("0.5")
    requests = [Request(tuple(range(3, 3 + n)), SamplingParams(n=2, temperature=t, top_k=k, max_tokens=12,
                                                               logprobs_mode="raw", ignore_eos=True, seed=n),
                        request_id=f"r{n}")
                for n, t, k in ((4, 1.0, 0), (9, 0.7, 20), (17, 0.0, 0))]
    rollouts = backend.generate(requests)
    assert [len(r.token_ids) for r in rollouts] == [12] * 6
    train = train_forward("tiny-llama", rollouts, logprobs_mode="raw").logprobs
    for rollout, logprobs in zip(rollouts, train):
        assert np.abs(np.array(rollout.logprobs) - logprobs.numpy()).max() < BF16_DRIFT
    scores = backend.score([(r.prompt_ids, r.token_ids) for r in rollouts])
    for score, logprobs in zip(scores, train):
        assert np.abs(score.numpy() - logprobs.numpy()).max() < BF16_DRIFT


def test_compare_reports_drift_against_the_exact_reference(server):
    prompts = [list(range(3 + i, 12 + 3 * i)) for i in range(16)]
    report = compare("tiny-llama", "sglang", base_url=server.url, logprobs_mode="raw", prompts=prompts,
                     sampling=SamplingParams(n=2, max_tokens=32, logprobs_mode="raw", ignore_eos=True))
    summary = report.summary
    print({key: summary[key] for key in ("num_tokens", "max_abs_logprob_diff", "mean_abs_logprob_diff",
                                         "k3_kl", "is_ratio_min", "is_ratio_max")})
    assert summary["num_tokens"] == 16 * 2 * 32
    assert 0 < summary["max_abs_logprob_diff"] < BF16_DRIFT


def test_moe_does_not_load_on_the_cpu_path_and_nothing_is_left_running():
    """SGLang's transformers backend asks for an accelerator to place MoE experts: the start fails,
    parity says why, and the failed server is gone."""
    port = free_loopback_port()
    process = ServerProcess([*sglang_argv("tiny-qwen3-moe", port), "--enable-return-routed-experts"],
                            port=port, name="sglang", env={"SGLANG_USE_CPU_ENGINE": "0"}, folder_env="TMPDIR")
    with pytest.raises(BackendError, match="No accelerator"):
        process.start(timeout_s=900)
    assert process.exit_reason() is not None and not process.log_path.parent.exists()


# -- the engine probe, from SGLang's per-pass tensor dumps ----------------------------------------

CPU_SERVER_ARGS = ("--device cpu --attention-backend torch_native --model-impl transformers "
                   "--max-total-tokens 4096 --disable-overlap-schedule --random-seed 0")


def probe_options() -> dict:
    return {"launch_server": True, "server_args": CPU_SERVER_ARGS, "python": PYTHON, "logprobs_mode": "raw"}


def greedy_requests() -> list[Request]:
    sampling = SamplingParams(max_tokens=6, temperature=0.0, logprobs_mode="raw", ignore_eos=True)
    return [Request(tuple(range(3 + i, 9 + 2 * i)), sampling, f"p{i}") for i in range(3)]


def test_the_probe_captures_every_stage_and_leaves_sglangs_numbers_unchanged(server):
    from parity.attribute.stages import stage_order

    requests = greedy_requests()
    plain = SGLangBackend("tiny-llama", base_url=server.url, logprobs_mode="raw")
    alone = [plain.generate([r])[0] for r in requests]  # one at a time, as the probe sends them
    probed = SGLangBackend("tiny-llama", probe=True, **probe_options())
    try:
        dumps = probed.dumps.root
        rollouts, states = probed.probe(requests, [0, 2], ["embed", "attn", "mlp", "layer", "norm", "logits"])
        sampled = Request((3, 4, 5), SamplingParams(max_tokens=2, logprobs_mode="raw"), "t1")
        with pytest.raises(UnsupportedError, match="greedy requests"):  # before a request is sent
            probed.probe([sampled], [0], ["layer", "logits"])
    finally:
        probed.close()
    assert not dumps.exists()  # the dump folder goes with the backend
    assert [r.token_ids for r in rollouts] == [r.token_ids for r in alone]
    assert [r.logprobs for r in rollouts] == [r.logprobs for r in alone]  # capture changes no bit
    assert sorted(states) == [0, 2] and list(states[0]) == stage_order(
        ["embed", "attn", "mlp", "layer", "norm", "logits"], 2)
    for i in (0, 2):
        fed = len(requests[i].prompt_ids) + 6 - 1
        assert states[i]["layer.1"].shape == (fed, 128) and states[i]["logits"].shape == (6, 512)
        # the captured logits are the ones SGLang sampled from: greedy takes their argmax
        assert states[i]["logits"].argmax(-1).tolist() == list(rollouts[i].token_ids)


def test_sglang_against_the_training_forward_layer_by_layer():
    from parity.attribute import engine_diff

    diff = engine_diff("tiny-llama", greedy_requests(), backend="sglang",
                       side=EngineSide(options=probe_options()))
    assert diff.side_b.startswith("sglang: one sample per call") and diff.positions["decode"] > 0
    for phase in diff.phases:
        embed = next(s for s in phase.stages if s.stage == "embed")
        assert embed.differing == 0  # the same bf16 table, looked up
        assert phase.first_differing is not None  # SGLang's CPU kernels are not the trainer's


def test_a_weight_changed_in_one_engine_is_found_at_that_sublayer(tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from parity.attribute import probe_engine
    from parity.attribute.probe import compare_probes

    changed = tmp_path / "tiny-llama-changed"
    shutil.copytree(resolve_model("tiny-llama"), changed)
    weights = load_file(changed / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name] = (weights[name].float() * 1.05).to(weights[name].dtype)
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    requests = greedy_requests()
    kinds = ["embed", "attn", "mlp", "layer", "norm", "logits"]
    probes = []
    for model in (resolve_model("tiny-llama"), changed):
        backend = SGLangBackend(model, probe=True, **probe_options())
        try:
            probes.append(probe_engine(backend, requests, [0, 1, 2], kinds, label=str(model)))
        finally:
            backend.close()
    diff = compare_probes("tiny-llama", "sglang", *probes)
    for phase in ("prefill", "decode"):
        stages = diff.phase(phase).stages
        assert diff.phase(phase).first_differing == "layer.1.mlp", phase
        first = [s.stage for s in stages].index("layer.1.mlp")
        assert all(s.differing == 0 for s in stages[:first])  # SGLang repeats itself bit for bit
