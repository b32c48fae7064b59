"""LoRA on CUDA: rollout == training forward bit for bit with an adapter (dense and MoE, eager and
CUDA-graph steps, across run-time swaps), and the adapter's float32 products on the Triton linear.

The products' tests also run without a GPU, on CPU tensors under Triton's interpreter in a child
process (tests/interpreter.py), so the adapter shapes (K = r = 8 or 64 float32 columns, smaller
than a tile) are exercised in CI; the engine tests need an NVIDIA GPU (`gpu` marker; the lead runs
them on the H200: `.venv/bin/python -m pytest tests/test_lora_gpu.py -q`).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from interpreter import run_interpreted

from parity import Request, SamplingParams
from parity.engine import ReferenceEngine, train_forward

pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (CUDA not available)")
#: tests of this file that run under the interpreter.
MIN_INTERPRETED = 4
CASES = [("tiny-llama-lora-r8", "tiny-llama"), ("tiny-qwen3-lora-r64", "tiny-qwen3"),
         ("tiny-qwen3-moe-lora-r8", "tiny-qwen3-moe"), ("tiny-mixtral-lora-r64", "tiny-mixtral")]


@pytest.mark.skipif(CUDA or INTERPRETED, reason="the product tests run in this process")
@pytest.mark.slow
def test_adapter_products_under_the_triton_interpreter_in_a_child_process() -> None:
    run_interpreted(__file__, min_passed=MIN_INTERPRETED, timeout=600)


@pytest.fixture(scope="module")
def tk() -> ModuleType:
    if not (CUDA or INTERPRETED):
        pytest.skip("no GPU: run by test_adapter_products_under_the_triton_interpreter_in_a_child_process")
    return importlib.import_module("parity.kernels.triton.matmul")


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


POOL = 96
compositions = st.lists(st.integers(0, POOL - 1), min_size=1, max_size=POOL)


@pytest.mark.parametrize("rank", [8, 64])
def test_adapter_products_match_float64(tk: ModuleType, rank: int) -> None:
    """h = x A^T and d = h B^T in float32 (IEEE products, no TF32) for A [r, 128], B [256, r]."""
    x, a, b = _randn(40, 128, seed=0), _randn(rank, 128, seed=1) * 0.1, _randn(256, rank, seed=2) * 0.1
    h = tk.linear(x, a)
    d = tk.linear(h, b)
    want = (x.double() @ a.double().T) @ b.double().T
    assert h.dtype == d.dtype == torch.float32
    assert float((d.double() - want).abs().max()) < 1e-4


@pytest.mark.parametrize("rank", [8, 64])
@settings(max_examples=8)
@given(rows=compositions)
def test_adapter_products_are_row_invariant(tk: ModuleType, rank: int, rows: list[int]) -> None:
    pool, a, b = _randn(POOL, 128, seed=3), _randn(rank, 128, seed=4), _randn(256, rank, seed=5)
    alone = tk.linear(tk.linear(pool, a), b)
    batch = tk.linear(tk.linear(pool[rows], a), b)
    assert torch.equal(batch, alone[rows])


# -- the engine on CUDA ------------------------------------------------------------------------------


def _requests(count: int = 5) -> list[Request]:
    return [Request(tuple(range(3 + i, 3 + i + 4 * i + 3)), SamplingParams(n=2, max_tokens=12, seed=i,
                                                                           temperature=1.0), str(i))
            for i in range(count)]


@gpu
@needs_cuda
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize(("adapter", "model"), CASES)
def test_cuda_rollout_equals_train_forward_bitwise_with_adapter(adapter: str, model: str,
                                                                graphs: bool) -> None:
    for max_num_seqs, chunk_size in ((1, 3), (4, 8), (16, 64)):
        with ReferenceEngine(model, device="cuda", dtype="bfloat16", lora=adapter, graphs=graphs,
                             max_num_seqs=max_num_seqs, chunk_size=chunk_size) as engine:
            rollouts = engine.generate(_requests())
        for layout, micro in (("right", None), ("left", 3), ("packed", 2)):
            scored = train_forward(model, rollouts, device="cuda", dtype="bfloat16", layout=layout,
                                   micro_batch_size=micro).logprobs
            for rollout, score in zip(rollouts, scored, strict=True):
                assert torch.equal(score.cpu(), torch.tensor(rollout.logprobs, dtype=torch.float32))


@gpu
@needs_cuda
def test_cuda_graphs_follow_a_swap(tmp_path) -> None:
    """The first swap gives the engine its own copy of the adapter's tensors (the graphs captured
    the shared ones: capture again); later swaps of the same scaling write into the captured
    tensors (the graphs stay); one of another lora_alpha recaptures; each time the engine gives a
    fresh engine's bits."""
    from test_lora import step_adapter

    first = step_adapter(tmp_path, "tiny-qwen3-lora-r8", seed=2, directory="first")
    same = step_adapter(tmp_path, "tiny-qwen3-lora-r8", seed=3, directory="same")
    other = step_adapter(tmp_path, "tiny-qwen3-lora-r8", seed=4, alpha=48, directory="other")
    with ReferenceEngine("tiny-qwen3", device="cuda", dtype="bfloat16", lora="tiny-qwen3-lora-r8") as engine:
        engine.generate(_requests())
        shared = engine._graphs
        assert shared is not None and shared.status == "cuda graphs"
        engine.load_adapter(first)
        engine.generate(_requests())
        graphs = engine._graphs
        assert graphs is not None and graphs is not shared
        engine.load_adapter(same)
        after_same = engine.generate(_requests())
        assert engine._graphs is graphs
        engine.load_adapter(other)
        after_other = engine.generate(_requests())
        assert engine._graphs is not graphs
    for path, got in ((same, after_same), (other, after_other)):
        with ReferenceEngine("tiny-qwen3", device="cuda", dtype="bfloat16", lora=str(path)) as fresh:
            want = fresh.generate(_requests())
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert [r.logprobs for r in got] == [r.logprobs for r in want]


@gpu
@needs_cuda
def test_cuda_shaped_model_with_a_rank_64_adapter_is_bitwise(tmp_path) -> None:
    """A Qwen3-1.7B-shaped model (2 layers, random weights) with a rank-64 adapter on every projection."""
    from parity.models import shaped
    from parity.models.lora_builtins import adapter_config, adapter_weights, write_adapter

    path = shaped.save_random_model(shaped.shaped_config("qwen3-1.7b", 2), tmp_path / "model")
    from parity.core.schema import LORA_TARGETS

    lora = write_adapter(tmp_path / "adapter", adapter_config("shaped", 64, 16, True, LORA_TARGETS),
                         adapter_weights(path, 64, 2.0, LORA_TARGETS, seed=0))
    requests = [Request(tuple(range(1000 + 7 * i, 1000 + 7 * i + 20 + 9 * i)),
                        SamplingParams(n=2, max_tokens=16, seed=i, temperature=1.0), str(i))
                for i in range(6)]
    with ReferenceEngine(str(path), device="cuda", dtype="bfloat16", lora=str(lora), max_num_seqs=8,
                         chunk_size=16) as engine:
        rollouts = engine.generate(requests)
    scored = train_forward(str(path), rollouts, device="cuda", dtype="bfloat16", layout="packed").logprobs
    for rollout, score in zip(rollouts, scored, strict=True):
        assert torch.equal(score.cpu(), torch.tensor(rollout.logprobs, dtype=torch.float32))
