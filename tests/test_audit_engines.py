"""The audit on real engines, with the expected results of issue 35:

- the reference engine is identical on every check it can run (CPU here, CUDA on a GPU host), MoE
  routes included;
- `hf` (padded batches, one RNG per padded batch) differs on `batch`: the negative control that
  shows the batch check can fail on a real engine;
- vLLM-CPU is measured (one engine, every check; the numbers are in docs/PERF.md and README);
- GPU vLLM with batch-invariant mode off and on (marked gpu and vllm; run on the H200).

The vLLM server's audit (its settings in the result, its prefix cache bypassed by salting) is in
tests/test_backends_vllm_server.py, which owns the module's server.
"""

import importlib.util
import json

import pytest
import torch

import parity
from parity.audit.command import main
from parity.backends import get_backend, shared_backend
from parity.workload.cases import load_case

pytestmark = [pytest.mark.slow]

SMOKE = "cases/smoke.toml"
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _identical_everywhere(result):
    """Every check that ran is identical, the control held, and only checks the backend cannot do
    were skipped (the reference engine has no prefix cache)."""
    for name in ("repeat", "batch", "order", "prefill_decode"):
        assert result.checks[name].identical, (name, result.checks[name])
    assert "without a prefix cache" in result.checks["prefix_cache"].skipped
    assert not result.checks["seed"].identical and result.checks["seed"].differing_requests > 0
    assert result.deterministic and result.batch_invariant and result.control_held


def test_the_reference_engine_is_identical_on_every_check():
    engine = shared_backend("reference", "tiny-llama", dtype="float32")
    result = parity.audit("tiny-llama", engine, case=SMOKE)
    _identical_everywhere(result)
    assert result.checks["batch"].requests == 4 and result.provenance["audit"]["batch_sizes"] == [1, 8, 64]


def test_the_reference_engine_routes_identically_alone_and_in_batches():
    case = load_case("cases/moe.toml")
    engine = shared_backend("reference", "tiny-qwen3-moe", dtype="float32", record_routes=True)
    result = parity.audit(None, engine, case=case, dtype="float32", checks=["repeat", "batch"])
    assert result.checks["repeat"].identical and result.checks["batch"].identical
    # every sample carried routes: identical means the routes were compared and agreed
    assert result.provenance["audit"]["samples_with_routes"] == 2 * 8 + 4 + 8 + 64


def test_hf_padded_batches_differ_on_batch():
    """The negative control: HF left-pads a batch to its longest prompt and seeds one generator per
    padded batch, so a needle's samples change with its neighbours; alone twice it repeats."""
    result = parity.audit("tiny-llama", shared_backend("hf", "tiny-llama", dtype="float32"), case=SMOKE,
                          checks=["repeat", "batch", "order", "seed"])
    assert result.checks["repeat"].identical and result.deterministic
    batch = result.checks["batch"]
    assert not batch.identical and batch.differing_requests > 0 and not result.batch_invariant
    assert batch.first_difference["context"]["batch_size"] in (8, 64)


def test_the_command_writes_json_and_html_and_exits_1_when_not_invariant(tmp_path, capsys):
    out, page = tmp_path / "audit.json", tmp_path / "audit.html"
    code = main(["--model", "tiny-llama", "--backend", "hf", "--dtype", "float32", "--case", SMOKE,
                 "--checks", "repeat,batch", "--json", str(out), "--html", str(page)])
    assert code == 1  # hf is not batch-invariant
    assert "batch-invariant NO" in capsys.readouterr().out
    stored = parity.AuditResult.from_json(out.read_text())
    assert stored.checks["order"].skipped.startswith("not asked for")
    assert page.read_text().startswith("<!DOCTYPE html>") and json.loads(out.read_text())["deterministic"]


@pytest.mark.vllm
@pytest.mark.engine_host
@needs_vllm
def test_vllm_cpu_runs_every_check_on_one_engine():
    """Measured, not asserted: whether vLLM-CPU is deterministic and batch-invariant depends on the
    host's kernels (AVX2 vs AMX); what must hold is that every check ran on the one engine, the
    prefix cache was really bypassed and really served, and the control held."""
    engine = shared_backend("vllm", "tiny-llama")
    result = parity.audit("tiny-llama", engine, case=SMOKE)
    assert all(c.skipped is None for c in result.checks.values()), result.summary_text()
    assert result.control_held and result.checks["batch"].requests == 4
    cache = result.provenance["audit"]["prefix_cache"]
    assert cache["shared_prefix_tokens"] == 2 * engine.meta["block_size"] and cache["cached_tokens"] > 0
    print(result.summary_text())


@pytest.mark.gpu
@needs_cuda
def test_the_reference_engine_is_identical_on_every_check_on_cuda():
    result = parity.audit("tiny-llama", "reference", case=SMOKE, dtype="bfloat16", device="cuda")
    _identical_everywhere(result)


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.own_engines
@needs_cuda
@needs_vllm
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_gpu_vllm_with_batch_invariant_mode_off_and_on(batch_invariant):
    """On: deterministic and batch-invariant (vLLM's batch-invariant kernels). Off: measured (the
    result is printed for docs/PERF.md); every check must still run and the control hold. Each
    engine takes a small share of the GPU and is closed after its audit."""
    with get_backend("vllm", "tiny-llama", dtype="bfloat16", batch_invariant=batch_invariant,
                     engine_kwargs={"gpu_memory_utilization": 0.08}) as engine:
        result = parity.audit("tiny-llama", engine, case=SMOKE, device="cuda")
    print(result.to_json())
    assert result.provenance["backend_meta"]["device"] == "cuda"
    assert result.provenance["backend_meta"]["batch_invariant"] is batch_invariant
    assert all(c.skipped is None for c in result.checks.values()), result.summary_text()
    assert result.control_held
    if batch_invariant:
        assert result.deterministic and result.batch_invariant, result.summary_text()
