"""The probed section: `--probed-sections` again in a child process set up for cuBLASLt, where every
model's linear shapes go through the load-time probe (no hand-written shape list): parity_shapes,
e2e (`--probed-e2e-variants`), moe_e2e (invariant), profile, step_split.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

from benchmarks.gpu.records import decoded
from benchmarks.gpu.results import (
    E2ESection,
    MoESection,
    ParitySection,
    ProbedSection,
    ProfileResult,
    StepSplit,
)
from benchmarks.gpu.run import ROOT, Run, module_command, saved_results
from parity.kernels.triton.matmul import CUBLASLT_ENV

#: what the probed section can run again in its cuBLASLt process, with the type of each result.
PROBED_RESULTS: dict[str, type] = {"parity_shapes": ParitySection, "e2e": E2ESection, "moe_e2e": MoESection,
                                   "profile": ProfileResult, "step_split": StepSplit}
PROBED_SECTIONS = tuple(PROBED_RESULTS)


def measure(run: Run) -> ProbedSection:
    """See the module docstring."""
    args = run.args
    out = args.out / "probed"
    cmd = module_command("--out", str(out), "--sections", ",".join(args.probed_sections), "--cublaslt",
                         "--e2e", ",".join(map(str, args.e2e)),
                         "--e2e-variants", ",".join(args.probed_e2e_variants),
                         "--moe", ",".join(map(str, args.moe)), "--moe-layers", str(args.moe_layers),
                         "--moe-distinct-layers", str(args.moe_distinct_layers),
                         "--moe-variants", "invariant", "--chunk-size", str(args.chunk_size),
                         "--max-batched-tokens", str(args.max_batched_tokens))
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **CUBLASLT_ENV}, capture_output=True, text=True)
    sub = saved_results(out)
    results: dict[str, Any] = {name: None if sub.get(name) is None else decoded(kind, sub[name])
                               for name, kind in PROBED_RESULTS.items()}
    return ProbedSection(**results, stderr=proc.stderr[-2000:])
