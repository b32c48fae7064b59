"""SGLang on a real GPU: servers parity starts (`launch_server=True`) with the training forward on the
same GPU.

Dense and MoE comparisons with both sides on CUDA; raw and processed logprobs; multi-turn
trajectories; R3 through SGLang's own routed-expert return; SGLang's deterministic mode, which must
give the same bits for a request alone and inside a batch. Three servers in all (a start takes
about a minute): the dense raw one runs deterministic mode and serves the raw, multi-turn and
batch tests; the processed and MoE ones serve one test each. The dense model has the Qwen3-1.7B
shape with 2 layers (the kernels of the benchmarks' 28-layer model, compiled once per machine).
Skipped without a GPU and without PARITY_SGLANG_PYTHON (a Python with SGLang; on the lent H200s
`tools/h200_sglang.sh` sets it and `python3 -m benchmarks.gpu_sglang --sections tests` runs this
file). Each server takes a small memory share (`SERVER`) and is stopped by its fixture or `with`
block.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import parity
from parity.backends import get_backend
from parity.core.turns import Generate, Inject
from parity.core.types import Request, SamplingParams

pytestmark = [
    pytest.mark.gpu, pytest.mark.sglang, pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)"),
    pytest.mark.skipif(not os.environ.get("PARITY_SGLANG_PYTHON"),
                       reason="PARITY_SGLANG_PYTHON is not set: name a Python with SGLang's GPU build "
                              "(on the lent H200s: bash tools/h200_sglang.sh run --sections tests)"),
]

#: flags of every server here: Triton attention and PyTorch sampling (what the H200 parts carry),
#: a small memory share and few CUDA graphs (quick start).
SERVER = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--mem-fraction-static", "0.1",
          "--cuda-graph-max-bs", "16", "--random-seed", "0"]
SAMPLING = SamplingParams(n=2, temperature=1.0, max_tokens=24, seed=11, ignore_eos=True, logprobs_mode="raw")
PROMPTS = [[1, 40 + i, 41, 42, 43 + i, 44, 45] for i in range(6)]


def _model(tmp: Path, shape: str) -> str:
    from parity.models.shaped import save_random_model, shaped_config

    return str(save_random_model(shaped_config(shape, 2), tmp / shape))


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> str:
    return _model(tmp_path_factory.mktemp("models"), "qwen3-1.7b")


@pytest.fixture(scope="module")
def engine(dense):
    """The dense raw server, in deterministic mode (--enable-deterministic-inference)."""
    with get_backend("sglang", dense, dtype="bfloat16", logprobs_mode="raw", launch_server=True,
                     server_args=[*SERVER, "--enable-deterministic-inference"]) as backend:
        yield backend


def _compare(model: str, backend, **kwargs):
    return parity.compare(model, backend, prompts=PROMPTS, sampling=kwargs.pop("sampling", SAMPLING),
                          dtype="bfloat16", device="cuda", **kwargs)


def test_raw_compare_runs_against_the_training_forward_on_the_gpu(dense, engine) -> None:
    report = _compare(dense, engine)
    assert report.provenance["train_device"] == "cuda" and engine.meta["backend_version"].startswith("0.5")
    assert report.summary["num_tokens"] == len(PROMPTS) * 2 * 24
    assert 0 < report.summary["max_abs_logprob_diff"] < 1.0


def test_processed_logprobs_on_the_gpu(dense) -> None:
    with get_backend("sglang", dense, dtype="bfloat16", logprobs_mode="processed", launch_server=True,
                     server_args=SERVER) as processed:
        report = _compare(dense, processed,
                          sampling=SAMPLING.replace(temperature=0.8, logprobs_mode="processed"))
    assert processed.meta["sglang_return_original_logprob"] == "0"
    assert 0 < report.summary["max_abs_logprob_diff"] < 1.0


def test_multi_turn_trajectories_on_the_gpu(dense, engine) -> None:
    report = parity.compare(dense, engine, prompts=PROMPTS[:3], sampling=SAMPLING.replace(max_tokens=30),
                            turns=[Generate(8), Inject([50, 51, 52]), Generate(8)], dtype="bfloat16",
                            device="cuda")
    assert "by_turn" in report.breakdowns and report.summary["num_tokens"] > 0


def test_deterministic_mode_gives_the_same_bits_alone_and_in_a_batch(engine) -> None:
    """--enable-deterministic-inference: seeded samples repeat, alone and among other requests."""
    assert engine.meta["batch_invariant"] is True
    needle = Request(tuple(PROMPTS[0]), SAMPLING.replace(n=1), "needle")
    alone = engine.generate_uncached([needle])[0]
    crowd = [Request(tuple(p * 3), SAMPLING.replace(n=1, seed=99 + i), f"other{i}")
             for i, p in enumerate(PROMPTS)]
    batched = next(r for r in engine.generate_uncached([*crowd, needle]) if r.request_id == "needle")
    assert alone.token_ids == batched.token_ids and alone.logprobs == batched.logprobs
    # the control: another seed samples other tokens, so equal bits above are not a stuck sampler
    reseeded = engine.generate_uncached([Request(tuple(PROMPTS[0]), SAMPLING.replace(n=1, seed=12), "x")])[0]
    assert reseeded.token_ids != alone.token_ids


def test_r3_replays_the_routes_sglang_returns(tmp_path) -> None:
    moe = _model(tmp_path, "moe-64x8")
    with get_backend("sglang", moe, dtype="bfloat16", logprobs_mode="raw", launch_server=True,
                     server_args=SERVER, return_routed_experts=True) as engine:
        report = _compare(moe, engine, router_replay="R3")
    sides = report.extras["router"]["sides"]
    assert set(sides) == {"none", "R3"} and 0.0 < report.summary["router_agreement"] <= 1.0
    assert sides["R3"]["drift"]["mean_abs_logprob_diff"] <= sides["none"]["drift"]["mean_abs_logprob_diff"]
