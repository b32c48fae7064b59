"""`parity lifecycle`: the lifecycle checks of one backend, from the command line.
Exit 0 when no check failed (skips included), 1 when one did, 2 on an error, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from parity.audit.lifecycle import CHECKS, WEIGHT_SCALE, check_weight_settings, run_lifecycle
from parity.backends import get_backend, parse_options
from parity.core.errors import ConfigError
from parity.core.outputs import output_file
from parity.runtime.frame import MODEL_VALUES, Parser, refuse_empty, run_command
from parity.workload.cases import resolve_case
from parity.workload.resolve import check_case_model


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="parity lifecycle",
        description="Sample the same requests before and after each lifecycle transition of a running "
                    "backend (cache reset, sleep/wake, KV-cache release, weight update) and compare token "
                    "ids and logprobs bit for bit. Exit 0 when no check failed (skips included), 1 when "
                    "one did, 2 on an error.")
    parser.add_argument("--backend", required=True, help="backend name, e.g. vllm or vllm-server")
    parser.add_argument("--model", help="built-in checkpoint or local HF checkpoint; optional with --case")
    parser.add_argument("--case", type=Path,
                        help="take the requests (and the model) from this case file or name in cases/")
    parser.add_argument("--dtype", help="model dtype (default: the case's first dtype, else bfloat16)")
    parser.add_argument("--checks", default=",".join(CHECKS),
                        help=f"comma-separated checks to run (default: all: {','.join(CHECKS)})")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="backend option, repeatable; e.g. --option url=http://127.0.0.1:8000")
    parser.add_argument("--weight-tolerance", type=float, default=0.15, metavar="NATS",
                        help="max |dlogp| after a weight push vs the training forward (default: 0.15)")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the results as JSON to OUT")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `parity lifecycle` on `argv` (the arguments after the command); returns the exit code."""
    return run_command("parity", argv, _parser(), _run)


def _run(args: argparse.Namespace) -> int:
    refuse_empty("--model", args.model, MODEL_VALUES, "run the case's model")
    case = resolve_case(args.case, what="--case") if args.case is not None else None
    if case is not None:
        check_case_model(args.model, case, "--model")
    model = args.model if args.model is not None else (case.model if case is not None else None)
    if model is None:
        raise ConfigError("parity lifecycle needs --model (or --case naming a model)")
    refuse_empty("--dtype", args.dtype and args.dtype.strip(), "a dtype (bfloat16, float16 or float32)",
                 "run the case's first dtype (else bfloat16)")
    dtype = args.dtype if args.dtype is not None else (
        case.dtypes[0] if case is not None and case.dtypes else "bfloat16")
    checks = tuple(c.strip() for c in args.checks.split(",") if c.strip())
    if not checks:  # no check would run, and a report of none passes
        raise ConfigError(f"--checks names no check; give some of {','.join(CHECKS)}, or drop --checks "
                          "to run them all")
    options = parse_options(args.option)
    check_weight_settings(WEIGHT_SCALE, args.weight_tolerance)  # before the backend starts
    if args.json is not None:
        output_file(args.json, "--json")  # before any work, as compare checks its outputs
    with get_backend(args.backend, model, dtype=dtype, **options) as backend:
        report = run_lifecycle(backend, case.requests if case is not None else None, checks=checks,
                               weight_tolerance=args.weight_tolerance)
    print(report.summary_text())
    if args.json is not None:
        args.json.write_text(report.to_json(), encoding="utf-8")
        print(f"wrote {args.json}")
    return 0 if report.passed else 1
