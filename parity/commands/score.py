"""`parity score`: score rollouts produced elsewhere (dumps, records) with the training forward.
Exit 0 when the tolerance holds, 1 when it does not, 2 on an error.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from parity.commands.report_output import check_outputs, report_arguments, report_out
from parity.core.errors import ConfigError
from parity.core.schema import DTYPES, LOGPROBS_MODES
from parity.core.types import SamplingParams
from parity.runtime.frame import Parser, run_command
from parity.scoring import FROM_DUMP, score
from parity.workload.cases import resolve_case


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="parity score",
        description="Score the rollouts of a dump (JSONL or Parquet: verl batches, any engine) or a parity "
                    "record with the training forward, print the summary compare prints; exit 0 when the "
                    "tolerance holds, 1 when it does not, 2 on bad input.")
    parser.add_argument("source", type=Path,
                        help="a rollout dump (JSONL or Parquet; verl's batch column names accepted) or a "
                             "parity record (written by compare --record or replay)")
    parser.add_argument("--model", help="model name or local HF checkpoint directory to score with (default: "
                                        "the record's; not needed with --trainer-logprobs)")
    parser.add_argument("--backend", help="a record's backend whose rollouts to score (needed when it "
                                          "holds several); for a dump, the name its rollouts get (default: "
                                          "external)")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="dtype of the training forward (default: the rollouts' own, else bfloat16)")
    parser.add_argument("--rollout-dtype", choices=DTYPES,
                        help="dtype the rollouts were computed in, for rollouts that do not record it (a "
                             "dump's rollout_dtype column); the tolerance is the less precise dtype's of the "
                             "pair")
    parser.add_argument("--trainer-logprobs", action="store_true",
                        help="use the dump's trainer logprobs (trainer_logprobs, verl's old_log_probs) "
                             "instead of running the training forward here")
    parser.add_argument("--logprobs-mode", choices=LOGPROBS_MODES,
                        help="mode of a dump's rows without a logprobs_mode column (default: the --case's, "
                             "else processed; a record's rollouts carry their own)")
    given = parser.add_argument_group("sampling of rollouts that do not record it (processed logprobs "
                                      "depend on it; a dump row's own columns win, a contradiction is an "
                                      "error)")
    given.add_argument("--temperature", type=float,
                       help="sampling temperature (0 = greedy; 1 where --top-p or --top-k alone is given)")
    given.add_argument("--top-p", type=float, help="nucleus mass in (0, 1] (default: 1, off)")
    given.add_argument("--top-k", type=int, help="top-k (default: 0, off)")
    given.add_argument("--case", type=Path, help="case file or name in cases/: each rollout takes the "
                                                 "sampling of the case's request with its request id, "
                                                 "whose prompt must be the rollout's; a dump's rows "
                                                 "without a logprobs_mode take the case's")
    report_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `parity score` on `argv` (the arguments after the command); returns the exit code."""
    return run_command("parity", argv, _parser(), _run)


def _run(args: argparse.Namespace) -> int:
    check_outputs(args, inputs=[("SOURCE", args.source), ("--case", args.case)])
    flags = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p),
                               ("top_k", args.top_k)) if v is not None}
    if flags and args.case is not None:
        raise ConfigError("give the sampling with --temperature/--top-p/--top-k or with --case, not both")
    sampling = SamplingParams(**flags) if flags else None
    case = None if args.case is None else resolve_case(args.case, what="--case")
    report = score(args.source, args.model, trainer_logprobs=FROM_DUMP if args.trainer_logprobs else None,
                   backend=args.backend, sampling=sampling, case=case,
                   logprobs_mode=args.logprobs_mode,
                   dtype=args.dtype, reference=args.reference, router_replay=args.router_replay,
                   device=args.device, attribute=tuple(args.attribute or ()), gold=args.gold,
                   lora=args.lora, rollout_dtype=args.rollout_dtype)
    return report_out(report, args)
