"""How long an audit takes: one engine start, every check, on one case (issue 35: the smoke case on
vLLM-CPU in under 3 minutes on the 2-core machine).

Run (it starts an engine: under the shared lock on the shared machine):
    flock /tmp/parity-heavy.lock .venv/bin/python -m benchmarks.audit_speed [--backend vllm]
        [--case cases/smoke.toml] [--dtype bfloat16] [--option KEY=VALUE ...] [--repeats 1]

Times the engine start, then `--repeats` whole audits on that one engine (the seconds of each check
come from the audit's own provenance: the first check pays for the run the others share), and
prints a Markdown table of medians for docs/PERF.md, then the last audit's result.
"""

from __future__ import annotations

import argparse
import statistics
import time

from parity.audit import CHECKS, audit
from parity.backends import get_backend, parse_option
from parity.workload.cases import load_case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="vllm")
    parser.add_argument("--case", default="cases/smoke.toml")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()

    case = load_case(args.case)
    dtype = args.dtype or case.dtypes[0]
    t0 = time.perf_counter()
    engine = get_backend(args.backend, case.model, dtype=dtype, **dict(parse_option(o) for o in args.option))
    start = time.perf_counter() - t0
    totals, per_check = [], {name: [] for name in CHECKS}
    try:
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            result = audit(None, engine, case=case, dtype=dtype)
            totals.append(time.perf_counter() - t0)
            for name, seconds in result.provenance["audit"]["seconds"].items():
                per_check[name].append(seconds)
    finally:
        engine.close()
    print(f"{args.backend} on {case.name} ({case.model}, {dtype}), {args.repeats} audit(s) on one engine\n")
    print("| stage | seconds (median) |\n|---|---:|")
    print(f"| engine start | {start:.1f} |")
    for name, values in per_check.items():
        if values:
            print(f"| {name} | {statistics.median(values):.1f} |")
    print(f"| audit (all checks) | {statistics.median(totals):.1f} |")
    print(f"| **start + audit** | **{start + statistics.median(totals):.1f}** |\n")
    print(result.summary_text())


if __name__ == "__main__":  # vLLM's engine core re-imports this module in its own process
    main()
