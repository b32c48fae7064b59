"""`parity compare`: sample a case with one backend and score the same tokens with the training forward.
Exit 0 when the tolerance holds, 1 when it does not, 2 on an error.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from parity.backends import parse_options
from parity.commands.report_output import check_outputs, report_arguments, report_out
from parity.compare import compare
from parity.core.errors import ConfigError, OutputError
from parity.core.schema import DTYPES
from parity.runtime.frame import Parser, run_command


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="parity compare",
        description="Sample a case with BACKEND, score the same tokens with the training forward, print "
                    "the summary; exit 0 when the tolerance holds, 1 when it does not, 2 on bad input.")
    parser.add_argument("--model", help="model name (see `parity models`) or a local HF "
                                        "checkpoint directory; optional with --case")
    parser.add_argument("--backend", required=True, help="backend name (see `parity backends`)")
    parser.add_argument("--case", type=Path,
                        help="case TOML file or name in cases/ (default: the built-in workload)")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="model dtype (default: the case's first dtype, else bfloat16)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="backend option, repeatable; VALUE is read as JSON when it parses "
                             "(true, 4, 0.5), else as a string; e.g. --option record_routes=true")
    parser.add_argument("--tp", type=int, metavar="K",
                        help="tensor-parallel degree of the backend (1, 2, 4, 8); the training forward then "
                             "runs parity's TP-invariant layout with the reference backend's row-parallel K "
                             "groups (--option reduction_groups=G, default 8; the degree must divide G)")
    parser.add_argument("--trainer-dtype", choices=DTYPES,
                        help="dtype of the training forward when it differs from the engine's --dtype (e.g. "
                             "float32 beside a bf16 engine); the tolerance is the less precise dtype's")
    parser.add_argument("--top-k-logprobs", type=int, metavar="K",
                        help="also ask the backend for its K most likely tokens per position and report the "
                             "full-distribution drift against the training forward (distribution/* keys; "
                             "docs/DISTRIBUTION.md)")
    parser.add_argument("--record", type=Path, metavar="OUT",
                        help="write the run's record (requests and rollouts) to OUT, for `parity replay` "
                             "and `parity score`")
    report_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `parity compare` on `argv` (the arguments after the command); returns the exit code."""
    return run_command("parity", argv, _parser(), _run)


#: compare's own arguments, refused as --option keys: one a flag sets would collide with it (Python's
#: "got multiple values" before); one a case file sets was taken silently (`tolerance=` moved the limits).
_OWN_FLAGS = {key: f"{key} is not a backend option here; use {flag} instead" for key, flag in {
    "device": "--device", "lora": "--lora", "dtype": "--dtype", "tensor_parallel": "--tp",
    "reference": "--reference", "router_replay": "--router-replay", "gold": "--gold", "record": "--record",
    "attribute": "--attribute", "top_k_logprobs": "--top-k-logprobs", "trainer_dtype": "--trainer-dtype",
    "case": "--case", "model": "--model", "backend": "--backend"}.items()} | {
    # compare's own arguments that only a case file sets on the command line
    key: f"{key} is not a backend option; set it in a case file ({where}) and pass --case" for key, where in {
        "tolerance": "a [tolerance] table", "sampling": "[sampling]", "prompts": "[prompts]",
        "turns": "[[turns]]"}.items()} | {
    "correction": "correction is not a backend option; pass correction= to parity.compare() in Python, or "
                  "compare corrections with `parity advise`"}


def _run(args: argparse.Namespace) -> int:
    if args.model is None and args.case is None:
        raise ConfigError("compare needs --model (or --case naming a model)")
    check_outputs(args, inputs=[("--case", args.case)], outputs=[("--record", args.record)])
    options = parse_options(args.option, _OWN_FLAGS)
    if args.tp is not None and options.get("tensor_parallel_size", args.tp) != args.tp:
        raise ConfigError(f"--tp {args.tp} and --option tensor_parallel_size="
                          f"{options['tensor_parallel_size']!r} disagree; give the degree once, with --tp")
    failed = []
    try:
        report = compare(args.model, args.backend, case=args.case, dtype=args.dtype, reference=args.reference,
                         router_replay=args.router_replay, device=args.device,
                         attribute=tuple(args.attribute or ()), record=args.record, tensor_parallel=args.tp,
                         gold=args.gold, lora=args.lora, top_k_logprobs=args.top_k_logprobs,
                         trainer_dtype=args.trainer_dtype,
                         **options)
    except OutputError as e:
        if e.report is None:
            raise
        report, failed = e.report, [str(e)]
    if args.record is not None and not failed:
        print(f"wrote {args.record}")
    return report_out(report, args, failed)
