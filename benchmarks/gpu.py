"""The one script for the GPU machine: invariance checks, kernel microbenchmarks, end-to-end throughput.

Run from the repository root (parity need not be installed):

    PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu --out $OUT \
        [--sections kernels,parity,e2e,profile,cublaslt,tp]

Sections (`SECTIONS`; each runs independently: a failure is recorded and the next section still runs):
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
  dense and MoE, counting differing tokens per setting, and once with torch's CUDA cumsum as the
  top-p prefix sum (the old defect, a negative control).
- e2e: output tok/s of (a) the reference engine with invariant kernels (`invariant@PLAN`: under
  another attention plan), (b') "baseline": the same engine, scheduler and CUDA graphs with default
  cuBLAS, torch's flash attention reading the KV cache in place and stock MoE, keeping only the
  row-wise/elementwise families (`BASELINE_FAMILIES`) on parity's fused kernels (the honest
  non-invariant baseline), "native": every family stock (HF's unfused ops), (c) transformers
  `generate`, on a Qwen3-1.7B-shaped bf16 model with random weights, side by side in one run.
- profile: torch.profiler over a few decode steps of the invariant engine ($OUT/profile.txt).
- step_split: where one decode step's wall time goes at the `--e2e` workload (invariant engine): host
  seconds in the scheduler, the graph launch and the sampler launches, the wait for the device, and
  each CUDA-graph bucket's device time replayed alone.
- tp: invariant-engine tok/s without tensor parallelism and at TP=1 (the canonical K-group layout)
  for each `--tp-groups` count of K groups (default 8), and with two GPUs at TP=2 (NCCL), on the
  Qwen3-1.7B shape at the `--e2e` workload, side by side, and whether TP=2's rollouts equal TP=1's
  bit for bit (TP=2 is skipped, and recorded as skipped, with one GPU).
- cublaslt: parity and (a) again in a subprocess started with `CUBLASLT_ENV` and cuBLASLt
  preferred, so the matmul takes the proven cuBLASLt path (`parity.kernels.triton.matmul`).
- probe: the load-time matmul probe (`parity.kernels.probe`) in a process set up for cuBLASLt, over
  the linear shapes of Qwen3-1.7B, Llama-3.2-1B and Qwen3-30B-A3B: the route each shape takes,
  probe time cold and cached, a spot check of row invariance, TFLOP/s routed vs Triton.
- attention_sweep: every candidate attention plan (`attention.CANDIDATES`): decode and prefill
  times vs SDPA / flash SDPA, decode == prefill and chunked == prefill bit for bit per plan, and
  the cross-plan table (may decode run another plan than prefill?); the shipped decode launch vs
  SDPA in five interleaved repeats.
- parity_shapes: rollout == train_forward bit for bit on 2-layer Llama-3.2-1B-, Qwen3-30B-A3B- and
  Qwen3-1.7B-shaped models (invariant; native as the negative control).
- moe_e2e: output tok/s on a Qwen3-30B-A3B-shaped model (`--moe-layers` of 48 layers, built in GPU
  memory): hf generate (`--moe-hf-tokens`), the engine with `--moe-variants` kernels, each with and
  without route recording.
- probed: parity_shapes, e2e and moe_e2e (invariant only) in a subprocess set up for cuBLASLt,
  where every shape goes through the load-time probe.
- roofline: each end-to-end row of the run against its workload's lower bound from shapes
  (`benchmarks.roofline`) at the copy bandwidth and matmul peak measured here.

Full numbers go to $OUT/gpu_results.json (each section's dataclasses as JSON, saved after every
section); the short table is printed last. Settings a measurement changes (the preferred BLAS
library, the attention kernel's tile constants, a registered kernel) are restored when it ends,
failed or not.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from parity.engine import ReferenceEngine, train_forward
from parity.engine.selfcheck import SettingCheck, sampling_grid_check
from parity.kernels import switch
from parity.kernels.triton.matmul import CUBLASLT_ENV, cublaslt_ready
from parity.models import shaped
from parity.models.loading import LoadedModel
from parity.schema import REDUCTION_GROUPS
from parity.types import Request, SamplingParams

#: The repository root: subprocesses run `python3 -m benchmarks.gpu` from here.
ROOT = Path(__file__).resolve().parent.parent
#: Qwen3-1.7B linear weights [N, K]: q, k/v, o, gate/up, down, lm_head.
QWEN3_LINEARS = [(2048, 2048), (1024, 2048), (6144, 2048), (2048, 6144), (151936, 2048)]
INVARIANCE_M = [1, 2, 3, 7, 16, 31, 64, 100, 255, 256, 1000, 2047, 4096]
BENCH_M = [1, 16, 256, 4096]
#: engine settings of the parity section: (max_num_seqs, chunk_size, max_num_batched_tokens, graphs).
#: graphs None is the default (CUDA graphs for dense models), False the eager engine; a budget of 6
#: splits prefill steps further.
COMPOSITIONS = [(12, 64, 8192, None), (3, 5, 8192, None), (5, 7, 8192, False), (4, 9, 6, None)]
#: models of the sampling-grid check: (label, shape, layers, vocab); None shape = a built-in checkpoint.
GRID_MODELS = [("tiny-qwen3", None, 0, 0), ("tiny-qwen3-moe", None, 0, 0),
               ("qwen3-1024-v32000", "qwen3-1024", 2, 32000), ("qwen3-1024-v151936", "qwen3-1024", 2, 151936),
               ("qwen3-1.7b-v32000", "qwen3-1.7b", 2, 32000), ("qwen3-1.7b-v151936", "qwen3-1.7b", 2, 151936),
               ("moe-64x8-v32000", "moe-64x8", 2, 32000)]
E2E_VARIANTS = ("hf", "invariant", "native", "baseline")
#: the kernel families the "baseline" (b') variant keeps on parity's fused Triton kernels: row-wise and
#: elementwise ops whose invariance costs nothing (torch has no fused kernel HF models call for them),
#: while matmul (default cuBLAS), attention (flash over the cache) and MoE stay stock.
BASELINE_FAMILIES = ("rmsnorm", "pointwise", "rotary")


def plan_constants(variant: str) -> dict[str, int]:
    """Attention module constants of an "invariant@PLAN" variant (PLAN: a name in
    `attention.CANDIDATES`, run for every step, long or short); {} for a plain variant."""
    from parity.kernels.triton.attention import CANDIDATES

    if "@" not in variant:
        return {}
    plan = next(c for c in CANDIDATES if c.name == variant.split("@", 1)[1])
    return {"BLOCK_M": plan.block_m, "BLOCK_N": plan.block_n, "NUM_WARPS": plan.num_warps,
            "NUM_STAGES": plan.num_stages, "PROGRAMS_PER_SM": plan.programs_per_sm, "LONG_STEP_TOKENS": 2**62}


def engine_kernels(variant: str) -> str | tuple[str, ...]:
    """The engine's `kernels=` for an engine variant."""
    return BASELINE_FAMILIES if variant == "baseline" else variant.split("@")[0]


def variant_names(text: str, what: str) -> list[str]:
    """E2E variants: hf, invariant, native, or invariant@PLAN (the invariant engine under another
    attention plan of `attention.CANDIDATES`)."""
    from parity.kernels.triton.attention import CANDIDATES

    choices = [*E2E_VARIANTS, *(f"invariant@{c.name}" for c in CANDIDATES)]
    return _names(text, choices, what)


# -- results -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowInvariance:
    """Whether linear(x[:m]) == linear(x)[:m] bitwise for every m in INVARIANCE_M, at weight [n, k]."""

    shape: list[int]
    invariant: bool
    differing_m: list[int]


@dataclass(frozen=True)
class MatmulSpeed:
    """TFLOP/s by M: eager (do_bench) and from CUDA-graph replay; host_us: launch cost per call."""

    eager: dict[int, float]
    graph: dict[int, float]
    host_us: dict[int, float]


@dataclass(frozen=True)
class MatmulComparison:
    """One weight shape: default cuBLAS, the Triton linear, and the Triton tile plan used."""

    cublas: MatmulSpeed
    triton: MatmulSpeed
    plan: dict[str, Any]


@dataclass(frozen=True)
class CublasLtProbe:
    """cuBLASLt without split-K (a process started with CUBLASLT_ENV): invariance and speed."""

    env: dict[str, str | None]
    invariance: list[RowInvariance]
    tflops: dict[str, MatmulSpeed]


@dataclass(frozen=True)
class AttentionTiming:
    """Milliseconds of one attention workload: SDPA, the shipped Triton tiles, and other tiles
    (`tiles`, by "m{BLOCK_M}_n{BLOCK_N}")."""

    sdpa_ms: float
    triton_ms: float
    ratio_sdpa_over_triton: float
    tiles: dict[str, float]


@dataclass(frozen=True)
class KernelTiming:
    """Milliseconds of a Triton kernel and its torch counterpart, and their largest difference."""

    triton_ms: float
    torch_ms: float
    max_abs_diff: float


@dataclass(frozen=True)
class KernelsResult:
    triton_invariance: list[RowInvariance]
    cublas_default_invariance: list[RowInvariance]
    cublaslt_nosplitk: CublasLtProbe | dict[str, str]
    matmul: dict[str, MatmulComparison]
    attention: dict[str, AttentionTiming]
    rmsnorm_65536x2048: KernelTiming
    log_softmax_256x151936_fp32: KernelTiming


@dataclass(frozen=True)
class LayoutCheck:
    """Training-forward logprobs in one layout vs the rollouts'."""

    bitwise_equal: bool
    max_abs_diff: float


@dataclass(frozen=True)
class CompositionCheck:
    """Rollouts under one engine setting vs train_forward in each layout."""

    max_num_seqs: int
    chunk_size: int
    max_num_batched_tokens: int
    step_graphs: str
    tokens_equal_first_composition: bool
    train: dict[str, LayoutCheck]


@dataclass(frozen=True)
class ParityCheck:
    kernels: str
    compositions: list[CompositionCheck]
    all_bitwise_equal: bool


@dataclass(frozen=True)
class GridCheck:
    """Differing tokens per (temperature, top_p, top_k) setting, and over all settings."""

    settings: list[SettingCheck]
    tokens: int
    differing: int
    max_abs_diff: float


@dataclass(frozen=True)
class E2EWorkload:
    requests: int
    prompt_tokens: int
    output_tokens: int
    model: str
    engine_chunk_size: int
    engine_max_num_batched_tokens: int
    matmul_path: str


@dataclass(frozen=True)
class Throughput:
    """Output tokens per second of one generate call; step_graphs: the engine's graph status."""

    seconds: float
    output_tokens: int
    output_tok_s: float
    step_graphs: str | None = None


@dataclass(frozen=True)
class StepSplit:
    """Seconds of one timed generate by part: host parts (`host_s`, with call counts), the wall
    time, and each graph bucket's device ms replayed alone (`bucket_device_ms`, by step size)."""

    workload: str
    wall_s: float
    host_s: dict[str, float]
    calls: dict[str, int]
    bucket_device_ms: dict[str, float]


@dataclass(frozen=True)
class ProfileResult:
    workload: str
    wall_s: float
    gpu_busy_s: float
    steps: int


def plain(value: Any) -> Any:
    """Results as JSON-ready values: dataclasses become dicts, recursively."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def failure() -> dict[str, str]:
    """The record of a failed measurement: the end of its traceback."""
    return {"error": traceback.format_exc()[-3000:]}


# -- settings changed for one measurement, restored after it --------------------------------------


@contextmanager
def blas_library(name: str) -> Iterator[None]:
    """torch's preferred BLAS library set to `name` inside the block, the previous one restored."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


@contextmanager
def module_constants(module: ModuleType, **values: Any) -> Iterator[None]:
    """Module-level constants set to `values` inside the block, the previous values restored."""
    before = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(module, name, value)


# -- timing and probes ---------------------------------------------------------------------------


def bench(fn: Callable[[], Any]) -> float:
    """Median milliseconds of fn (triton's do_bench: CUDA events, L2 flushed between runs)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def rotating(fn: Callable[..., Any], arg_sets: list[tuple]) -> Callable[[], Any]:
    """fn over several input sets in turn, so repeated calls do not all hit the same L2 lines."""
    cycle = itertools.cycle(arg_sets)
    return lambda: fn(*next(cycle))


def rows_invariant(linear: Callable[..., torch.Tensor], n: int, k: int) -> RowInvariance:
    """Whether linear(x[:m]) == linear(x)[:m] bitwise for every m in INVARIANCE_M."""
    g = torch.Generator("cuda").manual_seed(n * 7 + k)
    x = torch.randn(max(INVARIANCE_M), k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(torch.bfloat16)
    full = linear(x, w)
    differing = [m for m in INVARIANCE_M if not torch.equal(linear(x[:m], w), full[:m])]
    return RowInvariance(shape=[n, k], invariant=not differing, differing_m=differing)


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
    times = sorted(graph_replay_ms(graph) / len(arg_sets) for _ in range(7))
    return times[len(times) // 2]


def host_us(fn: Callable[..., Any], args: tuple) -> float:
    """Host microseconds to enqueue one call (the launch overhead a decode step pays per linear)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        fn(*args)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / 200 * 1e6


def matmul_tflops(linear: Callable[..., torch.Tensor], n: int, k: int, ms: list[int]) -> MatmulSpeed:
    """TFLOP/s of linear at each M, eager (do_bench) and from a CUDA graph, rotating over 4 weight
    copies (4 x a 2048x6144 weight > L2), plus the host launch cost."""
    eager, graph, host = {}, {}, {}
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(4)]
    for m in ms:
        sets = list(zip([torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)], weights))
        flop = 2 * m * n * k
        eager[m] = flop / bench(rotating(linear, sets)) / 1e9
        graph[m] = flop / graph_ms(linear, sets) / 1e9
        host[m] = host_us(linear, sets[0])
    return MatmulSpeed(eager=eager, graph=graph, host_us=host)


def cublaslt_probe() -> CublasLtProbe:
    """Run in a subprocess started with CUBLASLT_ENV: row invariance and speed of cuBLASLt, no split-K."""
    with blas_library("cublaslt"):
        return CublasLtProbe(
            env={k: os.environ.get(k) for k in CUBLASLT_ENV},
            invariance=[rows_invariant(F.linear, n, k) for n, k in QWEN3_LINEARS],
            tflops={f"{n}x{k}": matmul_tflops(F.linear, n, k, BENCH_M)
                    for n, k in [(6144, 2048), (2048, 6144)]},
        )


def module_command(*args: str) -> list[str]:
    """This script run as a module, as a subprocess command (started in ROOT)."""
    return [sys.executable, "-m", "benchmarks.gpu", *args]


# -- models and workloads ------------------------------------------------------------------------


def qwen3_config(layers: int, max_positions: int = 1024) -> Any:
    """The Qwen3-1.7B-shaped model of the e2e and parity sections."""
    return shaped.shaped_config("qwen3-1.7b", layers, max_position_embeddings=max_positions)


def save_random_model(config: Any, path: Path) -> Path:
    """A randomly initialized bf16 model built on the GPU and saved as a local HF checkpoint."""
    return shaped.save_random_model(config, path, device="cuda", dtype="bfloat16")


def requests_for(vocab: int, count: int, prompt_len: int, max_tokens: int, n: int = 1,
                 seed: int = 0) -> list[Request]:
    """`count` random prompts of `prompt_len` ids, sampled at temperature 1 for max_tokens (EOS ignored)."""
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


def parity_check(model: Any, vocab: int, kernels: str) -> ParityCheck:
    """Rollouts under several batch compositions vs train_forward under several layouts, bit for bit."""
    reqs = requests_for(vocab, 6, 13, 20, n=2, seed=1)
    compositions = []
    first_tokens = None
    for max_num_seqs, chunk_size, budget, graphs in COMPOSITIONS:
        with ReferenceEngine(model, dtype="bfloat16", device="cuda", kernels=kernels,
                             max_num_seqs=max_num_seqs, chunk_size=chunk_size, max_num_batched_tokens=budget,
                             graphs=graphs) as engine:
            rollouts = engine.generate(reqs)
        got = [torch.tensor(r.logprobs, dtype=torch.float32) for r in rollouts]
        tokens = [r.token_ids for r in rollouts]
        if first_tokens is None:
            first_tokens = tokens
        layouts = {}
        for layout, micro_batch_size in [("right", None), ("left", 5), ("packed", 4)]:
            train = train_forward(model, rollouts, dtype="bfloat16", device="cuda", kernels=kernels,
                                  layout=layout, micro_batch_size=micro_batch_size).logprobs
            layouts[layout] = LayoutCheck(
                bitwise_equal=all(torch.equal(a, b.cpu()) for a, b in zip(got, train)),
                max_abs_diff=max(float((a - b.cpu()).abs().max()) for a, b in zip(got, train)))
        compositions.append(CompositionCheck(
            max_num_seqs=max_num_seqs, chunk_size=chunk_size, max_num_batched_tokens=budget,
            step_graphs=rollouts[0].meta["step_graphs"],
            tokens_equal_first_composition=tokens == first_tokens, train=layouts))
    return ParityCheck(kernels=kernels, compositions=compositions,
                       all_bitwise_equal=all(t.bitwise_equal for c in compositions for t in c.train.values()))


def grid_check(model: str, kernels: str) -> GridCheck:
    """Differing tokens per (temperature, top_p, top_k) setting: engine rollouts (24 requests x
    n=2 x 24 tokens per setting, max_num_seqs 8, chunk 32) vs train_forward, bf16."""
    checks = sampling_grid_check(model, device="cuda", dtype="bfloat16", kernels=kernels)
    return GridCheck(settings=checks, tokens=sum(c.tokens for c in checks),
                     differing=sum(c.differing for c in checks),
                     max_abs_diff=max(c.max_abs_diff for c in checks))


def engine_tok_s(model: Path | LoadedModel, kernels: str | tuple[str, ...], reqs: list[Request],
                 chunk_size: int, budget: int, record_routes: bool = False,
                 tensor_parallel_size: int | None = None,
                 reduction_groups: int = REDUCTION_GROUPS) -> Throughput:
    """Output tok/s of one ReferenceEngine.generate over reqs (after a small warm-up generate; the
    timed call still captures its decode graph, the KV cache being reallocated for its lengths)."""
    with ReferenceEngine(model, dtype="bfloat16", device="cuda", kernels=kernels, max_num_seqs=len(reqs),
                         chunk_size=chunk_size, max_num_batched_tokens=budget,
                         record_routes=record_routes, tensor_parallel_size=tensor_parallel_size,
                         reduction_groups=reduction_groups) as engine:
        engine.generate(requests_for(151936, 4, 16, 4, seed=9))  # compile kernels, allocate the cache
        torch.cuda.synchronize()
        start = time.perf_counter()
        rollouts = engine.generate(reqs)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    produced = sum(len(r.token_ids) for r in rollouts)
    return Throughput(seconds=seconds, output_tokens=produced, output_tok_s=produced / seconds,
                      step_graphs=rollouts[0].meta["step_graphs"])


def hf_generate_tok_s(model: Path | torch.nn.Module, reqs: list[Request], prompt_len: int,
                      max_tokens: int) -> Throughput:
    """Output tok/s of stock transformers `generate` (SDPA, sampling at temperature 1, no top-k/p) on a
    checkpoint path or an unpatched model already on the GPU."""
    from transformers import AutoModelForCausalLM

    if isinstance(model, torch.nn.Module):
        hf = model.eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, attn_implementation="sdpa")
        hf = hf.cuda().eval()
    ids = torch.tensor([list(r.prompt_ids) for r in reqs], device="cuda")
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    hf.generate(ids[:4, :16], max_new_tokens=4, min_new_tokens=4, **kwargs)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                      min_new_tokens=max_tokens, **kwargs)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    produced = (out.shape[1] - prompt_len) * len(reqs)
    del hf, out
    torch.cuda.empty_cache()
    return Throughput(seconds=seconds, output_tokens=produced, output_tok_s=produced / seconds)


# -- sections ------------------------------------------------------------------------------------


@dataclass
class Run:
    """What every section gets: the arguments, a scratch directory for checkpoints, and the results
    so far, which `save` writes to $OUT/gpu_results.json."""

    args: argparse.Namespace
    tmp: Path
    results: dict[str, Any] = field(default_factory=dict)

    def save(self) -> None:
        (self.args.out / "gpu_results.json").write_text(json.dumps(self.results, indent=1, default=str))

    def checkpoint(self, section: str, partial: Any) -> None:
        """Save a long section's results so far (a crash or timeout keeps them)."""
        self.results[section] = plain(partial)
        self.save()


def kernels_section(run: Run) -> KernelsResult:
    from parity.kernels.triton import attention as attention_kernel
    from parity.kernels.triton import linear, log_softmax, rms_norm
    from parity.kernels.triton import matmul as mm

    # the package exports the attention function under the module's name: the module holds the tiles
    tiles = importlib.import_module("parity.kernels.triton.attention")
    triton_invariance = [rows_invariant(linear, n, k) for n, k in QWEN3_LINEARS]
    cublas_default_invariance = [rows_invariant(F.linear, n, k) for n, k in QWEN3_LINEARS]
    probe = subprocess.run(module_command("--cublaslt-probe"), cwd=ROOT, env={**os.environ, **CUBLASLT_ENV},
                           capture_output=True, text=True, timeout=300)
    try:
        cublaslt: CublasLtProbe | dict[str, str] = json.loads(probe.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        cublaslt = {"error": probe.stderr[-3000:]}

    # matmul: the shipped plan vs default cuBLAS (cuBLASLt without split-K: the probe above)
    matmul = {f"{n}x{k}": MatmulComparison(cublas=matmul_tflops(F.linear, n, k, BENCH_M),
                                           triton=matmul_tflops(linear, n, k, BENCH_M),
                                           plan=vars(mm.tile_config(torch.bfloat16, n, k)))
              for n, k in [(6144, 2048), (2048, 6144)]}

    # attention: decode (256 seqs at context 512) and prefill (256 x 256 tokens), Qwen3-1.7B heads;
    # the shipped tiles (BLOCK_M query rows, BLOCK_N keys) and, for the record, other sizes
    hq, hkv, d, cap = 16, 8, 128, 1024
    kc = torch.randn(256, hkv, cap, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(256, hkv, cap, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(256, hq, d, device="cuda", dtype=torch.bfloat16)
    qp = torch.randn(256 * 256, hq, d, device="cuda", dtype=torch.bfloat16)
    cases = {
        "decode_256x512": (q, torch.arange(256, device="cuda"), torch.full((256,), 511, device="cuda")),
        "prefill_256x256": (qp, torch.arange(256, device="cuda").repeat_interleave(256),
                            torch.arange(256, device="cuda").repeat(256)),
    }
    kd, vd = kc[:, :, :512].contiguous(), vc[:, :, :512].contiguous()
    qs = qp.view(256, 256, hq, d).transpose(1, 2).contiguous()
    ks, vs = kc[:, :, :256].contiguous(), vc[:, :, :256].contiguous()
    sdpa = {
        "decode_256x512": bench(
            lambda: F.scaled_dot_product_attention(q[:, :, None], kd, vd, enable_gqa=True)),
        "prefill_256x256": bench(
            lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)),
    }
    attention: dict[str, AttentionTiming] = {}
    shipped = (tiles.BLOCK_M, tiles.BLOCK_N)
    for name, (query, slots, pos) in cases.items():
        times = {}
        for block_m, block_n in (shipped, (16, 32), (16, 64), (64, 32)):
            with module_constants(tiles, BLOCK_M=block_m, BLOCK_N=block_n):
                times[f"m{block_m}_n{block_n}"] = bench(
                    lambda q=query, s=slots, p=pos: attention_kernel(q, kc, vc, s, p, d**-0.5))
        triton_ms = times[f"m{shipped[0]}_n{shipped[1]}"]
        attention[name] = AttentionTiming(sdpa_ms=sdpa[name], triton_ms=triton_ms,
                                          ratio_sdpa_over_triton=sdpa[name] / triton_ms, tiles=times)

    x = torch.randn(65536, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)

    def hf_rms(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    logits = torch.randn(256, 151936, device="cuda") * 4
    return KernelsResult(
        triton_invariance=triton_invariance,
        cublas_default_invariance=cublas_default_invariance,
        cublaslt_nosplitk=cublaslt,
        matmul=matmul,
        attention=attention,
        rmsnorm_65536x2048=KernelTiming(
            triton_ms=bench(lambda: rms_norm(x, w, 1e-6)), torch_ms=bench(lambda: hf_rms(x)),
            max_abs_diff=float((rms_norm(x, w, 1e-6).float() - hf_rms(x).float()).abs().max())),
        log_softmax_256x151936_fp32=KernelTiming(
            triton_ms=bench(lambda: log_softmax(logits)),
            torch_ms=bench(lambda: torch.log_softmax(logits, -1)),
            max_abs_diff=float((log_softmax(logits) - torch.log_softmax(logits, -1)).abs().max())),
    )


def parity_section(run: Run) -> dict[str, Any]:
    """Bitwise parity per (model, kernels), then the sampling grid per model (see the module doc)."""
    section: dict[str, Any] = {}
    small = save_random_model(qwen3_config(2), run.tmp / "qwen3-shaped-2l")
    for name, model, vocab in [("tiny-qwen3", "tiny-qwen3", 512), ("tiny-qwen3-moe", "tiny-qwen3-moe", 512),
                               ("qwen3-1.7b-shaped-2-layers", str(small), 151936)]:
        for kernels in ("invariant", "native"):
            try:
                section[f"{name}/{kernels}"] = parity_check(model, vocab, kernels)
            except Exception:
                section[f"{name}/{kernels}"] = failure()
    grid: dict[str, GridCheck | dict[str, str]] = {}
    section["sampling_grid"] = grid
    for label, shape, layers, vocab in GRID_MODELS:
        model = label if shape is None else str(shaped.save_random_model(
            shaped.shaped_config(shape, layers, vocab_size=vocab), run.tmp / label, device="cuda"))
        for kernels in ("invariant", "native") if label == "qwen3-1.7b-v151936" else ("invariant",):
            try:
                grid[f"{label}/{kernels}"] = grid_check(model, kernels)
            except Exception:
                grid[f"{label}/{kernels}"] = failure()
        if label == "qwen3-1024-v151936":
            grid[f"{label}/stock-cuda-scan"] = stock_scan_check(model)
    return section


def stock_scan_check(model: str) -> GridCheck | dict[str, str]:
    """The old top-p defect as a negative control: torch's CUDA cumsum as the prefix sum."""
    try:
        with switch.replaced("softmax", "cumsum", "cuda", lambda x: torch.cumsum(x, -1)):
            return grid_check(model, "invariant")
    except Exception:
        return failure()


def e2e_section(run: Run) -> dict[str, Any]:
    """Throughput of each variant ("hf", "invariant", "native") on one Qwen3-1.7B-shaped checkpoint."""
    args = run.args
    count, prompt_len, max_tokens = args.e2e
    chunk_size = args.chunk_size or prompt_len
    section: dict[str, Any] = {"workload": E2EWorkload(
        requests=count, prompt_tokens=prompt_len, output_tokens=max_tokens,
        model="Qwen3-1.7B-shaped, 28 layers, bf16, random weights", engine_chunk_size=chunk_size,
        engine_max_num_batched_tokens=args.max_batched_tokens,
        matmul_path="cuBLASLt without split-K where probed" if cublaslt_ready() else "Triton")}
    path = save_random_model(qwen3_config(28), run.tmp / "qwen3-1.7b-shaped")
    reqs = requests_for(151936, count, prompt_len, max_tokens)
    tiles = importlib.import_module("parity.kernels.triton.attention")
    for variant in args.e2e_variants:
        name = "hf_generate" if variant == "hf" else f"engine_{variant}"
        try:
            if variant == "hf":
                section[name] = hf_generate_tok_s(path, reqs, prompt_len, max_tokens)
            else:
                with module_constants(tiles, **plan_constants(variant)):
                    section[name] = engine_tok_s(path, engine_kernels(variant), reqs, chunk_size,
                                                 args.max_batched_tokens)
        except Exception:
            section[name] = failure()
        torch.cuda.empty_cache()
        run.checkpoint("e2e", section)
    return section


def tp_section(run: Run) -> dict[str, Any]:
    """Invariant-engine throughput on the Qwen3-1.7B shape without tensor parallelism and at TP=1
    (the canonical K-group layout in one process: its cost over the whole model) for each
    `--tp-groups` count of row-parallel K groups (`reduction_groups`), side by side in one run; with
    two GPUs also TP=2 (NCCL) at each even count, and whether its rollouts equal TP=1's bit for bit
    (the same count: each count is its own sum). With one GPU the TP=2 part is skipped, recorded."""
    args = run.args
    count, prompt_len, max_tokens = args.e2e
    chunk_size = args.chunk_size or prompt_len
    path = run.tmp / "qwen3-1.7b-shaped"
    if not path.exists():
        save_random_model(qwen3_config(28), path)
    reqs = requests_for(151936, count, prompt_len, max_tokens)
    two_gpus = torch.cuda.device_count() >= 2
    section: dict[str, Any] = {"workload": f"{count} seqs x {prompt_len} prompt x {max_tokens} output, "
                                           f"Qwen3-1.7B-shaped, 28 layers, bf16, invariant",
                               "reduction_groups": args.tp_groups}
    if not two_gpus:
        section["tp2_skipped"] = f"needs two GPUs, {torch.cuda.device_count()} visible"
    runs: list[tuple[str, int | None, int]] = [("whole_model", None, REDUCTION_GROUPS)]
    for groups in args.tp_groups:
        runs.append((f"tp1_g{groups}", 1, groups))
        if two_gpus and groups % 2 == 0:
            runs.append((f"tp2_g{groups}", 2, groups))
    for label, tp, groups in runs:
        try:
            section[label] = engine_tok_s(path, "invariant", reqs, chunk_size, args.max_batched_tokens,
                                          tensor_parallel_size=tp, reduction_groups=groups)
        except Exception:
            section[label] = failure()
        torch.cuda.empty_cache()
        run.checkpoint("tp", section)
    small = requests_for(151936, 8, 24, 16, n=2, seed=3)
    for groups in args.tp_groups if two_gpus else ():
        if groups % 2:
            continue
        try:
            settings = {"dtype": "bfloat16", "device": "cuda", "reduction_groups": groups}
            one = ReferenceEngine(str(path), tensor_parallel_size=1, **settings).generate(small)
            with ReferenceEngine(str(path), tensor_parallel_size=2, max_num_seqs=5, **settings) as engine:
                two = engine.generate(small)
            section[f"tp2_equals_tp1_g{groups}"] = all(a.token_ids == b.token_ids and a.logprobs == b.logprobs
                                                       for a, b in zip(one, two, strict=True))
        except Exception:
            section[f"tp2_equals_tp1_g{groups}"] = failure()
    return section


def profile_section(run: Run) -> ProfileResult:
    """Where the invariant engine's time goes at the e2e workload's shapes: torch.profiler over one
    generate of `--e2e` requests and prompt lengths with 64 output tokens (prefill, then decode steps
    at contexts past the prompt); the device-time table ($OUT/profile.txt) and device-busy vs wall
    seconds (the gap is host time the GPU waits for)."""
    from torch.profiler import ProfilerActivity, profile

    count, prompt_len, _ = run.args.e2e
    path = save_random_model(qwen3_config(28), run.tmp / "qwen3-1.7b-shaped")
    reqs = requests_for(151936, count, prompt_len, 64)
    with ReferenceEngine(str(path), dtype="bfloat16", device="cuda", kernels="invariant", max_num_seqs=count,
                         chunk_size=prompt_len, max_num_batched_tokens=run.args.max_batched_tokens) as engine:
        engine.generate(reqs)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            engine.generate(reqs)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
    events = prof.key_averages()
    (run.args.out / "profile.txt").write_text(events.table(sort_by="self_device_time_total", row_limit=40))
    busy = sum(e.self_device_time_total for e in events) / 1e6
    return ProfileResult(workload=f"{count} seqs x {prompt_len} prompt x 64 output, invariant",
                         wall_s=seconds, gpu_busy_s=busy, steps=65)


@contextmanager
def host_timers(parts: dict[str, tuple[Any, str]]) -> Iterator[tuple[dict[str, float], dict[str, int]]]:
    """Wrap each method `owner.name` of `parts` (label -> (owner, name)) to add its host seconds and
    calls under its label; the originals are put back on exit."""
    seconds: dict[str, float] = dict.fromkeys(parts, 0.0)
    calls: dict[str, int] = dict.fromkeys(parts, 0)
    originals = {label: getattr(owner, name) for label, (owner, name) in parts.items()}

    def timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - start
                calls[label] += 1
        return wrapper

    try:
        for label, (owner, name) in parts.items():
            setattr(owner, name, timed(label, originals[label]))
        yield seconds, calls
    finally:
        for label, (owner, name) in parts.items():
            setattr(owner, name, originals[label])


def step_split_section(run: Run) -> StepSplit:
    """Where the invariant engine's decode steps spend their wall time at the `--e2e` workload: host
    seconds per part of a step over one timed generate (after an identical warm-up generate), and
    each captured bucket's graph replayed alone (device ms). "_sample" includes the wait for the
    device (its device->host copy of the tokens); the sampler rows inside it are launch time only."""
    from parity.engine import engine as engine_module
    from parity.engine import graphs, sampler, scheduler

    count, prompt_len, max_tokens = run.args.e2e
    path = save_random_model(qwen3_config(28), run.tmp / "qwen3-1.7b-shaped")
    reqs = requests_for(151936, count, prompt_len, max_tokens)
    parts = {
        "scheduler.plan": (scheduler.Scheduler, "plan"),
        "scheduler.finish": (scheduler.Scheduler, "finish"),
        "graph step (inputs, copy, replay launch)": (graphs.StepGraphs, "run"),
        "eager step (prefill)": (engine_module.ReferenceEngine, "_eager_forward"),
        "_sample (launches + wait for the device)": (engine_module.ReferenceEngine, "_sample"),
        "  lm_head launch": (engine_module.forward, "logits"),
        "  processed_logprobs launch": (sampler, "processed_logprobs"),
        "  sample launch": (sampler, "sample"),
    }
    with ReferenceEngine(str(path), dtype="bfloat16", device="cuda", kernels="invariant", max_num_seqs=count,
                         chunk_size=run.args.chunk_size or prompt_len,
                         max_num_batched_tokens=run.args.max_batched_tokens) as engine:
        engine.generate(reqs)
        with host_timers(parts) as (seconds, calls):
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.generate(reqs)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        buckets = {}
        for (size, _, max_run), bucket in engine._graphs._buckets.items():
            if bucket.graph is not None:
                buckets[f"{size} tokens, max_run {max_run}"] = graph_replay_ms(bucket.graph)
    return StepSplit(workload=f"{count} seqs x {prompt_len} prompt x {max_tokens} output, invariant",
                     wall_s=wall, host_s=seconds, calls=calls, bucket_device_ms=buckets)


def graph_replay_ms(graph: torch.cuda.CUDAGraph, repeats: int = 10) -> float:
    """Device ms of one replay of an already captured graph (mean of `repeats`)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def cublaslt_section(run: Run) -> dict[str, Any]:
    """parity + the invariant engine again, in a process set up for the proven cuBLASLt matmul path."""
    args = run.args
    out = args.out / "cublaslt"
    cmd = module_command("--out", str(out), "--sections", "parity,e2e", "--e2e", ",".join(map(str, args.e2e)),
                         "--e2e-variants", "invariant", "--chunk-size", str(args.chunk_size), "--cublaslt",
                         "--max-batched-tokens", str(args.max_batched_tokens))
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **CUBLASLT_ENV}, capture_output=True, text=True)
    sub = json.loads((out / "gpu_results.json").read_text()) if (out / "gpu_results.json").exists() else {}
    return {"parity": sub.get("parity"), "e2e": sub.get("e2e"), "stderr": proc.stderr[-2000:]}


# -- round two: the load-time probe, the attention plan sweep, MoE end to end, the roofline -------

#: model families whose linear shapes the probe section routes (layers: 1, only shapes matter).
PROBE_FAMILIES = ("qwen3-1.7b", "llama-3.2-1b", "qwen3-30b-a3b")
#: models of the parity_shapes section: (label, shape, layers, vocab).
PARITY_SHAPES = [("llama-3.2-1b-2l", "llama-3.2-1b", 2, 128256),
                 ("qwen3-30b-a3b-2l", "qwen3-30b-a3b", 2, 151936),
                 ("qwen3-1.7b-2l", "qwen3-1.7b", 2, 151936)]


def linear_shapes(shape: str) -> list[tuple[int, int, bool]]:
    """Distinct (N, K, has_bias) of a shaped model's nn.Linear weights (built on the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shaped.shaped_config(shape, 1))
    return sorted({(m.weight.shape[0], m.weight.shape[1], m.bias is not None)
                   for m in model.modules() if isinstance(m, torch.nn.Linear)})


def probe_child() -> dict[str, Any]:
    """In a process started with CUBLASLT_ENV (and a fresh PARITY_CACHE): the load-time probe over
    each family's shapes, cold and from the cache, the routes it chose, a spot check of row
    invariance on other random data, and TFLOP/s of the routed linear vs the Triton kernel."""
    from parity.kernels.triton import matmul

    out: dict[str, Any] = {"env": {k: os.environ.get(k) for k in CUBLASLT_ENV}}
    with blas_library("cublaslt"):
        out["cublaslt_ready"] = cublaslt_ready()
        for family in PROBE_FAMILIES:
            shapes = linear_shapes(family)
            todo = {(torch.bfloat16, n, k) for n, k, bias in shapes if not bias}
            start = time.perf_counter()
            matmul.prepare(todo, torch.device("cuda"))
            cold = time.perf_counter() - start
            matmul.forget_verdicts(todo)
            start = time.perf_counter()
            matmul.prepare(todo, torch.device("cuda"))
            warm = time.perf_counter() - start
            routes = {f"{n}x{k}{'+bias' if bias else ''}": matmul.route(torch.bfloat16, n, k, bias)
                      for n, k, bias in shapes}
            spot = [rows_invariant(matmul.linear, n, k) for n, k, bias in shapes if not bias]
            speed = {f"{n}x{k}": {"routed": matmul_tflops(matmul.linear, n, k, BENCH_M),
                                  "triton": matmul_tflops(lambda x, w: matmul.launch(
                                      x, w, None, matmul.tile_config(x.dtype, *w.shape)), n, k, BENCH_M)}
                     for n, k, bias in shapes if not bias and n * k <= 8192 * 8192 and n > 256}
            out[family] = {"probe_cold_s": cold, "probe_cached_s": warm, "routes": routes,
                           "spot_check": spot, "tflops_graph": speed}
    return out


def probe_section(run: Run) -> dict[str, Any]:
    """The load-time matmul probe in a process set up for cuBLASLt (see `probe_child`)."""
    cache = run.tmp / "probe-cache"
    proc = subprocess.run(module_command("--probe-child"), cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **CUBLASLT_ENV, "PARITY_CACHE": str(cache)}, timeout=400)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": proc.stderr[-3000:]}


@dataclass(frozen=True)
class PlanResult:
    """One attention plan: times, its ratio to SDPA, and its bitwise checks (decode at position 255
    and the second of two prefill chunks, each vs the whole 256-token prefill)."""

    decode_ms: float
    prefill_ms: float
    sdpa_over_plan_decode: float
    flash_over_plan_prefill: float
    decode_equals_prefill: bool
    chunked_equals_prefill: bool


def attention_sweep_section(run: Run) -> dict[str, Any]:
    """Every candidate attention plan (`parity.kernels.triton.attention.CANDIDATES`) on the engine's
    cache at Qwen3-1.7B heads: decode (256 sequences at context 512) and prefill (256 x 256
    causal) times vs SDPA (flash where torch allows it), and per plan the bitwise checks; then
    the cross-plan table (decode under plan D == prefill under plan P?) for a phase-specific plan."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from parity.kernels.attention import (
        MAX_FLASH_ENTRIES,
        flash_over_cache,
        varlen_entries,
    )
    from parity.kernels.triton.attention import CANDIDATES, attention, shipped_config

    hq, hkv, d, cap, n_seq, plen = 16, 8, 128, 1024, 256, 256
    g = torch.Generator("cuda").manual_seed(3)
    kc = torch.randn(n_seq, hkv, cap, d, device="cuda", generator=g).to(torch.bfloat16)
    vc = torch.randn(n_seq, hkv, cap, d, device="cuda", generator=g).to(torch.bfloat16)
    qp = torch.randn(n_seq * plen, hq, d, device="cuda", generator=g).to(torch.bfloat16)
    seq = torch.arange(n_seq, device="cuda")
    p_slots, p_pos = seq.repeat_interleave(plen), torch.arange(plen, device="cuda").repeat(n_seq)
    last = p_pos == plen - 1
    first_chunk = p_pos < 100
    qd = torch.randn(n_seq, hq, d, device="cuda", generator=g).to(torch.bfloat16)
    d_pos = torch.full((n_seq,), 511, device="cuda")
    scale = d**-0.5

    # SDPA on contiguous per-sequence K/V (no cache gather: the fastest layout SDPA gets)
    qs = qp.view(n_seq, plen, hq, d).transpose(1, 2).contiguous()
    ks, vs = kc[:, :, :plen].contiguous(), vc[:, :, :plen].contiguous()
    kd, vd = kc[:, :, :512].contiguous(), vc[:, :, :512].contiguous()
    section: dict[str, Any] = {
        "shipped": {"decode": shipped_config(n_seq).name, "prefill": shipped_config(n_seq * plen).name},
        "timing": "median device ms per call replayed from a CUDA graph (no host launch cost)",
        "workload": {"decode": "256 sequences x context 512, Hq 16, Hkv 8, D 128, bf16",
                     "prefill": "256 sequences x 256 tokens causal, same heads"}}

    def timed(fn: Callable[[], Any]) -> float:
        return graph_ms(fn, [()])

    sdpa = F.scaled_dot_product_attention
    section["sdpa_decode_ms"] = timed(lambda: sdpa(qd[:, :, None], kd, vd, enable_gqa=True))
    section["sdpa_prefill_ms"] = timed(lambda: sdpa(qs, ks, vs, is_causal=True, enable_gqa=True))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        section["flash_prefill_ms"] = timed(lambda: sdpa(qs, ks, vs, is_causal=True, enable_gqa=True))
    # the stock attention of the baseline rows (b'): flash reading the slot cache in place, with one
    # entry per token at decode (as the engine's graphs make them) and one per run at prefill (as
    # its eager prefill steps make them)
    section["baseline_decode_ms"] = timed(lambda: flash_over_cache(qd, kc, vc, seq, d_pos, 1, scale))
    one = slice(0, MAX_FLASH_ENTRIES)
    runs = varlen_entries(p_slots[one], p_pos[one], hkv, cap, compact=True)
    section["baseline_prefill_ms"] = timed(
        lambda: flash_over_cache(qp[one], kc, vc, p_slots[one], p_pos[one], plen, scale, runs))
    section["baseline_note"] = f"prefill timed over the first {MAX_FLASH_ENTRIES} tokens (one flash launch)"
    shipped_prefill = attention(qp, kc, vc, p_slots, p_pos, scale)
    # the engine's decode steps pass max_run=1 (one-token launch); "decode_runs_ms" is the run kernel
    section["shipped_pair"] = {
        "decode_ms": timed(lambda: attention(qd, kc, vc, seq, d_pos, scale, max_run=1)),
        "decode_runs_ms": timed(lambda: attention(qd, kc, vc, seq, d_pos, scale)),
        "prefill_ms": timed(lambda: attention(qp, kc, vc, p_slots, p_pos, scale)),
        "decode_equals_prefill": torch.equal(attention(qp[last], kc, vc, seq, p_pos[last], scale, max_run=1),
                                             shipped_prefill[last]),
        "decode_runs_equals_prefill": torch.equal(attention(qp[last], kc, vc, seq, p_pos[last], scale),
                                                  shipped_prefill[last])}
    # the decode ratio is close to 1: five interleaved repeats of SDPA, the decode launch, the run kernel
    section["decode_repeats_ms"] = [
        {"sdpa": timed(lambda: sdpa(qd[:, :, None], kd, vd, enable_gqa=True)),
         "decode_launch": timed(lambda: attention(qd, kc, vc, seq, d_pos, scale, max_run=1)),
         "run_kernel": timed(lambda: attention(qd, kc, vc, seq, d_pos, scale))} for _ in range(5)]
    plans: dict[str, Any] = {}
    decoded: dict[str, torch.Tensor] = {}
    prefilled: dict[str, torch.Tensor] = {}
    for plan in (c for c in CANDIDATES if not run.args.attention_plans or c.name in run.args.attention_plans):
        try:
            whole = attention(qp, kc, vc, p_slots, p_pos, scale, plan)
            chunks = torch.empty_like(whole)
            chunks[first_chunk] = attention(qp[first_chunk], kc, vc, p_slots[first_chunk], p_pos[first_chunk],
                                            scale, plan)
            chunks[~first_chunk] = attention(qp[~first_chunk], kc, vc, p_slots[~first_chunk],
                                             p_pos[~first_chunk], scale, plan)
            dec = attention(qp[last], kc, vc, seq, p_pos[last], scale, plan)
            decoded[plan.name], prefilled[plan.name] = dec, whole[last]
            decode_ms = timed(lambda plan=plan: attention(qd, kc, vc, seq, d_pos, scale, plan))
            prefill_ms = timed(lambda plan=plan: attention(qp, kc, vc, p_slots, p_pos, scale, plan))
            plans[plan.name] = PlanResult(
                decode_ms=decode_ms, prefill_ms=prefill_ms,
                sdpa_over_plan_decode=section["sdpa_decode_ms"] / decode_ms,
                flash_over_plan_prefill=section["flash_prefill_ms"] / prefill_ms,
                decode_equals_prefill=torch.equal(dec, whole[last]),
                chunked_equals_prefill=torch.equal(chunks, whole))
        except Exception:
            plans[plan.name] = failure()
        run.checkpoint("attention_sweep", {**section, "plans": plans})
    section["plans"] = plans
    section["cross_decode_equals_prefill"] = {
        dn: {pn: torch.equal(dv, pv) for pn, pv in prefilled.items()} for dn, dv in decoded.items()}
    return section


def _moe_config(layers: int) -> Any:
    return shaped.shaped_config("qwen3-30b-a3b", layers, max_position_embeddings=1024)


def moe_e2e_section(run: Run) -> dict[str, Any]:
    """Throughput on a Qwen3-30B-A3B-shaped bf16 model with random weights and `--moe-layers` of its 48
    layers, built on the GPU in memory (48 layers are ~61 GB: more than the lent machine's disk holds):
    hf generate (first, on the unpatched model; `--moe-hf-tokens` output tokens), then the engine with
    each `--moe-variants` kernel set, with and without route recording (inside the CUDA graphs when
    the kernels allow graphs)."""
    from parity.models.loading import adopt_model

    args = run.args
    count, prompt_len, max_tokens = args.moe
    hf_tokens = args.moe_hf_tokens or max_tokens
    section: dict[str, Any] = {"workload": E2EWorkload(
        requests=count, prompt_tokens=prompt_len, output_tokens=max_tokens,
        model=f"Qwen3-30B-A3B-shaped, {args.moe_layers} of 48 layers, 128 experts, top-8, bf16, "
              "random weights built in GPU memory",
        engine_chunk_size=prompt_len, engine_max_num_batched_tokens=args.max_batched_tokens,
        matmul_path="cuBLASLt without split-K where probed" if cublaslt_ready() else "Triton"),
        "hf_generate_output_tokens": hf_tokens}
    config = _moe_config(args.moe_layers)
    where = run.tmp / "qwen3-30b-a3b-shaped"
    where.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(where)
    start = time.perf_counter()
    hf = shaped.build_random_model(config, device="cuda", dtype="bfloat16")
    torch.cuda.synchronize()
    section["build_s"] = time.perf_counter() - start
    reqs = requests_for(151936, count, prompt_len, max_tokens)
    if "hf" in args.moe_variants:
        try:
            section["hf_generate"] = hf_generate_tok_s(
                hf, requests_for(151936, count, prompt_len, hf_tokens), prompt_len, hf_tokens)
        except Exception:
            section["hf_generate"] = failure()
        run.checkpoint("moe_e2e", section)
    lm = adopt_model(hf, where, "bfloat16", "cuda")
    del hf
    for variant in (v for v in args.moe_variants if v != "hf"):
        for record in (False, True):
            name = f"engine_{variant}{'_routes' if record else ''}"
            try:
                section[name] = engine_tok_s(lm, engine_kernels(variant), reqs, prompt_len,
                                             args.max_batched_tokens, record_routes=record)
            except Exception:
                section[name] = failure()
            torch.cuda.empty_cache()
            run.checkpoint("moe_e2e", section)
    del lm
    gc.collect()
    torch.cuda.empty_cache()
    return section


def model_shape(config: Any) -> Any:
    """`benchmarks.roofline.ModelShape` of a transformers config (parameters counted on the meta device)."""
    from transformers import AutoModelForCausalLM

    from benchmarks.roofline import ModelShape

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())  # a tied lm_head is the embedding, counted once
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    embed = model.get_input_embeddings().weight.numel()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return ModelShape(dense_params=total - experts - (0 if tied else embed), expert_params=experts,
                      experts=int(getattr(config, "num_experts", 0) or 0),
                      top_k=int(getattr(config, "num_experts_per_tok", 0) or 0),
                      layers=config.num_hidden_layers, q_heads=config.num_attention_heads,
                      kv_heads=config.num_key_value_heads,
                      head_dim=getattr(config, "head_dim", None)
                      or config.hidden_size // config.num_attention_heads)


def measured_peaks() -> dict[str, float]:
    """Copy bandwidth (bytes/s, read + write of a 4 GiB buffer) and dense bf16 matmul peak (FLOP/s,
    8192^3 on default cuBLAS), measured here."""
    buffers = [torch.empty(2**31, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    copy_ms = bench(lambda: buffers[1].copy_(buffers[0]))
    buffers.clear()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = bench(lambda: a @ a)
    return {"copy_bytes_s": 2 * 2**32 / copy_ms * 1e3, "matmul_flop_s": 2 * 8192**3 / mm_ms * 1e3,
            "nominal_hbm_bytes_s": 4.8e12, "nominal_bf16_flop_s": 989e12}


def _e2e_rows(results: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Every finished end-to-end row of this run, by label -> (which workload, its result)."""
    rows: dict[str, tuple[str, dict[str, Any]]] = {}
    probed = results.get("probed") or {}
    for prefix, source, workload in (("dense", results.get("e2e") or {}, "dense"),
                                     ("dense[probed]", probed.get("e2e") or {}, "dense"),
                                     ("moe", results.get("moe_e2e") or {}, "moe"),
                                     ("moe[probed]", probed.get("moe_e2e") or {}, "moe")):
        for name, value in source.items():
            if isinstance(value, dict) and "output_tok_s" in value:
                rows[f"{prefix} {name}"] = (workload, value)
    return rows


def roofline_section(run: Run) -> dict[str, Any]:
    """Each end-to-end row of this run against its workload's lower bound (`benchmarks.roofline`)
    at the copy bandwidth and matmul peak measured here: bound tok/s and the fraction reached."""
    from benchmarks.roofline import bound

    args = run.args
    peaks = measured_peaks()
    shapes = {"dense": (model_shape(qwen3_config(28)), args.e2e),
              "moe": (model_shape(_moe_config(args.moe_layers)), args.moe)}
    bounds = {name: bound(shape, *workload, bandwidth=peaks["copy_bytes_s"], flops=peaks["matmul_flop_s"])
              for name, (shape, workload) in shapes.items()}
    rows = {label: {"output_tok_s": v["output_tok_s"], "bound_tok_s": bounds[w].output_tok_s,
                    "fraction_of_bound": v["output_tok_s"] / bounds[w].output_tok_s}
            for label, (w, v) in _e2e_rows(run.results).items()}
    return {"peaks": peaks, "shapes": {k: dataclasses.asdict(v[0]) for k, v in shapes.items()},
            "bounds": bounds, "rows": rows}


def parity_shapes_section(run: Run) -> dict[str, Any]:
    """Bitwise rollout == train_forward on other families' shapes (2 layers each; invariant, and
    native as the negative control), through whatever matmul route this process proves."""
    section: dict[str, Any] = {}
    for label, shape, layers, vocab in PARITY_SHAPES:
        config = shaped.shaped_config(shape, layers, vocab_size=vocab)
        path = shaped.save_random_model(config, run.tmp / label, device="cuda")
        for kernels in ("invariant", "native"):
            try:
                section[f"{label}/{kernels}"] = parity_check(str(path), vocab, kernels)
            except Exception:
                section[f"{label}/{kernels}"] = failure()
            run.checkpoint("parity_shapes", section)
    return section


#: what the probed section can run again in its cuBLASLt process.
PROBED_SECTIONS = ("parity_shapes", "e2e", "moe_e2e", "profile", "step_split")


def probed_section(run: Run) -> dict[str, Any]:
    """`--probed-sections` (parity_shapes, e2e, moe_e2e, profile, step_split; `--probed-e2e-variants`,
    invariant MoE) again in a process set up for cuBLASLt, where every model's shapes go through the
    load-time probe (no hand-written shape list)."""
    args = run.args
    out = args.out / "probed"
    cmd = module_command("--out", str(out), "--sections", ",".join(args.probed_sections), "--cublaslt",
                         "--e2e", ",".join(map(str, args.e2e)),
                         "--e2e-variants", ",".join(args.probed_e2e_variants),
                         "--moe", ",".join(map(str, args.moe)), "--moe-layers", str(args.moe_layers),
                         "--moe-variants", "invariant", "--chunk-size", str(args.chunk_size),
                         "--max-batched-tokens", str(args.max_batched_tokens))
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **CUBLASLT_ENV}, capture_output=True, text=True)
    sub = json.loads((out / "gpu_results.json").read_text()) if (out / "gpu_results.json").exists() else {}
    return {**{k: sub.get(k) for k in PROBED_SECTIONS}, "stderr": proc.stderr[-2000:]}


#: Every section, by the name `--sections` takes, in the default order.
SECTIONS: dict[str, Callable[[Run], Any]] = {
    "kernels": kernels_section,
    "parity": parity_section,
    "e2e": e2e_section,
    "profile": profile_section,
    "step_split": step_split_section,
    "cublaslt": cublaslt_section,
    "probe": probe_section,
    "attention_sweep": attention_sweep_section,
    "parity_shapes": parity_shapes_section,
    "moe_e2e": moe_e2e_section,
    "probed": probed_section,
    "roofline": roofline_section,
    "tp": tp_section,
}


# -- the short table -----------------------------------------------------------------------------


def _invariance_line(key: str, entries: list[dict[str, Any]]) -> str:
    bad = [e["shape"] for e in entries if not e["invariant"]]
    return f"{key}: {'all row-invariant' if not bad else f'NOT invariant at {bad}'}"


def kernels_lines(k: dict[str, Any]) -> list[str]:
    lines = []
    for shape, entry in k.get("matmul", {}).items():
        for m in BENCH_M:
            c, t = entry["cublas"]["graph"][m], entry["triton"]["graph"][m]
            lines.append(f"matmul {shape} M={m:<5} triton {t:7.1f} TFLOP/s  cuBLAS {c:7.1f}  "
                         f"ratio {t / c:5.2f}")
    lt = k.get("cublaslt_nosplitk", {})
    for shape, speed in lt.get("tflops", {}).items():
        lines.append(f"cuBLASLt no-split-K {shape}: "
                     + "  ".join(f"M={m} {v:.1f}" for m, v in speed["graph"].items()))
    for key in ("triton_invariance", "cublas_default_invariance"):
        if key in k:
            lines.append(_invariance_line(key, k[key]))
    if "invariance" in lt:
        lines.append(_invariance_line("cublaslt_nosplitk_invariance", lt["invariance"]))
    for name, a in k.get("attention", {}).items():
        lines.append(f"attention {name}: triton {a['triton_ms']:.3f} ms  SDPA {a['sdpa_ms']:.3f} ms  "
                     f"SDPA/triton {a['ratio_sdpa_over_triton']:.2f}")
    return lines


def parity_lines(parity: dict[str, Any], label: str) -> list[str]:
    lines = []
    for name, entry in parity.get("sampling_grid", {}).items():
        verdict = "ERROR" if "error" in entry else \
            f"{entry['differing']} of {entry['tokens']} tokens differ (max {entry['max_abs_diff']:.2e})"
        lines.append(f"sampling grid{label} {name}: {verdict}")
    for name, entry in parity.items():
        if isinstance(entry, dict) and name != "sampling_grid":
            graphs = "; ".join(sorted({c["step_graphs"] for c in entry.get("compositions", [])}))
            verdict = "ERROR" if "error" in entry else \
                f"bitwise equal: {entry['all_bitwise_equal']} [{graphs}]"
            lines.append(f"parity{label} {name}: rollout vs train_forward {verdict}")
    return lines


def e2e_lines(e2e: dict[str, Any], label: str) -> list[str]:
    lines = []
    for name, v in e2e.items():
        if isinstance(v, dict) and name != "workload":
            graphs = f" [{v['step_graphs']}]" if v.get("step_graphs") else ""
            got = "ERROR" if "error" in v else \
                f"{v['output_tok_s']:.0f} output tok/s ({v['seconds']:.1f} s){graphs}"
            lines.append(f"e2e{label} {name}: {got}")
    return lines


def round_two_lines(results: dict[str, Any]) -> list[str]:
    """Lines of the probe, attention_sweep, parity_shapes, moe_e2e, probed and roofline sections."""
    lines = []
    probe = results.get("probe", {})
    for family in PROBE_FAMILIES:
        entry = probe.get(family)
        if entry:
            routes = entry["routes"]
            fast = sum(1 for path, _ in routes.values() if path == "cublaslt")
            spot = all(s["invariant"] for s in entry["spot_check"])
            verdict = "row-invariant" if spot else "NOT row-invariant"
            lines.append(f"probe {family}: {fast} of {len(routes)} shapes on cuBLASLt, spot check {verdict}, "
                         f"probe {entry['probe_cold_s']:.2f} s cold / {entry['probe_cached_s']:.3f} s cached")
            for shape, speed in entry.get("tflops_graph", {}).items():
                r, t = speed["routed"]["graph"], speed["triton"]["graph"]
                lines.append(f"  {shape} routed/triton TFLOP/s: "
                             + "  ".join(f"M={m} {r[m]:.0f}/{t[m]:.0f}" for m in r))
    sweep = results.get("attention_sweep", {})
    pair = sweep.get("shipped_pair")
    if pair:
        decode, prefill = pair["decode_ms"], pair["prefill_ms"]
        lines.append(f"attention shipped {sweep['shipped']}: decode {decode:.3f} ms (SDPA/plan "
                     f"{sweep['sdpa_decode_ms'] / decode:.2f})  prefill {prefill:.3f} ms (flash/plan "
                     f"{sweep['flash_prefill_ms'] / prefill:.2f})  decode==prefill "
                     f"{pair['decode_equals_prefill']}; run kernel at decode {pair['decode_runs_ms']:.3f} ms")
        for rep in sweep.get("decode_repeats_ms", ()):
            sdpa, launch, runs = rep["sdpa"], rep["decode_launch"], rep["run_kernel"]
            lines.append(f"  decode repeat: SDPA {sdpa:.4f} ms, decode launch {launch:.4f} ms "
                         f"({sdpa / launch:.3f}x), run kernel {runs:.4f} ms ({sdpa / runs:.3f}x)")
        lines.append(f"attention of the baseline (b', flash over the cache): decode "
                     f"{sweep['baseline_decode_ms']:.3f} ms, prefill {sweep['baseline_prefill_ms']:.3f} ms")
    for name, plan in sweep.get("plans", {}).items():
        if "error" in plan:
            lines.append(f"attention plan {name}: ERROR")
            continue
        lines.append(f"attention plan {name}: decode {plan['decode_ms']:.3f} ms (SDPA/plan "
                     f"{plan['sdpa_over_plan_decode']:.2f})  prefill {plan['prefill_ms']:.3f} ms (flash/plan "
                     f"{plan['flash_over_plan_prefill']:.2f})  decode==prefill "
                     f"{plan['decode_equals_prefill']}  chunked==prefill {plan['chunked_equals_prefill']}")
    probed = results.get("probed") or {}
    for label, parity in (("", results.get("parity_shapes") or {}),
                          (" [probed]", probed.get("parity_shapes") or {})):
        lines += parity_lines(parity, label)
    for label, moe in (("", results.get("moe_e2e") or {}), (" [probed]", probed.get("moe_e2e") or {})):
        for name, v in moe.items():
            if isinstance(v, dict) and name != "workload":
                got = "ERROR" if "error" in v else \
                    f"{v['output_tok_s']:.0f} output tok/s ({v['seconds']:.1f} s)"
                lines.append(f"moe{label} {name}: {got}")
    lines += e2e_lines(probed.get("e2e") or {}, " [probed]")
    for label, row in (results.get("roofline") or {}).get("rows", {}).items():
        lines.append(f"roofline {label}: {row['output_tok_s']:.0f} of {row['bound_tok_s']:.0f} tok/s bound "
                     f"({row['fraction_of_bound']:.0%})")
    return lines


def table(results: dict[str, Any]) -> str:
    """The short summary printed at the end, from the JSON form of the results."""
    lines = kernels_lines(results.get("kernels", {}))
    sub = results.get("cublaslt", {})
    for label, parity, e2e in (("", results.get("parity", {}), results.get("e2e", {})),
                               (" [cuBLASLt]", sub.get("parity") or {}, sub.get("e2e") or {})):
        lines += parity_lines(parity, label) + e2e_lines(e2e, label)
    e = results.get("e2e", {})
    ok = {n: e[n]["output_tok_s"] for n in ("engine_invariant", "engine_native", "hf_generate")
          if n in e and "error" not in e[n]}
    lt_e2e = (sub.get("e2e") or {}).get("engine_invariant", {})
    if "output_tok_s" in lt_e2e:
        ok["engine_invariant_cublaslt"] = lt_e2e["output_tok_s"]
    for a in ("engine_invariant", "engine_invariant_cublaslt"):
        for b in ("engine_native", "hf_generate"):
            if a in ok and b in ok:
                lines.append(f"e2e ratio {a} / {b}: {ok[a] / ok[b]:.2f}")
    lines += round_two_lines(results)
    prof = results.get("profile", {})
    if "wall_s" in prof:
        lines.append(f"profile ({prof['workload']}): wall {prof['wall_s']:.2f} s, "
                     f"GPU busy {prof['gpu_busy_s']:.2f} s")
    probed = results.get("probed") or {}
    for label, split in (("", results.get("step_split")), (" [probed]", probed.get("step_split"))):
        if isinstance(split, dict) and "wall_s" in split:
            lines.append(f"step split{label} ({split['workload']}): wall {split['wall_s']:.2f} s")
            lines += [f"  {part}: {sec:.3f} s over {split['calls'][part]} calls"
                      for part, sec in split["host_s"].items()]
            lines += [f"  graph {bucket}: {ms:.3f} ms device"
                      for bucket, ms in split["bucket_device_ms"].items()]
    tp = results.get("tp", {})
    rates = {k: v["output_tok_s"] for k, v in tp.items() if isinstance(v, dict) and "output_tok_s" in v}
    for name, rate in rates.items():
        lines.append(f"tp ({tp['workload']}): {name} {rate:.0f} tok/s")
    for groups in tp.get("reduction_groups", ()):
        for a, b in ((f"tp1_g{groups}", "whole_model"), (f"tp2_g{groups}", f"tp1_g{groups}")):
            if a in rates and b in rates:
                lines.append(f"tp ratio {a} / {b}: {rates[a] / rates[b]:.3f}")
        if f"tp2_equals_tp1_g{groups}" in tp:
            lines.append(f"tp: TP=2 rollouts equal TP=1 bit for bit ({groups} groups): "
                         f"{tp[f'tp2_equals_tp1_g{groups}']}")
    if "tp2_skipped" in tp:
        lines.append(f"tp: TP=2 skipped ({tp['tp2_skipped']})")
    for section in SECTIONS:
        if "error" in results.get(section, {}):
            lines.append(f"{section}: ERROR (see gpu_results.json)")
    return "\n".join(lines)


# -- command line --------------------------------------------------------------------------------


def _names(text: str, choices: tuple[str, ...] | list[str], what: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in choices]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {what} {unknown}; choose from {', '.join(choices)}")
    return names


def _shape(text: str) -> tuple[int, int, int]:
    try:
        count, prompt_len, max_tokens = (int(v) for v in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected requests,prompt_tokens,output_tokens, got {text!r}") \
            from exc
    return count, prompt_len, max_tokens


def _groups(text: str) -> list[int]:
    try:
        groups = [int(v) for v in text.split(",") if v]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not groups or any(g < 1 for g in groups):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return groups


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-results"))
    parser.add_argument("--sections", type=lambda t: _names(t, list(SECTIONS), "sections"),
                        default="kernels,parity,e2e,cublaslt",
                        help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--e2e", type=_shape, default="256,256,512",
                        help="requests,prompt_tokens,output_tokens")
    parser.add_argument("--e2e-variants", type=lambda t: variant_names(t, "e2e variants"),
                        default="hf,invariant,native",
                        help=f"comma-separated, of {', '.join(E2E_VARIANTS)} or invariant@PLAN")
    parser.add_argument("--probed-sections", type=lambda t: _names(t, PROBED_SECTIONS, "probed sections"),
                        default=",".join(PROBED_SECTIONS), help="the sections the probed section runs")
    parser.add_argument("--probed-e2e-variants", type=lambda t: variant_names(t, "probed e2e variants"),
                        default="invariant", help="the e2e variants the probed section runs")
    parser.add_argument("--chunk-size", type=int, default=0,
                        help="engine prefill tokens per sequence per step (0: whole prompt)")
    parser.add_argument("--max-batched-tokens", type=int, default=8192,
                        help="engine tokens per step (bounds prefill steps)")
    parser.add_argument("--cublaslt", action="store_true", help="prefer cuBLASLt (run with CUBLASLT_ENV set)")
    parser.add_argument("--moe", type=_shape, default="256,256,512",
                        help="MoE workload: requests,prompt_tokens,output_tokens")
    parser.add_argument("--moe-layers", type=int, default=4, help="layers of the Qwen3-30B-A3B-shaped model")
    parser.add_argument("--attention-plans", type=lambda t: [n for n in t.split(",") if n], default=[],
                        help="attention_sweep: only these plans (names as in its table; default: all)")
    parser.add_argument("--moe-hf-tokens", type=int, default=0,
                        help="output tokens of the MoE hf generate row (default: the --moe workload's)")
    parser.add_argument("--moe-variants", type=lambda t: _names(t, E2E_VARIANTS, "moe variants"),
                        default="hf,invariant,native", help=f"comma-separated, of {', '.join(E2E_VARIANTS)}")
    parser.add_argument("--tp-groups", type=_groups, default="8",
                        help="tp section: comma-separated row-parallel K group counts (reduction_groups) to "
                             "measure TP=1 (and TP=2 with two GPUs, even counts) at")
    parser.add_argument("--cublaslt-probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe-child", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.cublaslt_probe:
        print(json.dumps(plain(cublaslt_probe())))
        return
    if args.probe_child:
        print(json.dumps(plain(probe_child())))
        return
    import transformers
    import triton

    import parity.kernels.triton as triton_kernels

    args.out.mkdir(parents=True, exist_ok=True)
    with blas_library("cublaslt") if args.cublaslt else nullcontext(), tempfile.TemporaryDirectory() as tmp:
        triton_kernels.register()
        run = Run(args, Path(tmp), {
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "command": " ".join(sys.argv),
        })
        for name in args.sections:
            start = time.perf_counter()
            try:
                run.results[name] = plain(SECTIONS[name](run))
            except Exception:
                run.results.setdefault(name, {}).update(failure())
            run.results.setdefault(name, {})["section_seconds"] = time.perf_counter() - start
            run.save()
            torch.cuda.empty_cache()  # a section's cached blocks would crowd a later subprocess
            print(f"[{name}] done in {time.perf_counter() - start:.0f} s", flush=True)
    print(table(run.results))


if __name__ == "__main__":
    main()
