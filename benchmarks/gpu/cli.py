"""The command line of `python3 -m benchmarks.gpu`: parse the flags, run each section, print the table.

Each section runs independently: a failure is recorded and the next section still runs. The
results are saved after every section; `--cublaslt-probe` and `--probe-child` are the child
processes of the kernels and probe sections (they print their result as one JSON line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch

import benchmarks.gpu
from benchmarks.gpu.records import failure, plain
from benchmarks.gpu.run import Run
from benchmarks.gpu.sections import SECTIONS, kernels, probe
from benchmarks.gpu.sections.probed import PROBED_SECTIONS
from benchmarks.gpu.settings import blas_library
from benchmarks.gpu.table import table
from benchmarks.gpu.workloads import E2E_VARIANTS, variant_choices


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


def _variants(what: str) -> Callable[[str], list[str]]:
    """The parser of a list of e2e variants (hf, invariant, native, baseline, invariant@PLAN)."""
    return lambda text: _names(text, variant_choices(), what)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags (every one the commands in docs/PERF.md use)."""
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks.gpu",
                                     description=benchmarks.gpu.__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-results"))
    parser.add_argument("--sections", type=lambda t: _names(t, list(SECTIONS), "sections"),
                        default="kernels,parity,e2e,cublaslt",
                        help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--e2e", type=_shape, default="256,256,512",
                        help="requests,prompt_tokens,output_tokens")
    parser.add_argument("--e2e-variants", type=_variants("e2e variants"), default="hf,invariant,native",
                        help=f"comma-separated, of {', '.join(E2E_VARIANTS)} or invariant@PLAN")
    parser.add_argument("--e2e-repeats", type=int, default=3,
                        help="timed generate calls per engine variant after its warm-up (median kept)")
    parser.add_argument("--triton-cache", type=Path,
                        help="Triton's kernel cache directory (TRITON_CACHE_DIR): keep it between runs and "
                             "the next run's cold start skips the compiles")
    parser.add_argument("--probed-sections", type=lambda t: _names(t, PROBED_SECTIONS, "probed sections"),
                        default=",".join(PROBED_SECTIONS), help="the sections the probed section runs")
    parser.add_argument("--probed-e2e-variants", type=_variants("probed e2e variants"),
                        default="invariant", help="the e2e variants the probed section runs")
    parser.add_argument("--chunk-size", type=int, default=0,
                        help="engine prefill tokens per sequence per step (0: whole prompt)")
    parser.add_argument("--max-batched-tokens", type=int, default=8192,
                        help="engine tokens per step (bounds prefill steps)")
    parser.add_argument("--cublaslt", action="store_true", help="prefer cuBLASLt (run with CUBLASLT_ENV set)")
    parser.add_argument("--moe", type=_shape, default="256,256,512",
                        help="MoE workload: requests,prompt_tokens,output_tokens")
    parser.add_argument("--moe-layers", type=int, default=4, help="layers of the Qwen3-30B-A3B-shaped model")
    parser.add_argument("--moe-distinct-layers", type=int, default=0,
                        help="build only this many layers' experts; later layers reuse them "
                             "(workloads.share_experts: 48 layers on an 80 GB card; 0: all distinct)")
    parser.add_argument("--attention-plans", type=lambda t: [n for n in t.split(",") if n], default=[],
                        help="attention_sweep: only these plans (names as in its table; default: all)")
    parser.add_argument("--moe-hf-tokens", type=int, default=0,
                        help="output tokens of the MoE hf generate row (default: the --moe workload's)")
    parser.add_argument("--moe-variants", type=lambda t: _names(t, E2E_VARIANTS, "moe variants"),
                        default="hf,invariant,native", help=f"comma-separated, of {', '.join(E2E_VARIANTS)}")
    parser.add_argument("--tp-groups", type=_groups, default="8",
                        help="tp section: comma-separated row-parallel K group counts (reduction_groups) to "
                             "measure TP=1 (and TP=2 with two GPUs, even counts) at")
    parser.add_argument("--profile-tokens", type=int, default=64,
                        help="profile section: output tokens of the profiled generate (its requests and "
                             "prompts are --e2e's)")
    parser.add_argument("--profile-model", choices=("dense", "moe"), default="dense",
                        help="profile section: the dense shape at --e2e, or the MoE shape at --moe and "
                             "--moe-layers with its routes recorded")
    parser.add_argument("--cublaslt-probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 0 <= args.moe_distinct_layers <= args.moe_layers:
        parser.error(f"--moe-distinct-layers {args.moe_distinct_layers}: from 0 (every layer's experts "
                     f"distinct) to --moe-layers ({args.moe_layers})")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.cublaslt_probe:
        print(json.dumps(plain(kernels.cublaslt_child())))
        return
    if args.probe_child:
        print(json.dumps(plain(probe.probe_child())))
        return
    if args.triton_cache is not None:
        args.triton_cache.mkdir(parents=True, exist_ok=True)
        os.environ["TRITON_CACHE_DIR"] = str(args.triton_cache.resolve())  # read at each compile
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
                result = SECTIONS[name](run)
            except Exception:
                result = failure()
            run.finish(name, result, time.perf_counter() - start)
            torch.cuda.empty_cache()  # a section's cached blocks would crowd a later subprocess
            print(f"[{name}] done in {time.perf_counter() - start:.0f} s", flush=True)
    print(table(run.results))
