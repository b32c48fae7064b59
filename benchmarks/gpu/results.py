"""What each section measures, as typed results; `gpu_results.json` holds them as JSON (`records`).

Times are milliseconds (`_ms`) or seconds (`_s`), speeds TFLOP/s or output tokens per second. A
measurement that raised is a `Failure` in its place, so one failed row never hides the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from benchmarks.roofline import Bound, ModelShape
from parity.engine.selfcheck import SettingCheck


@dataclass(frozen=True)
class Failure:
    """A measurement (a row, or a whole section) that raised: the end of its traceback."""

    error: str


# -- kernels ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowInvariance:
    """Whether linear(x[:m]) == linear(x)[:m] bitwise for every probed m, at weight [n, k] (`shape`)."""

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
    """The kernels section: row invariance of each matmul path, and each kernel against torch."""

    triton_invariance: list[RowInvariance]
    cublas_default_invariance: list[RowInvariance]
    cublaslt_nosplitk: CublasLtProbe | Failure
    matmul: dict[str, MatmulComparison]
    attention: dict[str, AttentionTiming]
    rmsnorm_65536x2048: KernelTiming
    log_softmax_256x151936_fp32: KernelTiming


# -- bitwise parity --------------------------------------------------------------------------------


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
    """One (model, kernels) pair over every engine composition."""

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
class ParitySection:
    """The parity and parity_shapes sections: bitwise checks by "model/kernels", and the sampling
    grid by "model/kernels" (parity only)."""

    checks: dict[str, ParityCheck | Failure]
    sampling_grid: dict[str, GridCheck | Failure] = field(default_factory=dict)


# -- throughput ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class E2EWorkload:
    """What an end-to-end section runs: requests x prompt x output tokens on `model`."""

    requests: int
    prompt_tokens: int
    output_tokens: int
    model: str
    engine_chunk_size: int
    engine_max_num_batched_tokens: int
    matmul_path: str


@dataclass(frozen=True)
class Throughput:
    """Output tokens per second of one generate call (the median of `runs_tok_s` when timed more
    than once); step_graphs: the engine's graph status; cold_start_s: seconds of the engine's
    `warm_up` (kernel compiles, graph captures, the KV cache) paid before the first timed call;
    spread: (max - min) / median of runs_tok_s."""

    seconds: float
    output_tokens: int
    output_tok_s: float
    step_graphs: str | None = None
    cold_start_s: float | None = None
    runs_tok_s: list[float] | None = None
    spread: float | None = None


@dataclass(frozen=True)
class E2ESection:
    """The e2e section: one row per variant ("hf_generate", "engine_{variant}")."""

    workload: E2EWorkload
    rows: dict[str, Throughput | Failure]


@dataclass(frozen=True)
class MoESection:
    """The moe_e2e section: hf generate ("hf_generate", `hf_generate_output_tokens` long) and the
    engine per kernel set, with and without route recording ("engine_{variant}[_routes]");
    build_s: seconds to build the random model in GPU memory."""

    workload: E2EWorkload
    hf_generate_output_tokens: int
    build_s: float
    rows: dict[str, Throughput | Failure]


@dataclass(frozen=True)
class TPSection:
    """The tp section: rows "whole_model", "tp1_g{groups}", "tp2_g{groups}"; whether TP=2's rollouts
    equal TP=1's bit for bit, by group count; why TP=2 was skipped, if it was."""

    workload: str
    reduction_groups: list[int]
    rows: dict[str, Throughput | Failure]
    tp2_equals_tp1: dict[int, bool | Failure]
    tp2_skipped: str | None


@dataclass(frozen=True)
class TPSimRow:
    """One group count of the tp_sim section: rank 0 of a 2-way shard timed alone (`rank_seconds`
    for `output_tokens`), the bytes it would receive from its peer and the collectives it would make,
    and the TP=2 output tok/s projected per link of `TPSimSection.links`."""

    groups: int
    rank_seconds: float
    output_tokens: int
    received_bytes: int
    collectives: int
    step_graphs: str | None
    projected_tp2_tok_s: dict[str, float]


@dataclass(frozen=True)
class TPSimSection:
    """The tp_sim section: links (name, bytes/s received, seconds per collective), rows "g{groups}"."""

    workload: str
    links: list[tuple[str, float, float]]
    rows: dict[str, TPSimRow | Failure]


# -- where the time goes ---------------------------------------------------------------------------


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
    """torch.profiler over one generate: wall and device-busy seconds over `steps` steps, the seconds
    the device idled between kernels, and the device seconds of the heaviest kernels by name."""

    workload: str
    wall_s: float
    gpu_busy_s: float
    steps: int
    idle_s: float = 0.0
    top_kernels: dict[str, float] = field(default_factory=dict)
    idle_by_gap: dict[str, float] = field(default_factory=dict)
    idle_top: dict[str, float] = field(default_factory=dict)


# -- the load-time matmul probe --------------------------------------------------------------------


@dataclass(frozen=True)
class RoutedSpeed:
    """TFLOP/s of one shape through its probed route and through the Triton kernel."""

    routed: MatmulSpeed
    triton: MatmulSpeed


@dataclass(frozen=True)
class ProbedFamily:
    """One model family's shapes through the probe: seconds cold and cached, the route of each shape
    ("NxK[+bias]" -> (path, why)), a spot check of row invariance, TFLOP/s routed vs Triton."""

    probe_cold_s: float
    probe_cached_s: float
    routes: dict[str, tuple[str, str]]
    spot_check: list[RowInvariance]
    tflops_graph: dict[str, RoutedSpeed]


@dataclass(frozen=True)
class ProbeResult:
    """The probe section (a process set up for cuBLASLt): its environment and each family."""

    env: dict[str, str | None]
    cublaslt_ready: bool
    families: dict[str, ProbedFamily]


# -- attention plans -------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class ShippedPair:
    """The shipped plans: the decode launch (max_run=1) and the run kernel at decode, prefill, and
    whether each decode equals the prefill's last rows bit for bit."""

    decode_ms: float
    decode_runs_ms: float
    prefill_ms: float
    decode_equals_prefill: bool
    decode_runs_equals_prefill: bool


@dataclass(frozen=True)
class DecodeRepeat:
    """One interleaved repeat of the decode timings (ms): SDPA, the decode launch, the run kernel."""

    sdpa: float
    decode_launch: float
    run_kernel: float


@dataclass(frozen=True)
class AttentionSweep:
    """The attention_sweep section: SDPA, flash and the baseline's attention, the shipped pair, and
    every candidate plan; cross_decode_equals_prefill[D][P]: decode under plan D == prefill under P."""

    shipped: dict[str, str]
    timing: str
    workload: dict[str, str]
    sdpa_decode_ms: float
    sdpa_prefill_ms: float
    flash_prefill_ms: float
    baseline_decode_ms: float
    baseline_prefill_ms: float
    baseline_note: str
    shipped_pair: ShippedPair
    decode_repeats_ms: list[DecodeRepeat]
    plans: dict[str, PlanResult | Failure]
    cross_decode_equals_prefill: dict[str, dict[str, bool]]


# -- sections run again in a process set up for cuBLASLt -------------------------------------------


@dataclass(frozen=True)
class CublasLtSection:
    """The cublaslt section: parity and e2e from the child process (None: it wrote no result)."""

    parity: ParitySection | Failure | None
    e2e: E2ESection | Failure | None
    stderr: str


@dataclass(frozen=True)
class ProbedSection:
    """The probed section: the `--probed-sections` results of the child process (None: not run)."""

    parity_shapes: ParitySection | Failure | None
    e2e: E2ESection | Failure | None
    moe_e2e: MoESection | Failure | None
    profile: ProfileResult | Failure | None
    step_split: StepSplit | Failure | None
    stderr: str


# -- the roofline ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RooflineRow:
    """One end-to-end row against its workload's bound."""

    output_tok_s: float
    bound_tok_s: float
    fraction_of_bound: float


@dataclass(frozen=True)
class RooflineResult:
    """The roofline section: measured peaks, each workload's shape and bound, every row against it."""

    peaks: dict[str, float]
    shapes: dict[str, ModelShape]
    bounds: dict[str, Bound]
    rows: dict[str, RooflineRow]
