"""benchmarks/gpu.py without a GPU: it imports, parses its arguments, renders typed results as its
table, and restores the settings it changes. Its measurements need CUDA (run on the GPU machine)."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("triton")

from benchmarks import gpu
from parity.engine.selfcheck import SettingCheck
from parity.kernels import switch


def test_arguments_parse_and_name_only_known_sections():
    args = gpu.parse_args([])
    assert args.sections == ["kernels", "parity", "e2e", "cublaslt"]
    assert args.e2e == (256, 256, 512) and args.e2e_variants == ["hf", "invariant", "native"]
    args = gpu.parse_args(["--sections", "parity,profile", "--e2e", "8,16,4", "--e2e-variants", "invariant"])
    assert args.sections == ["parity", "profile"] and args.e2e == (8, 16, 4)
    assert list(gpu.SECTIONS) == ["kernels", "parity", "e2e", "profile", "cublaslt"]
    for bad in (["--sections", "parity,kernel"], ["--e2e", "8,16"], ["--e2e-variants", "vllm"]):
        with pytest.raises(SystemExit):
            gpu.parse_args(bad)


def test_typed_results_render_as_the_table():
    speed = gpu.MatmulSpeed(eager={m: 1.0 for m in gpu.BENCH_M}, graph={m: 2.0 * m for m in gpu.BENCH_M},
                            host_us={m: 3.0 for m in gpu.BENCH_M})
    invariant = gpu.RowInvariance(shape=[6144, 2048], invariant=True, differing_m=[])
    split_k = gpu.RowInvariance(shape=[2048, 6144], invariant=False, differing_m=[1, 2])
    timing = gpu.KernelTiming(triton_ms=1.0, torch_ms=2.0, max_abs_diff=0.0)
    kernels = gpu.KernelsResult(
        triton_invariance=[invariant], cublas_default_invariance=[invariant, split_k],
        cublaslt_nosplitk={"error": "no probe"},
        matmul={"6144x2048": gpu.MatmulComparison(cublas=speed, triton=speed, plan={"block_m": 128})},
        attention={"decode_256x512": gpu.AttentionTiming(sdpa_ms=0.1, triton_ms=0.2,
                                                         ratio_sdpa_over_triton=0.5, tiles={"m64_n64": 0.2})},
        rmsnorm_65536x2048=timing, log_softmax_256x151936_fp32=timing)
    composition = gpu.CompositionCheck(max_num_seqs=12, chunk_size=64, max_num_batched_tokens=8192,
                                       step_graphs="cuda graphs", tokens_equal_first_composition=True,
                                       train={"right": gpu.LayoutCheck(bitwise_equal=True, max_abs_diff=0.0)})
    grid = gpu.GridCheck(settings=[SettingCheck(1.0, 0.9, 40, 48, 0, 0.0)], tokens=48, differing=0,
                         max_abs_diff=0.0)
    results = {
        "kernels": gpu.plain(kernels),
        "parity": gpu.plain({"tiny-qwen3/invariant": gpu.ParityCheck("invariant", [composition], True),
                             "tiny-qwen3/native": {"error": "Traceback"},
                             "sampling_grid": {"tiny-qwen3": grid}}),
        "e2e": gpu.plain({"engine_invariant": gpu.Throughput(2.0, 100, 50.0, "cuda graphs"),
                          "hf_generate": gpu.Throughput(4.0, 100, 25.0)}),
        "profile": gpu.plain(gpu.ProfileResult("256 seqs", 1.5, 1.0, 9)),
    }
    lines = gpu.table(results).splitlines()
    assert "matmul 6144x2048 M=16    triton    32.0 TFLOP/s  cuBLAS    32.0  ratio  1.00" in lines
    assert "cublas_default_invariance: NOT invariant at [[2048, 6144]]" in lines
    assert "attention decode_256x512: triton 0.200 ms  SDPA 0.100 ms  SDPA/triton 0.50" in lines
    assert "sampling grid tiny-qwen3: 0 of 48 tokens differ (max 0.00e+00)" in lines
    assert "parity tiny-qwen3/invariant: rollout vs train_forward bitwise equal: True [cuda graphs]" in lines
    assert "parity tiny-qwen3/native: rollout vs train_forward ERROR" in lines
    assert "e2e engine_invariant: 50 output tok/s (2.0 s) [cuda graphs]" in lines
    assert "e2e hf_generate: 25 output tok/s (4.0 s)" in lines
    assert "e2e ratio engine_invariant / hf_generate: 2.00" in lines
    assert "profile (256 seqs): wall 1.50 s, GPU busy 1.00 s" in lines


def test_changed_settings_are_restored_when_a_measurement_fails():
    before = torch.backends.cuda.preferred_blas_library()
    module = types.SimpleNamespace(BLOCK_M=64, BLOCK_N=64)
    cumsum = switch._registry[("softmax", "cumsum", "cpu")]
    stock = lambda x: torch.cumsum(x, -1)  # noqa: E731
    with (pytest.raises(RuntimeError), gpu.blas_library("cublaslt"), gpu.module_constants(module, BLOCK_M=16),
          gpu.kernel_override("softmax", "cumsum", "cpu", stock)):
        assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
        assert (module.BLOCK_M, module.BLOCK_N) == (16, 64)
        assert switch._registry[("softmax", "cumsum", "cpu")] is stock
        raise RuntimeError("a failed measurement")
    assert torch.backends.cuda.preferred_blas_library() == before
    assert (module.BLOCK_M, module.BLOCK_N) == (64, 64)
    assert switch._registry[("softmax", "cumsum", "cpu")] is cumsum
