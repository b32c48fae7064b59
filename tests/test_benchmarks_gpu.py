"""benchmarks/gpu/ without a GPU: it imports, parses its arguments, renders typed results as its
table, reads back what a child process saved, and restores the settings it changes. Its
measurements need CUDA (run on the GPU machine)."""

from __future__ import annotations

import argparse
import json
import types

import pytest
import torch

pytest.importorskip("triton")

from benchmarks.gpu import results as gpu
from benchmarks.gpu.cli import parse_args
from benchmarks.gpu.records import decoded, plain
from benchmarks.gpu.run import Run, saved_results
from benchmarks.gpu.sections import SECTIONS
from benchmarks.gpu.sections.probe import linear_shapes
from benchmarks.gpu.sections.roofline import e2e_rows, model_shape
from benchmarks.gpu.sections.tp_sim import LINKS, simulate
from benchmarks.gpu.settings import blas_library, module_constants
from benchmarks.gpu.table import table
from benchmarks.gpu.timing import BENCH_M
from benchmarks.gpu.workloads import moe_config, qwen3_config, requests_for, share_experts
from parity.engine.selfcheck import SettingCheck
from parity.kernels import switch


def test_arguments_parse_and_name_only_known_sections():
    args = parse_args([])
    assert args.sections == ["kernels", "parity", "e2e", "cublaslt"]
    assert args.e2e == (256, 256, 512) and args.e2e_variants == ["hf", "invariant", "native"]
    args = parse_args(["--sections", "parity,profile", "--e2e", "8,16,4", "--e2e-variants", "invariant"])
    assert args.sections == ["parity", "profile"] and args.e2e == (8, 16, 4) and args.profile_model == "dense"
    assert parse_args(["--sections", "profile", "--profile-model", "moe"]).profile_model == "moe"
    assert list(SECTIONS) == ["kernels", "parity", "e2e", "profile", "step_split", "cublaslt", "probe",
                                  "attention_sweep", "parity_shapes", "moe_e2e", "probed", "roofline", "tp",
                                  "tp_sim"]
    args = parse_args(["--sections", "probe,moe_e2e,roofline", "--moe", "8,16,4", "--moe-layers", "2"])
    assert args.moe == (8, 16, 4) and args.moe_layers == 2
    assert args.moe_variants == ["hf", "invariant", "native"]
    assert parse_args([]).tp_groups == [8]
    assert parse_args(["--sections", "tp", "--tp-groups", "2,4,8"]).tp_groups == [2, 4, 8]
    assert parse_args(["--moe-layers", "48", "--moe-distinct-layers", "24"]).moe_distinct_layers == 24
    for bad in (["--sections", "parity,kernel"], ["--e2e", "8,16"], ["--e2e-variants", "vllm"],
                ["--tp-groups", "0"], ["--tp-groups", "two"], ["--moe-distinct-layers", "-1"],
                ["--moe-layers", "4", "--moe-distinct-layers", "5"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_shared_experts_grow_a_moe_model_whose_later_layers_read_the_first_ones_experts():
    """A 2-layer MoE grown to 5: layer j's experts are layer j % 2's tensors, its attention, router and
    norms its own copies (equal values), its cache index j; the model runs all 5 layers."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                            num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, vocab_size=100)
    torch.manual_seed(0)
    model = share_experts(Qwen3MoeForCausalLM(config).eval(), 5)
    layers = model.model.layers
    assert len(layers) == 5 and model.config.num_hidden_layers == 5
    for j, layer in enumerate(layers):
        source = layers[j % 2]
        assert layer.mlp.experts.gate_up_proj is source.mlp.experts.gate_up_proj
        assert layer.mlp.experts.down_proj is source.mlp.experts.down_proj
        assert layer.self_attn.layer_idx == j and layer.self_attn.config is model.config
        if j >= 2:
            assert layer.self_attn.q_proj.weight is not source.self_attn.q_proj.weight
            assert torch.equal(layer.self_attn.q_proj.weight, source.self_attn.q_proj.weight)
    calls = []
    for layer in layers:
        layer.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        assert model(torch.tensor([[3, 4, 5]])).logits.shape == (1, 3, 100)
    assert len(calls) == 5


def test_typed_results_render_as_the_table():
    speed = gpu.MatmulSpeed(eager={m: 1.0 for m in BENCH_M}, graph={m: 2.0 * m for m in BENCH_M},
                            host_us={m: 3.0 for m in BENCH_M})
    invariant = gpu.RowInvariance(shape=[6144, 2048], invariant=True, differing_m=[])
    split_k = gpu.RowInvariance(shape=[2048, 6144], invariant=False, differing_m=[1, 2])
    timing = gpu.KernelTiming(triton_ms=1.0, torch_ms=2.0, max_abs_diff=0.0)
    kernels = gpu.KernelsResult(
        triton_invariance=[invariant], cublas_default_invariance=[invariant, split_k],
        cublaslt_nosplitk=gpu.Failure("no probe"),
        matmul={"6144x2048": gpu.MatmulComparison(cublas=speed, triton=speed, plan={"block_m": 128})},
        attention={"decode_256x512": gpu.AttentionTiming(sdpa_ms=0.1, triton_ms=0.2,
                                                         ratio_sdpa_over_triton=0.5, tiles={"m64_n64": 0.2})},
        rmsnorm_65536x2048=timing, log_softmax_256x151936_fp32=timing)
    composition = gpu.CompositionCheck(max_num_seqs=12, chunk_size=64, max_num_batched_tokens=8192,
                                       step_graphs="cuda graphs", tokens_equal_first_composition=True,
                                       train={"right": gpu.LayoutCheck(bitwise_equal=True, max_abs_diff=0.0)})
    grid = gpu.GridCheck(settings=[SettingCheck(1.0, 0.9, 40, 48, 0, 0.0)], tokens=48, differing=0,
                         max_abs_diff=0.0)
    workload = gpu.E2EWorkload(256, 256, 512, "Qwen3-1.7B-shaped", 256, 8192, "Triton")
    results = {
        "kernels": kernels,
        "parity": gpu.ParitySection(
            checks={"tiny-qwen3/invariant": gpu.ParityCheck("invariant", [composition], True),
                    "tiny-qwen3/native": gpu.Failure("Traceback")},
            sampling_grid={"tiny-qwen3": grid}),
        "e2e": gpu.E2ESection(workload, {"engine_invariant": gpu.Throughput(2.0, 100, 50.0, "cuda graphs"),
                                         "hf_generate": gpu.Throughput(4.0, 100, 25.0)}),
        "profile": gpu.ProfileResult("256 seqs", 1.5, 1.0, 9, 0.25, {"_attention_tokens_kernel": 0.5}),
        "step_split": gpu.StepSplit("256 seqs", 6.0, {"scheduler.plan": 0.5}, {"scheduler.plan": 520},
                                    {"256 tokens, max_run 1": 5.5}),
        "moe_e2e": gpu.Failure("Traceback"),
    }
    lines = table(results).splitlines()
    assert "matmul 6144x2048 M=16    triton    32.0 TFLOP/s  cuBLAS    32.0  ratio  1.00" in lines
    assert "cublas_default_invariance: NOT invariant at [[2048, 6144]]" in lines
    assert "attention decode_256x512: triton 0.200 ms  SDPA 0.100 ms  SDPA/triton 0.50" in lines
    assert "sampling grid tiny-qwen3: 0 of 48 tokens differ (max 0.00e+00)" in lines
    assert "parity tiny-qwen3/invariant: rollout vs train_forward bitwise equal: True [cuda graphs]" in lines
    assert "parity tiny-qwen3/native: rollout vs train_forward ERROR" in lines
    assert "e2e engine_invariant: 50 output tok/s (2.0 s) [cuda graphs]" in lines
    assert "e2e hf_generate: 25 output tok/s (4.0 s)" in lines
    assert "e2e ratio engine_invariant / hf_generate: 2.00" in lines
    assert ("profile (256 seqs): wall 1.50 s, GPU busy 1.00 s, idle between kernels 0.25 s; "
            "_attention_tokens_kernel 0.50 s") in lines
    assert "step split (256 seqs): wall 6.00 s" in lines
    assert "  scheduler.plan: 0.500 s over 520 calls" in lines
    assert "  graph 256 tokens, max_run 1: 5.500 ms device" in lines
    assert not any(line.startswith("cublaslt_nosplitk_invariance") for line in lines)
    assert lines[-1] == "moe_e2e: ERROR (see gpu_results.json)"


def test_tp_section_renders_each_group_count_next_to_the_whole_model():
    tp = gpu.TPSection(workload="w", reduction_groups=[2, 8], tp2_skipped="needs two GPUs, 1 visible",
                       rows={"whole_model": gpu.Throughput(1.0, 100, 100.0),
                             "tp1_g2": gpu.Throughput(1.0, 95, 95.0),
                             "tp1_g8": gpu.Throughput(1.0, 70, 70.0)},
                       tp2_equals_tp1={})
    lines = table({"tp": tp}).splitlines()
    assert "tp ratio tp1_g2 / whole_model: 0.950" in lines
    assert "tp ratio tp1_g8 / whole_model: 0.700" in lines
    assert "tp: TP=2 skipped (needs two GPUs, 1 visible)" in lines


def test_tp_sim_counts_what_rank_0_of_two_would_receive_and_renders_it():
    # tiny-qwen3 (2 layers, hidden 128, vocab 512), float32 on the CPU (no graphs, so no padding): one
    # prefill of 4 x 8 tokens, then 5 decode steps of 4; each forward gathers the embedding rows, two
    # [T, hidden] fp32 partials per layer (each the sum of the rank's 4 groups), and the sampled rows'
    # half of the vocabulary
    row = simulate("tiny-qwen3", 8, requests_for(512, 4, 8, 6), 8, 64, device="cpu", dtype="float32")
    forwards, tokens = [32, 4, 4, 4, 4, 4], [4] * 6
    expected = sum(t * 128 * 4 + 2 * 2 * (t * 128 * 4) + rows * 256 * 4
                   for t, rows in zip(forwards, tokens, strict=True))
    assert (row.received_bytes, row.collectives, row.output_tokens) == (expected, 6 * (1 + 2 * 2 + 1), 24)
    assert all(0 < rate < row.output_tokens / row.rank_seconds for rate in row.projected_tp2_tok_s.values())
    shown = table({"tp_sim": gpu.TPSimSection("w", list(LINKS), {"g8": row})})
    assert shown.startswith("tp_sim g8 (w): rank alone") and "nvlink_nccl" in shown


def test_changed_settings_are_restored_when_a_measurement_fails():
    before = torch.backends.cuda.preferred_blas_library()
    module = types.SimpleNamespace(BLOCK_M=64, BLOCK_N=64)
    cumsum = switch.registrations("cpu")[("softmax", "cumsum", "cpu")]
    stock = lambda x: torch.cumsum(x, -1)  # noqa: E731
    with (pytest.raises(RuntimeError), blas_library("cublaslt"), module_constants(module, BLOCK_M=16),
          switch.replaced("softmax", "cumsum", "cpu", stock)):
        assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
        assert (module.BLOCK_M, module.BLOCK_N) == (16, 64)
        assert switch.registrations("cpu")[("softmax", "cumsum", "cpu")] is stock
        raise RuntimeError("a failed measurement")
    assert torch.backends.cuda.preferred_blas_library() == before
    assert (module.BLOCK_M, module.BLOCK_N) == (64, 64)
    assert switch.registrations("cpu")[("softmax", "cumsum", "cpu")] is cumsum


def test_roofline_of_the_dense_workload_is_the_bound_worked_out_by_hand():
    """Qwen3-1.7B-shaped, 256 x 256 x 512 at 4.3 TB/s and 760 TFLOP/s: weights 3.4 GB and ~15 GB
    of KV per late step put the bound near 50,000 output tok/s (the figure of the design notes)."""
    from benchmarks.roofline import bound

    shape = model_shape(qwen3_config(28))
    assert 1.5e9 < shape.dense_params < 2.1e9 and shape.expert_params == 0
    assert shape.kv_bytes_per_token == 2 * 28 * 8 * 128 * 2
    b = bound(shape, 256, 256, 512, bandwidth=4.3e12, flops=7.6e14)
    assert 35_000 < b.output_tok_s < 65_000 and b.output_tokens == 256 * 512
    assert b.seconds == b.prefill_s + b.decode_s
    slower = bound(shape, 256, 256, 512, bandwidth=2.15e12, flops=7.6e14)
    assert slower.decode_s > 1.9 * b.decode_s * 0.9  # decode is bandwidth-bound at this batch


def test_roofline_of_moe_counts_only_the_experts_a_step_touches():
    from benchmarks.roofline import ModelShape

    shape = model_shape(moe_config(2))
    assert shape.experts == 128 and shape.top_k == 8 and shape.expert_params == 2 * 128 * 3 * 2048 * 768
    assert shape.active_params() == shape.dense_params + shape.expert_params * 8 / 128
    assert shape.touched_params(1) == shape.active_params()
    assert shape.touched_params(256) > 0.99 * (shape.dense_params + shape.expert_params)
    with pytest.raises(ValueError):
        ModelShape(dense_params=1, expert_params=1, experts=4, top_k=5, layers=1, q_heads=1, kv_heads=1,
                   head_dim=1)


def test_linear_shapes_of_two_families_come_from_their_configs():
    qwen = linear_shapes("qwen3-1.7b")
    llama = linear_shapes("llama-3.2-1b")
    assert (151936, 2048, False) in qwen and (6144, 2048, False) in qwen
    assert (8192, 2048, False) in llama and (2048, 8192, False) in llama and (128256, 2048, False) in llama


def _throughput(tok_s: float, graphs: str | None = None) -> gpu.Throughput:
    return gpu.Throughput(100 / tok_s, 100, tok_s, graphs)


def test_probe_sweep_moe_probed_and_roofline_sections_render_as_the_table():
    speed = gpu.MatmulSpeed(eager={1: 1.0}, graph={1: 2.0}, host_us={1: 3.0})
    workload = gpu.E2EWorkload(256, 256, 512, "Qwen3-30B-A3B-shaped", 256, 8192, "Triton")
    results = {
        "probe": gpu.ProbeResult(env={}, cublaslt_ready=True, families={"qwen3-1.7b": gpu.ProbedFamily(
            probe_cold_s=1.5, probe_cached_s=0.01,
            routes={"2048x2048": ("cublaslt", "probed"), "128x2048+bias": ("triton", "has a bias")},
            spot_check=[gpu.RowInvariance([2048, 2048], True, [])],
            tflops_graph={"2048x2048": gpu.RoutedSpeed(routed=speed, triton=speed)})}),
        "attention_sweep": gpu.AttentionSweep(
            shipped={"decode": "m64_n64_w4_s3"}, timing="", workload={}, sdpa_decode_ms=0.13,
            sdpa_prefill_ms=0.4, flash_prefill_ms=0.5, baseline_decode_ms=0.3, baseline_prefill_ms=0.6,
            baseline_note="",
            shipped_pair=gpu.ShippedPair(decode_ms=0.125, decode_runs_ms=0.134, prefill_ms=0.45,
                                         decode_equals_prefill=True, decode_runs_equals_prefill=True),
            decode_repeats_ms=[gpu.DecodeRepeat(sdpa=0.13, decode_launch=0.125, run_kernel=0.134)],
            plans={"m64_n64_w4_s2": gpu.PlanResult(0.2, 1.0, 0.5, 0.25, True, True),
                   "m16_n64_w4_s3": gpu.Failure("Traceback")},
            cross_decode_equals_prefill={}),
        "moe_e2e": gpu.MoESection(workload, 512, 3.0, {"hf_generate": gpu.Throughput(4.0, 100, 25.0)}),
        "probed": gpu.ProbedSection(
            parity_shapes=None, profile=None, step_split=None, stderr="",
            moe_e2e=gpu.MoESection(workload, 512, 3.0, {"engine_invariant_routes": _throughput(100.0)}),
            e2e=gpu.E2ESection(workload, {"engine_invariant": _throughput(100.0, "cuda graphs")})),
        "roofline": gpu.RooflineResult(peaks={}, shapes={}, bounds={}, rows={
            "moe hf_generate": gpu.RooflineRow(output_tok_s=25.0, bound_tok_s=100.0,
                                               fraction_of_bound=0.25)}),
    }
    lines = table(results).splitlines()
    assert ("probe qwen3-1.7b: 1 of 2 shapes on cuBLASLt, spot check row-invariant, probe 1.50 s cold / "
            "0.010 s cached") in lines
    assert "  2048x2048 routed/triton TFLOP/s: M=1 2/2" in lines
    assert ("attention plan m64_n64_w4_s2: decode 0.200 ms (SDPA/plan 0.50)  prefill 1.000 ms (flash/plan "
            "0.25)  decode==prefill True  chunked==prefill True") in lines
    assert "attention plan m16_n64_w4_s3: ERROR" in lines
    assert ("  decode repeat: SDPA 0.1300 ms, decode launch 0.1250 ms (1.040x), run kernel 0.1340 ms "
            "(0.970x)") in lines
    assert "moe hf_generate: 25 output tok/s (4.0 s)" in lines
    assert "moe [probed] engine_invariant_routes: 100 output tok/s (1.0 s)" in lines
    assert "e2e [probed] engine_invariant: 100 output tok/s (1.0 s) [cuda graphs]" in lines
    assert "roofline moe hf_generate: 25 of 100 tok/s bound (25%)" in lines


def test_e2e_rows_collect_every_finished_row_by_workload():
    workload = gpu.E2EWorkload(1, 1, 1, "m", 1, 1, "Triton")
    results = {"e2e": gpu.E2ESection(workload, {"engine_native": _throughput(1.0)}),
               "probed": gpu.ProbedSection(
                   parity_shapes=None, profile=None, step_split=None, stderr="",
                   e2e=gpu.E2ESection(workload, {"engine_invariant": _throughput(2.0)}),
                   moe_e2e=gpu.MoESection(workload, 1, 1.0, {"engine_invariant": gpu.Failure("x")})),
               "moe_e2e": gpu.MoESection(workload, 1, 1.0, {"hf_generate": _throughput(3.0)})}
    rows = e2e_rows(results)
    assert {k: v[0] for k, v in rows.items()} == {"dense engine_native": "dense",
                                                   "dense[probed] engine_invariant": "dense",
                                                   "moe hf_generate": "moe"}


def test_a_child_runs_saved_sections_come_back_typed(tmp_path):
    """What a child process (cublaslt, probed) saves is read back as the typed results the table
    reads: int keys, tuples and nested dataclasses restored, a failed section or row as a Failure,
    the run's own keys ignored, and a record of another shape refused as unreadable."""
    args = argparse.Namespace(out=tmp_path)
    run = Run(args, tmp_path, {"device": "H200"})
    workload = gpu.E2EWorkload(8, 16, 4, "m", 16, 8192, "Triton")
    e2e = gpu.E2ESection(workload, {"engine_invariant": _throughput(50.0, "cuda graphs"),
                                    "engine_native": gpu.Failure("Traceback")})
    run.checkpoint("e2e", gpu.E2ESection(workload, {}))
    run.finish("e2e", e2e, 2.5)
    run.checkpoint("step_split", {"workload": "partial"})
    run.finish("step_split", gpu.Failure("raised"), 1.0)
    speed = gpu.MatmulSpeed(eager={1: 1.0, 16: 2.0}, graph={1: 2.0, 16: 4.0}, host_us={1: 3.0, 16: 3.0})
    family = gpu.ProbedFamily(1.0, 0.1, {"2048x2048": ("cublaslt", "probed")},
                              [gpu.RowInvariance([2, 2], True, [])],
                              {"2048x2048": gpu.RoutedSpeed(speed, speed)})
    saved = saved_results(tmp_path)
    assert saved["device"] == "H200" and saved["e2e"]["section_seconds"] == 2.5
    assert saved["step_split"] == {"workload": "partial", "error": "raised", "section_seconds": 1.0}
    assert decoded(gpu.E2ESection, saved["e2e"]) == e2e
    assert decoded(gpu.StepSplit, saved["step_split"]) == gpu.Failure("raised")
    probe = gpu.ProbeResult(env={"A": None}, cublaslt_ready=True, families={"qwen3-1.7b": family})
    assert decoded(gpu.ProbeResult, json.loads(json.dumps(plain(probe)))) == probe
    unreadable = decoded(gpu.E2ESection, {"engine_invariant": {"output_tok_s": 1.0}})
    assert isinstance(unreadable, gpu.Failure) and "unreadable E2ESection" in unreadable.error
