"""The one script for the GPU machine: invariance checks, kernel microbenchmarks, end-to-end throughput.

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu.py --out $OUT [--sections kernels,parity,e2e,profile,cublaslt]

Sections (each runs independently; a failure is recorded and the next section still runs):
- kernels: bitwise row invariance of the Triton linear at Qwen3-1.7B weight shapes over many M,
  the same probe for cuBLASLt with split-K disabled (in a subprocess with its env) and for
  default cuBLAS (the negative control); matmul TFLOP/s vs cuBLAS at M in {1, 16, 256, 4096},
  eager and from CUDA-graph replay, with the host launch cost; attention decode/prefill vs
  SDPA; RMSNorm and log-softmax vs torch.
- parity: reference engine rollouts vs `train_forward(kernels="invariant")` on CUDA, bit for
  bit, over several batch compositions (dense and MoE, bf16; the default engine, which replays
  CUDA graphs for dense models, the eager engine, and a tiny token budget), and the
  native-kernel negative control; then the sampling grid (temperature x top_p x top_k,
  `parity.engine.selfcheck`) on random-weight models with vocabularies 32,000 and 151,936,
  dense and MoE, counting differing tokens per setting.
- e2e: output tok/s of (a) the reference engine with invariant kernels, (b) the same engine with
  native kernels, (c) transformers `generate`, on a Qwen3-1.7B-shaped bf16 model with random
  weights, side by side in one run.
- profile: torch.profiler over a few decode steps of the invariant engine ($OUT/profile.txt).
- cublaslt: parity and (a) again in a subprocess started with `CUBLASLT_ENV` and cuBLASLt
  preferred, so the matmul takes the proven cuBLASLt path (`parity.kernels.triton.matmul`).

Full numbers go to $OUT/gpu_results.json; the short table is printed last.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from parity.engine.selfcheck import sampling_grid_check  # noqa: E402
from parity.kernels.triton.matmul import CUBLASLT_ENV, cublaslt_ready  # noqa: E402
from parity.models import shaped  # noqa: E402
from parity.models.shaped import shaped_config  # noqa: E402

#: Qwen3-1.7B linear weights [N, K]: q, k/v, o, gate/up, down, lm_head.
QWEN3_LINEARS = [(2048, 2048), (1024, 2048), (6144, 2048), (2048, 6144), (151936, 2048)]
INVARIANCE_M = [1, 2, 3, 7, 16, 31, 64, 100, 255, 256, 1000, 2047, 4096]
BENCH_M = [1, 16, 256, 4096]
#: engine settings of the parity section: (max_num_seqs, chunk_size, max_num_batched_tokens, graphs).
COMPOSITIONS = [(12, 64, 8192, None), (3, 5, 8192, None), (5, 7, 8192, False), (4, 9, 6, None)]


def bench(fn: Callable[[], Any]) -> float:
    """Median milliseconds of fn (triton's do_bench: CUDA events, L2 flushed between runs)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def rotating(fn: Callable[..., Any], arg_sets: list[tuple]) -> Callable[[], Any]:
    """fn over several input sets in turn, so repeated calls do not all hit the same L2 lines."""
    cycle = itertools.cycle(arg_sets)
    return lambda: fn(*next(cycle))


def rows_invariant(linear: Callable[..., torch.Tensor], n: int, k: int) -> dict[str, Any]:
    """Whether linear(x[:m]) == linear(x)[:m] bitwise for every m in INVARIANCE_M."""
    g = torch.Generator("cuda").manual_seed(n * 7 + k)
    x = torch.randn(max(INVARIANCE_M), k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(torch.bfloat16)
    full = linear(x, w)
    differing = [m for m in INVARIANCE_M if not torch.equal(linear(x[:m], w), full[:m])]
    return {"shape": [n, k], "invariant": not differing, "differing_m": differing}


def graph_ms(fn: Callable[..., Any], arg_sets: list[tuple]) -> float:
    """Median device milliseconds per call of fn, replayed from one CUDA graph over all arg sets
    (no host launch cost: the kernel's own time)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for args in arg_sets:
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in arg_sets:
            fn(*args)
    graph.replay()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / (10 * len(arg_sets)))
    return sorted(times)[len(times) // 2]


def host_us(fn: Callable[..., Any], args: tuple) -> float:
    """Host microseconds to enqueue one call (the launch overhead a decode step pays per linear)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        fn(*args)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / 200 * 1e6


def matmul_tflops(linear: Callable[..., torch.Tensor], n: int, k: int, ms: list[int]) -> dict[str, Any]:
    """TFLOP/s of linear at each M, eager (do_bench) and from a CUDA graph, rotating over 4 weight
    copies (4 x a 2048x6144 weight > L2), plus the host launch cost."""
    out: dict[str, Any] = {"eager": {}, "graph": {}, "host_us": {}}
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(4)]
    for m in ms:
        sets = list(zip([torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)], weights))
        flop = 2 * m * n * k
        out["eager"][m] = flop / bench(rotating(linear, sets)) / 1e9
        out["graph"][m] = flop / graph_ms(linear, sets) / 1e9
        out["host_us"][m] = host_us(linear, sets[0])
    return out


def cublaslt_probe() -> dict[str, Any]:
    """Run in a subprocess started with CUBLASLT_ENV: row invariance and speed of cuBLASLt, no split-K."""
    torch.backends.cuda.preferred_blas_library("cublaslt")
    res: dict[str, Any] = {"env": {k: os.environ.get(k) for k in CUBLASLT_ENV}}
    res["invariance"] = [rows_invariant(F.linear, n, k) for n, k in QWEN3_LINEARS]
    res["tflops"] = {
        f"{n}x{k}": matmul_tflops(F.linear, n, k, BENCH_M) for n, k in [(6144, 2048), (2048, 6144)]
    }
    return res


def kernels_section(results: dict[str, Any]) -> None:
    from parity.kernels.triton import attention, linear, log_softmax, rms_norm
    from parity.kernels.triton import matmul as mm

    attn_mod = importlib.import_module("parity.kernels.triton.attention")  # the package exports the function

    sec: dict[str, Any] = {}
    results["kernels"] = sec
    sec["triton_invariance"] = [rows_invariant(linear, n, k) for n, k in QWEN3_LINEARS]
    sec["cublas_default_invariance"] = [rows_invariant(F.linear, n, k) for n, k in QWEN3_LINEARS]
    env = {**os.environ, **CUBLASLT_ENV}
    probe = subprocess.run(
        [sys.executable, __file__, "--cublaslt-probe"], env=env, capture_output=True, text=True, timeout=300
    )
    try:
        sec["cublaslt_nosplitk"] = json.loads(probe.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        sec["cublaslt_nosplitk"] = {"error": probe.stderr[-3000:]}

    # matmul: the shipped plan vs default cuBLAS (cuBLASLt without split-K: the probe above)
    sec["matmul"] = {}
    for n, k in [(6144, 2048), (2048, 6144)]:
        entry = {
            "cublas": matmul_tflops(F.linear, n, k, BENCH_M),
            "triton": matmul_tflops(linear, n, k, BENCH_M),
            "plan": vars(mm.tile_config(torch.bfloat16, n, k)),
        }
        sec["matmul"][f"{n}x{k}"] = entry

    # attention: decode (256 seqs at context 512) and prefill (256 x 256 tokens), Qwen3-1.7B heads;
    # the shipped tiles (BLOCK_M query rows, BLOCK_N keys) and, for the record, other sizes
    hq, hkv, d, cap = 16, 8, 128, 1024
    kc = torch.randn(256, hkv, cap, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(256, hkv, cap, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(256, hq, d, device="cuda", dtype=torch.bfloat16)
    qp = torch.randn(256 * 256, hq, d, device="cuda", dtype=torch.bfloat16)
    cases = {
        "decode_256x512": (q, torch.arange(256, device="cuda"), torch.full((256,), 511, device="cuda")),
        "prefill_256x256": (
            qp,
            torch.arange(256, device="cuda").repeat_interleave(256),
            torch.arange(256, device="cuda").repeat(256),
        ),
    }
    kd, vd = kc[:, :, :512].contiguous(), vc[:, :, :512].contiguous()
    qs = qp.view(256, 256, hq, d).transpose(1, 2).contiguous()
    ks, vs = kc[:, :, :256].contiguous(), vc[:, :, :256].contiguous()
    sdpa = {
        "decode_256x512": bench(
            lambda: F.scaled_dot_product_attention(q[:, :, None], kd, vd, enable_gqa=True)
        ),
        "prefill_256x256": bench(
            lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        ),
    }
    att: dict[str, Any] = {}
    shipped = (attn_mod.BLOCK_M, attn_mod.BLOCK_N)
    for name, (query, slots, pos) in cases.items():
        entry = {"sdpa_ms": sdpa[name]}
        for block_m, block_n in (shipped, (16, 32), (16, 64), (64, 32)):
            attn_mod.BLOCK_M, attn_mod.BLOCK_N = block_m, block_n
            entry[f"triton_ms_m{block_m}_n{block_n}"] = bench(
                lambda q=query, s=slots, p=pos: attention(q, kc, vc, s, p, d**-0.5)
            )
        attn_mod.BLOCK_M, attn_mod.BLOCK_N = shipped
        entry["triton_ms"] = entry[f"triton_ms_m{shipped[0]}_n{shipped[1]}"]
        entry["ratio_sdpa_over_triton"] = entry["sdpa_ms"] / entry["triton_ms"]
        att[name] = entry
    sec["attention"] = att

    x = torch.randn(65536, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)

    def hf_rms(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    sec["rmsnorm_65536x2048"] = {
        "triton_ms": bench(lambda: rms_norm(x, w, 1e-6)),
        "torch_ms": bench(lambda: hf_rms(x)),
        "max_abs_diff_vs_hf": float((rms_norm(x, w, 1e-6).float() - hf_rms(x).float()).abs().max()),
    }
    logits = torch.randn(256, 151936, device="cuda") * 4
    sec["log_softmax_256x151936_fp32"] = {
        "triton_ms": bench(lambda: log_softmax(logits)),
        "torch_ms": bench(lambda: torch.log_softmax(logits, -1)),
        "max_abs_diff": float((log_softmax(logits) - torch.log_softmax(logits, -1)).abs().max()),
    }


def qwen3_config(layers: int, max_positions: int = 1024) -> Any:
    """The Qwen3-1.7B-shaped model of the e2e and parity sections."""
    return shaped_config("qwen3-1.7b", layers, max_position_embeddings=max_positions)


def save_random_model(config: Any, path: Path) -> Path:
    """A randomly initialized bf16 model built on the GPU and saved as a local HF checkpoint."""
    return shaped.save_random_model(config, path, device="cuda", dtype="bfloat16")


def requests_for(vocab: int, count: int, prompt_len: int, max_tokens: int, n: int = 1, seed: int = 0) -> list:
    from parity.types import Request, SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (count, prompt_len), generator=g).tolist()
    return [
        Request(
            prompt_ids=p,
            sampling=SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, seed=i, ignore_eos=True),
            request_id=str(i),
        )
        for i, p in enumerate(prompts)
    ]


def parity_check(model: Any, vocab: int, kernels: str) -> dict[str, Any]:
    """Rollouts under several batch compositions vs train_forward under several layouts, bit for bit."""
    from parity.engine import ReferenceEngine, train_forward

    reqs = requests_for(vocab, 6, 13, 20, n=2, seed=1)
    out: dict[str, Any] = {"kernels": kernels, "compositions": []}
    reference = None
    # (max_num_seqs, chunk_size, max_num_batched_tokens, graphs): graphs None is the default (CUDA
    # graphs for dense models), False the eager engine; a budget of 6 splits prefill steps further.
    for max_num_seqs, chunk_size, budget, graphs in COMPOSITIONS:
        engine = ReferenceEngine(
            model,
            dtype="bfloat16",
            device="cuda",
            kernels=kernels,
            max_num_seqs=max_num_seqs,
            chunk_size=chunk_size,
            max_num_batched_tokens=budget,
            graphs=graphs,
        )
        rollouts = engine.generate(reqs)
        engine.close()
        got = [torch.tensor(r.logprobs, dtype=torch.float32) for r in rollouts]
        tokens = [r.token_ids for r in rollouts]
        if reference is None:
            reference = (rollouts, got, tokens)
        same_tokens = tokens == reference[2]
        entry: dict[str, Any] = {
            "max_num_seqs": max_num_seqs,
            "chunk_size": chunk_size,
            "max_num_batched_tokens": budget,
            "step_graphs": rollouts[0].meta["step_graphs"],
            "tokens_equal_first_composition": same_tokens,
            "train": {},
        }
        for layout, mb in [("right", None), ("left", 5), ("packed", 4)]:
            train = train_forward(
                model,
                rollouts,
                dtype="bfloat16",
                device="cuda",
                kernels=kernels,
                layout=layout,
                micro_batch_size=mb,
            ).logprobs
            diffs = [float((a - b.cpu()).abs().max()) for a, b in zip(got, train)]
            entry["train"][layout] = {
                "bitwise_equal": all(torch.equal(a, b.cpu()) for a, b in zip(got, train)),
                "max_abs_diff": max(diffs),
            }
        out["compositions"].append(entry)
    out["all_bitwise_equal"] = all(
        t["bitwise_equal"] for c in out["compositions"] for t in c["train"].values()
    )
    return out


#: models of the sampling-grid check: (label, shape, layers, vocab); None shape = a built-in checkpoint.
GRID_MODELS = [("tiny-qwen3", None, 0, 0), ("tiny-qwen3-moe", None, 0, 0),
               ("qwen3-1024-v32000", "qwen3-1024", 2, 32000), ("qwen3-1024-v151936", "qwen3-1024", 2, 151936),
               ("qwen3-1.7b-v32000", "qwen3-1.7b", 2, 32000), ("qwen3-1.7b-v151936", "qwen3-1.7b", 2, 151936),
               ("moe-64x8-v32000", "moe-64x8", 2, 32000)]


def grid_check(model: str, kernels: str) -> dict[str, Any]:
    """Differing tokens per (temperature, top_p, top_k) setting: engine rollouts (24 requests x
    n=2 x 24 tokens per setting, max_num_seqs 8, chunk 32) vs train_forward, bf16."""
    checks = sampling_grid_check(model, device="cuda", dtype="bfloat16", kernels=kernels)
    return {
        "settings": [vars(c) for c in checks],
        "tokens": sum(c.tokens for c in checks),
        "differing": sum(c.differing for c in checks),
        "max_abs_diff": max(c.max_abs_diff for c in checks),
    }


def parity_section(results: dict[str, Any], tmp: Path) -> None:
    sec: dict[str, Any] = {}
    results["parity"] = sec
    small = save_random_model(qwen3_config(2), tmp / "qwen3-shaped-2l")
    for name, model, vocab in [
        ("tiny-qwen3", "tiny-qwen3", 512),
        ("tiny-qwen3-moe", "tiny-qwen3-moe", 512),
        ("qwen3-1.7b-shaped-2-layers", str(small), 151936),
    ]:
        for kernels in ("invariant", "native"):
            try:
                sec[f"{name}/{kernels}"] = parity_check(model, vocab, kernels)
            except Exception:
                sec[f"{name}/{kernels}"] = {"error": traceback.format_exc()[-3000:]}
    grid: dict[str, Any] = {}
    sec["sampling_grid"] = grid
    for label, shape, layers, vocab in GRID_MODELS:
        model = label if shape is None else str(shaped.save_random_model(
            shaped_config(shape, layers, vocab_size=vocab), tmp / label, device="cuda"))
        for kernels in ("invariant", "native") if label == "qwen3-1.7b-v151936" else ("invariant",):
            try:
                grid[f"{label}/{kernels}"] = grid_check(model, kernels)
            except Exception:
                grid[f"{label}/{kernels}"] = {"error": traceback.format_exc()[-3000:]}
        if label == "qwen3-1024-v151936":
            grid[f"{label}/stock-cuda-scan"] = stock_scan_check(model)


def stock_scan_check(model: str) -> dict[str, Any]:
    """The old top-p defect as a negative control: torch's CUDA cumsum as the prefix sum."""
    from parity.kernels import switch

    key = ("softmax", "cumsum", "cuda")
    fixed = switch._registry[key]
    switch._registry[key] = lambda x: torch.cumsum(x, -1)
    try:
        return grid_check(model, "invariant")
    except Exception:
        return {"error": traceback.format_exc()[-3000:]}
    finally:
        switch._registry[key] = fixed


def engine_tok_s(path: Path, kernels: str, reqs: list, chunk_size: int, budget: int) -> dict[str, Any]:
    """Output tok/s of one ReferenceEngine.generate over reqs (after a small warm-up generate; the
    timed call still captures its decode graph, the KV cache being reallocated for its lengths)."""
    from parity.engine import ReferenceEngine

    engine = ReferenceEngine(
        str(path),
        dtype="bfloat16",
        device="cuda",
        kernels=kernels,
        max_num_seqs=len(reqs),
        chunk_size=chunk_size,
        max_num_batched_tokens=budget,
    )
    engine.generate(requests_for(151936, 4, 16, 4, seed=9))  # compile kernels, allocate the cache
    torch.cuda.synchronize()
    start = time.perf_counter()
    rollouts = engine.generate(reqs)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    engine.close()
    produced = sum(len(r.token_ids) for r in rollouts)
    return {
        "seconds": seconds,
        "output_tokens": produced,
        "output_tok_s": produced / seconds,
        "step_graphs": rollouts[0].meta["step_graphs"],
    }


def hf_generate_tok_s(path: Path, reqs: list, prompt_len: int, max_tokens: int) -> dict[str, float]:
    """Output tok/s of stock transformers `generate` (SDPA, sampling at temperature 1, no top-k/p)."""
    from transformers import AutoModelForCausalLM

    hf = (
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")
        .cuda()
        .eval()
    )
    ids = torch.tensor([list(r.prompt_ids) for r in reqs], device="cuda")
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    hf.generate(ids[:4, :16], max_new_tokens=4, min_new_tokens=4, **kwargs)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        **kwargs,
    )
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    produced = (out.shape[1] - prompt_len) * len(reqs)
    del hf
    torch.cuda.empty_cache()
    return {"seconds": seconds, "output_tokens": produced, "output_tok_s": produced / seconds}


def e2e_section(
    results: dict[str, Any],
    tmp: Path,
    shape: tuple[int, int, int],
    variants: list[str],
    chunk_size: int,
    budget: int,
    save: Callable[[], None],
) -> None:
    """Throughput of each variant ("hf", "invariant", "native") on one Qwen3-1.7B-shaped checkpoint."""
    count, prompt_len, max_tokens = shape
    chunk_size = chunk_size or prompt_len
    sec = results.setdefault("e2e", {})
    sec["workload"] = {
        "requests": count,
        "prompt_tokens": prompt_len,
        "output_tokens": max_tokens,
        "model": "Qwen3-1.7B-shaped, 28 layers, bf16, random weights",
        "engine_chunk_size": chunk_size,
        "engine_max_num_batched_tokens": budget,
        "matmul_path": "cuBLASLt without split-K (proven shapes)" if cublaslt_ready() else "Triton",
    }
    path = save_random_model(qwen3_config(28), tmp / "qwen3-1.7b-shaped")
    reqs = requests_for(151936, count, prompt_len, max_tokens)
    for variant in variants:
        name = "hf_generate" if variant == "hf" else f"engine_{variant}"
        try:
            if variant == "hf":
                sec[name] = hf_generate_tok_s(path, reqs, prompt_len, max_tokens)
            else:
                sec[name] = engine_tok_s(path, variant, reqs, chunk_size, budget)
        except Exception:
            sec[name] = {"error": traceback.format_exc()[-3000:]}
        torch.cuda.empty_cache()
        save()


def profile_section(results: dict[str, Any], tmp: Path, out: Path) -> None:
    """Where a decode step's time goes: torch.profiler over a few steps of the invariant engine."""
    from torch.profiler import ProfilerActivity, profile

    from parity.engine import ReferenceEngine

    path = tmp / "qwen3-1.7b-shaped"
    if not path.exists():
        save_random_model(qwen3_config(28), path)
    engine = ReferenceEngine(
        str(path), dtype="bfloat16", device="cuda", kernels="invariant", max_num_seqs=256, chunk_size=16
    )
    reqs = requests_for(151936, 256, 16, 8)
    engine.generate(reqs)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        engine.generate(reqs)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    engine.close()
    events = prof.key_averages()
    (out / "profile.txt").write_text(events.table(sort_by="self_cpu_time_total", row_limit=40))
    gpu_us = sum(e.self_device_time_total for e in events)
    results["profile"] = {
        "workload": "256 seqs x 16 prompt x 8 output, invariant",
        "wall_s": seconds,
        "gpu_busy_s": gpu_us / 1e6,
        "steps": 9,
    }


def cublaslt_run(results: dict[str, Any], args: argparse.Namespace) -> None:
    """parity + the invariant engine again, in a process set up for the proven cuBLASLt matmul path."""
    out = args.out / "cublaslt"
    cmd = [sys.executable, __file__, "--out", str(out), "--sections", "parity,e2e", "--e2e", args.e2e]
    cmd += ["--e2e-variants", "invariant", "--chunk-size", str(args.chunk_size), "--cublaslt"]
    cmd += ["--max-batched-tokens", str(args.max_batched_tokens)]
    proc = subprocess.run(cmd, env={**os.environ, **CUBLASLT_ENV}, capture_output=True, text=True)
    sub = json.loads((out / "gpu_results.json").read_text()) if (out / "gpu_results.json").exists() else {}
    results["cublaslt"] = {"parity": sub.get("parity"), "e2e": sub.get("e2e"), "stderr": proc.stderr[-2000:]}


def table(results: dict[str, Any]) -> str:
    lines = []
    k = results.get("kernels", {})
    for shape, entry in k.get("matmul", {}).items():
        for m in BENCH_M:
            c, t = entry["cublas"]["graph"][m], entry["triton"]["graph"][m]
            lines.append(
                f"matmul {shape} M={m:<5} triton {t:7.1f} TFLOP/s  cuBLAS {c:7.1f}  ratio {t / c:5.2f}"
            )
    lt = k.get("cublaslt_nosplitk", {})
    for shape, vals in {s: v["graph"] for s, v in lt.get("tflops", {}).items()}.items():
        lines.append(f"cuBLASLt no-split-K {shape}: " + "  ".join(f"M={m} {v:.1f}" for m, v in vals.items()))
    for key in ("triton_invariance", "cublas_default_invariance"):
        bad = [e["shape"] for e in k.get(key, []) if not e["invariant"]]
        if key in k:
            lines.append(f"{key}: {'all row-invariant' if not bad else f'NOT invariant at {bad}'}")
    if "invariance" in lt:
        bad = [e["shape"] for e in lt["invariance"] if not e["invariant"]]
        lines.append(
            f"cublaslt_nosplitk_invariance: {'all row-invariant' if not bad else f'NOT invariant at {bad}'}"
        )
    for name, a in k.get("attention", {}).items():
        lines.append(
            f"attention {name}: triton {a['triton_ms']:.3f} ms  SDPA {a['sdpa_ms']:.3f} ms  "
            f"SDPA/triton {a['ratio_sdpa_over_triton']:.2f}"
        )
    sub = results.get("cublaslt", {})
    for label, parity, e2e in (
        ("", results.get("parity", {}), results.get("e2e", {})),
        (" [cuBLASLt]", sub.get("parity") or {}, sub.get("e2e") or {}),
    ):
        for name, entry in parity.get("sampling_grid", {}).items():
            verdict = "ERROR" if "error" in entry else \
                f"{entry['differing']} of {entry['tokens']} tokens differ (max {entry['max_abs_diff']:.2e})"
            lines.append(f"sampling grid{label} {name}: {verdict}")
        for name, entry in parity.items():
            if isinstance(entry, dict) and name != "sampling_grid":
                verdict = (
                    "ERROR"
                    if "error" in entry
                    else f"bitwise equal: {entry['all_bitwise_equal']} "
                    f"[{'; '.join(sorted({c['step_graphs'] for c in entry['compositions']}))}]"
                )
                lines.append(f"parity{label} {name}: rollout vs train_forward {verdict}")
        for name in ("engine_invariant", "engine_native", "hf_generate"):
            v = e2e.get(name)
            if v is not None:
                got = (
                    "ERROR"
                    if "error" in v
                    else f"{v['output_tok_s']:.0f} output tok/s ({v['seconds']:.1f} s)"
                    + (f" [{v['step_graphs']}]" if "step_graphs" in v else "")
                )
                lines.append(f"e2e{label} {name}: {got}")
    e, lt_e2e = results.get("e2e", {}), (sub.get("e2e") or {}).get("engine_invariant", {})
    ok = {
        n: e[n]["output_tok_s"]
        for n in ("engine_invariant", "engine_native", "hf_generate")
        if n in e and "error" not in e[n]
    }
    if "output_tok_s" in lt_e2e:
        ok["engine_invariant_cublaslt"] = lt_e2e["output_tok_s"]
    for a in ("engine_invariant", "engine_invariant_cublaslt"):
        for b in ("engine_native", "hf_generate"):
            if a in ok and b in ok:
                lines.append(f"e2e ratio {a} / {b}: {ok[a] / ok[b]:.2f}")
    prof = results.get("profile", {})
    if "wall_s" in prof:
        lines.append(
            f"profile ({prof['workload']}): wall {prof['wall_s']:.2f} s, GPU busy {prof['gpu_busy_s']:.2f} s"
        )
    for section in ("kernels", "parity", "e2e", "cublaslt", "profile"):
        if "error" in results.get(section, {}):
            lines.append(f"{section}: ERROR (see gpu_results.json)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-results"))
    parser.add_argument("--sections", default="kernels,parity,e2e,cublaslt")
    parser.add_argument("--e2e", default="256,256,512", help="requests,prompt_tokens,output_tokens")
    parser.add_argument("--e2e-variants", default="hf,invariant,native")
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=0,
        help="engine prefill tokens per sequence per step (0: whole prompt)",
    )
    parser.add_argument(
        "--max-batched-tokens",
        type=int,
        default=8192,
        help="engine tokens per step (bounds prefill steps)",
    )
    parser.add_argument("--cublaslt", action="store_true", help="prefer cuBLASLt (run with CUBLASLT_ENV set)")
    parser.add_argument("--cublaslt-probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cublaslt_probe:
        print(json.dumps(cublaslt_probe()))
        return
    if args.cublaslt:
        torch.backends.cuda.preferred_blas_library("cublaslt")

    import parity.kernels.triton as triton_kernels

    triton_kernels.register()
    args.out.mkdir(parents=True, exist_ok=True)
    import transformers
    import triton

    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "command": " ".join(sys.argv),
    }

    def save() -> None:
        (args.out / "gpu_results.json").write_text(json.dumps(results, indent=1, default=str))

    shape = tuple(int(v) for v in args.e2e.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.sections.split(","):
            start = time.perf_counter()
            try:
                if name == "kernels":
                    kernels_section(results)
                elif name == "parity":
                    parity_section(results, Path(tmp))
                elif name == "e2e":
                    e2e_section(
                        results,
                        Path(tmp),
                        shape,
                        args.e2e_variants.split(","),
                        args.chunk_size,
                        args.max_batched_tokens,
                        save,
                    )
                elif name == "cublaslt":
                    cublaslt_run(results, args)
                elif name == "profile":
                    profile_section(results, Path(tmp), args.out)
            except Exception:
                results.setdefault(name, {})["error"] = traceback.format_exc()[-3000:]
            results.setdefault(name, {})["section_seconds"] = time.perf_counter() - start
            save()
            print(f"[{name}] done in {time.perf_counter() - start:.0f} s", flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
