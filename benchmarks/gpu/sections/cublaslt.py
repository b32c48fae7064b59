"""The cublaslt section: parity and the invariant engine's e2e row again, in a child process set up
for the proven cuBLASLt matmul path (`CUBLASLT_ENV`, cuBLASLt preferred; `parity.kernels.triton.matmul`).
"""

from __future__ import annotations

import os
import subprocess

from benchmarks.gpu.records import decoded
from benchmarks.gpu.results import CublasLtSection, E2ESection, ParitySection
from benchmarks.gpu.run import ROOT, Run, module_command, saved_results
from parity.kernels.triton.matmul import CUBLASLT_ENV


def measure(run: Run) -> CublasLtSection:
    """See the module docstring."""
    args = run.args
    out = args.out / "cublaslt"
    cmd = module_command("--out", str(out), "--sections", "parity,e2e", "--e2e", ",".join(map(str, args.e2e)),
                         "--e2e-variants", "invariant", "--chunk-size", str(args.chunk_size), "--cublaslt",
                         "--max-batched-tokens", str(args.max_batched_tokens))
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **CUBLASLT_ENV}, capture_output=True, text=True)
    sub = saved_results(out)
    return CublasLtSection(
        parity=None if sub.get("parity") is None else decoded(ParitySection, sub["parity"]),
        e2e=None if sub.get("e2e") is None else decoded(E2ESection, sub["e2e"]),
        stderr=proc.stderr[-2000:])
