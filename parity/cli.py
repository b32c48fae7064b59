"""The `parity` command.

    parity compare --model tiny-llama --backend vllm --json r.json --html r.html --record run.jsonl
    parity score rollouts.parquet --model ./my-checkpoint --temperature 0.7 --top-p 0.9
    parity advise r.json [--json advice.json] [--html r.html]
    parity models | parity backends
    parity nightly ... | parity replay ... | parity attribute ... | parity lifecycle ... | parity loop ...
    parity audit --model M --backend B [--case C] [--json OUT] [--html OUT]
    parity monitor OUT_DIR [--html OUT] [--json OUT]

`--verbose`, anywhere on the line, shows the engines' own log lines (vLLM's INFO) and the
traceback of an error; without it engines print errors only (`parity.runtime.quiet`).

Exit codes: 0 the tolerance holds (or the command succeeded), 1 it does not, 2 any error (bad
input, a backend failure, anything unexpected: one line on stderr, the traceback with
--verbose), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from parity.advisor import advise
from parity.backends import BACKENDS, available_backends, parse_option
from parity.compare import compare
from parity.core.errors import (
    EXIT_BROKEN_PIPE,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    ConfigError,
    InputError,
    ModelNotFoundError,
    OutputError,
    report_error,
)
from parity.core.outputs import output_file, write_atomic
from parity.core.schema import DTYPES, KERNEL_MODES, LOGPROBS_MODES
from parity.core.types import SamplingParams
from parity.models import BUILTIN_MODELS, TRAINED_MODELS, builtin_dir, cache_dir, trained_dir
from parity.models.trained import packaged_file
from parity.render import report_html
from parity.report.document import ParityReport, format_worst_tokens
from parity.runtime.quiet import engine_logging
from parity.scoring import FROM_DUMP, score
from parity.workload.cases import load_case

#: the flag that shows the engines' log lines, accepted anywhere on the command line.
VERBOSE = "--verbose"
#: subcommands other modules implement as `main(argv) -> exit code`; imported only when used
#: (`parity attribute` loads torch with its module, `parity --help` should not).
PASSTHROUGH: dict[str, tuple[str, str, str]] = {
    "nightly": ("parity.nightly", "main", "run the nightly matrix and write regression reports"),
    "replay": ("parity.rollouts.record", "replay_main", "replay a recorded run through another backend"),
    "attribute": ("parity.attribute", "main", "attribute drift to ops and layers"),
    "lifecycle": ("parity.audit.lifecycle", "main", "check sleep/wake, weight updates and cache resets"),
    "monitor": ("parity.monitor.command", "main", "draw and summarise a run a parity.Monitor logged"),
    "loop": ("parity.loop.command", "main", "an on-policy RL loop: drift per step as weights move"),
    "audit": ("parity.audit.command", "main", "is this engine deterministic and batch-invariant?"),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="parity", description="Train/infer logprob parity for LLM reinforcement learning.")
    # read by main() before parsing, so it works after any command too (`parity compare ... --verbose`)
    parser.add_argument(VERBOSE, action="store_true",
                        help="show the engines' log lines (vLLM's INFO); default: errors only")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    cmp = sub.add_parser(
        "compare", help="compare one backend with the training forward",
        description="Sample a case with BACKEND, score the same tokens with the training forward, print "
                    "the summary; exit 0 when the tolerance holds, 1 when it does not, 2 on bad input.")
    cmp.add_argument("--model", help="model name (see `parity models`) or a local HF "
                                     "checkpoint directory; optional with --case")
    cmp.add_argument("--backend", required=True, help="backend name (see `parity backends`)")
    cmp.add_argument("--case", type=Path, help="case TOML file (default: the built-in workload)")
    cmp.add_argument("--dtype", choices=DTYPES,
                     help="model dtype (default: the case's first dtype, else bfloat16)")
    cmp.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                     help="backend option, repeatable; VALUE is read as JSON when it parses "
                          "(true, 4, 0.5), else as a string; e.g. --option record_routes=true")
    cmp.add_argument("--tp", type=int, metavar="K",
                     help="tensor-parallel degree of the backend (1, 2, 4, 8); the training forward then "
                          "runs parity's TP-invariant layout with the reference backend's row-parallel K "
                          "groups (--option reduction_groups=G, default 8; the degree must divide G)")
    cmp.add_argument("--top-k-logprobs", type=int, metavar="K",
                     help="also ask the backend for its K most likely tokens per position and report the "
                          "full-distribution drift against the training forward (distribution/* keys; "
                          "docs/DISTRIBUTION.md)")
    cmp.add_argument("--record", type=Path, metavar="OUT",
                     help="write the run's record (requests and rollouts) to OUT, for `parity replay` "
                          "and `parity score`")
    _report_arguments(cmp)
    cmp.set_defaults(func=_compare)

    scr = sub.add_parser(
        "score", help="score rollouts produced elsewhere (dumps, records) with the training forward",
        description="Score the rollouts of a dump (JSONL or Parquet: verl batches, any engine) or a parity "
                    "record with the training forward, print the summary compare prints; exit 0 when the "
                    "tolerance holds, 1 when it does not, 2 on bad input.")
    scr.add_argument("source", type=Path,
                     help="a rollout dump (JSONL or Parquet; verl's batch column names accepted) or a parity "
                          "record (written by compare --record or replay)")
    scr.add_argument("--model", help="model name or local HF checkpoint directory to score with (default: "
                                     "the record's; not needed with --trainer-logprobs)")
    scr.add_argument("--backend", help="a record's backend whose rollouts to score (needed when it holds "
                                       "several); for a dump, the name its rollouts get (default: external)")
    scr.add_argument("--dtype", choices=DTYPES,
                     help="dtype of the training forward (default: the rollouts' own, else bfloat16)")
    scr.add_argument("--trainer-logprobs", action="store_true",
                     help="use the dump's trainer logprobs (trainer_logprobs, verl's old_log_probs) instead "
                          "of running the training forward here")
    scr.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default="processed",
                     help="mode of a dump's rows without a logprobs_mode column (default: processed)")
    given = scr.add_argument_group("sampling of rollouts that do not record it (processed logprobs depend "
                                   "on it; a dump row's own columns win, a contradiction is an error)")
    given.add_argument("--temperature", type=float, help="sampling temperature (0 = greedy)")
    given.add_argument("--top-p", type=float, help="nucleus mass in (0, 1] (default: 1, off)")
    given.add_argument("--top-k", type=int, help="top-k (default: 0, off)")
    given.add_argument("--case", type=Path, help="case file: each rollout takes the sampling of the case's "
                                                 "request with its request id")
    _report_arguments(scr)
    scr.set_defaults(func=_score)

    adv = sub.add_parser(
        "advise", help="which rollout correction fixes a stored report's drift",
        description="Evaluate a grid of rollout corrections (verl rollout_is / rollout_rs, IcePop, geometric "
                    "IS, seq-mask-TIS) on REPORT's per-token logprobs, print every candidate's figures and "
                    "the recommendation with the config to paste; exit 0, or 2 on bad input.")
    adv.add_argument("report", type=Path, metavar="REPORT",
                     help="a report JSON written by `parity compare --json`")
    adv.add_argument("--bootstrap", type=int, default=200, metavar="B",
                     help="bootstrap resamples of sequences for the bias interval (default: 200)")
    adv.add_argument("--seed", type=int, default=0, help="bootstrap seed (default: 0)")
    adv.add_argument("--json", type=Path, metavar="OUT", help="write the advice section as JSON to OUT")
    adv.add_argument("--html", type=Path, metavar="OUT",
                     help="write the report's HTML page, with this advice section, to OUT")
    adv.set_defaults(func=_advise)

    sub.add_parser("models", help="list the built-in checkpoints and trained models",
                   description="List the built-in tiny checkpoints and the trained models converted from "
                               "installed packages.").set_defaults(func=_models)
    sub.add_parser("backends", help="list backends and whether each can run here",
                   description="List backend adapters and whether each is usable here."
                   ).set_defaults(func=_backends)
    ker = sub.add_parser(
        "kernels", help="show which matmul route each weight shape of a model takes and why",
        description="Load MODEL on DEVICE (running the load-time matmul probe on CUDA) and print, for "
                    "each distinct linear weight shape, the route the invariant linear takes and why.")
    ker.add_argument("--model", required=True, help="model name (see `parity models`) or a local HF "
                                                    "checkpoint directory")
    ker.add_argument("--device", default="cuda", help="device to load on (default: cuda)")
    ker.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="model dtype (default: bfloat16)")
    ker.add_argument("--cublaslt", action="store_true",
                     help="set this process up for cuBLASLt without split-K first, as an engine process "
                          "would be (else the routes of a process without that setup are shown)")
    ker.set_defaults(func=_kernels)
    for name, (_, _, text) in PASSTHROUGH.items():
        # listed for --help only: main() hands these to their module before argparse runs
        sub.add_parser(name, help=text, add_help=False)
    return parser


def _report_arguments(parser: argparse.ArgumentParser) -> None:
    """The training-forward and output arguments `compare` and `score` share."""
    parser.add_argument("--reference", choices=KERNEL_MODES, default="invariant",
                        help="training-forward kernels (default: invariant)")
    parser.add_argument("--router-replay", metavar="MODE", help="MoE router replay mode, e.g. R3")
    parser.add_argument("--attribute", action="append", nargs="?", const="batch", metavar="AXIS",
                        help="attribute the drift to op families and layers along AXIS (batch, layout, mode, "
                             "dtype; repeatable; default batch)")
    parser.add_argument("--device", default="cpu", help="device of the training forward (default: cpu)")
    parser.add_argument("--gold", action=argparse.BooleanOptionalAction,
                        help="score the tokens with the float64 gold forward too and say which side is "
                             "farther from it (--no-gold: never; default: when it costs under a second or "
                             "at most 20%% of the run's time)")
    parser.add_argument("--lora", metavar="PATH",
                        help="a LoRA adapter on top of the model (a peft adapter directory or a built-in "
                             "adapter such as tiny-llama-lora-r8); compare: the backend and the training "
                             "forward apply it; score: for rollouts that do not record theirs")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the report as JSON to OUT")
    parser.add_argument("--html", type=Path, metavar="OUT", help="write the HTML report to OUT")
    parser.add_argument("--worst", type=_count, default=5, metavar="K",
                        help="worst tokens to print (default: 5)")


def _count(text: str) -> int:
    """An argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def _compare(args: argparse.Namespace) -> int:
    if args.model is None and args.case is None:
        raise ConfigError("compare needs --model (or --case naming a model)")
    _check_outputs(args)
    failed = []
    try:
        report = compare(args.model, args.backend, case=args.case, dtype=args.dtype, reference=args.reference,
                         router_replay=args.router_replay, device=args.device,
                         attribute=tuple(args.attribute or ()), record=args.record, tensor_parallel=args.tp,
                         gold=args.gold, lora=args.lora, top_k_logprobs=args.top_k_logprobs,
                         **dict(map(parse_option, args.option)))
    except OutputError as e:
        if e.report is None:
            raise
        report, failed = e.report, [str(e)]
    if args.record is not None and not failed:
        print(f"wrote {args.record}")
    return _report_out(report, args, failed)


def _check_outputs(args: argparse.Namespace) -> None:
    """--json/--html checked before any work: a run never loses its report to a bad path."""
    for option, path in (("--json", args.json), ("--html", args.html)):
        if path is not None:
            output_file(path, option)


def _score(args: argparse.Namespace) -> int:
    _check_outputs(args)
    flags = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p),
                               ("top_k", args.top_k)) if v is not None}
    if flags and args.case is not None:
        raise ConfigError("give the sampling with --temperature/--top-p/--top-k or with --case, not both")
    sampling: SamplingParams | dict[str, SamplingParams] | None = SamplingParams(**flags) if flags else None
    if args.case is not None:
        sampling = {r.request_id: r.sampling for r in load_case(args.case).requests}
    report = score(args.source, args.model, trainer_logprobs=FROM_DUMP if args.trainer_logprobs else None,
                   backend=args.backend, sampling=sampling, logprobs_mode=args.logprobs_mode,
                   dtype=args.dtype, reference=args.reference, router_replay=args.router_replay,
                   device=args.device, attribute=tuple(args.attribute or ()), gold=args.gold,
                   lora=args.lora)
    return _report_out(report, args)


def _report_out(report: ParityReport, args: argparse.Namespace, failed: list[str] | None = None) -> int:
    """Print the summary and the worst tokens, write --json/--html, each atomically and each on its
    own (one that cannot be written does not cost the others); the exit code of the verdict, or
    2 when an output was lost (`failed`: outputs already lost, e.g. the record)."""
    print(report.summary_text())
    print(f"worst {args.worst} tokens:")
    print(format_worst_tokens(report.worst_tokens(args.worst), report.num_tokens))
    failed = list(failed or [])
    for option, path, render in (("--json", args.json, report.to_json), ("--html", args.html,
                                                                         lambda: report_html(report))):
        if path is None:
            continue
        try:
            write_atomic(path, render())
            print(f"wrote {path}")
        except OSError as e:
            failed.append(f"{option} {path}: could not be written ({e.strerror or e})")
    for line in failed:
        print(f"parity: error: {line}", file=sys.stderr)
    if failed:
        return EXIT_ERROR
    return 0 if report.passed else 1


def _advise(args: argparse.Namespace) -> int:
    try:
        text = args.report.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"advise: cannot read REPORT {args.report}: {exc.strerror}") from exc
    report = ParityReport.from_json(text)
    advice = advise(report, bootstrap=args.bootstrap, seed=args.seed)
    print(advice.text())
    if args.json is not None:
        args.json.write_text(json.dumps(advice.to_dict(), indent=2), encoding="utf-8")
        print(f"wrote {args.json}")
    if args.html is not None:
        report.extras["advice"] = advice.to_dict()
        args.html.write_text(report_html(report), encoding="utf-8")
        print(f"wrote {args.html}")
    return 0


def _models(args: argparse.Namespace) -> int:
    """One line per model: name, architecture, description, status; then where its checkpoint lives
    (`$PARITY_CACHE/models/...`), made on first use if it is not there yet."""
    width = max(len(n) for n in (*BUILTIN_MODELS, *TRAINED_MODELS))
    print(f"checkpoints live in {cache_dir()} (set PARITY_CACHE to move them)")
    for name in sorted(BUILTIN_MODELS):
        spec = BUILTIN_MODELS[name]
        print(f"{name.ljust(width)}  {spec.architecture:<22}  {spec.description}")
        print(f"{'':{width}}  {_location(builtin_dir(name), 'generated on first use')}")
    for name in sorted(TRAINED_MODELS):
        trained = TRAINED_MODELS[name]
        try:
            packaged_file(name)
            status = f"from {trained.package} {trained.version}"
        except ModelNotFoundError:
            status = f"not installed: {trained.install_hint}"
        print(f"{name.ljust(width)}  {trained.architecture:<22}  {trained.description}  [{status}]")
        print(f"{'':{width}}  {_location(trained_dir(name, cache_dir()), 'converted on first use')}")
    return 0


def _location(path: Path, later: str) -> str:
    return f"at {path}" if (path / "config.json").is_file() else f"at {path} ({later})"


def _backends(args: argparse.Namespace) -> int:
    width = max(len(n) for n in BACKENDS)
    for name, reason in available_backends().items():
        status = "available" if reason is None else f"unavailable: {reason}"
        print(f"{name.ljust(width)}  {BACKENDS[name].description}  [{status}]")
    return 0


def _kernels(args: argparse.Namespace) -> int:
    from parity.engine.matmul_routes import linear_routes

    rows = linear_routes(args.model, dtype=args.dtype, device=args.device, cublaslt=args.cublaslt)
    print(f"{'layers':>6}  {'weight [N, K]':<16}  {'dtype':<9}  {'route':<9}  why")
    for row in rows:
        print(f"{row.count:>6}  {f'{row.n} x {row.k}':<16}  {row.dtype:<9}  {row.route:<9}  {row.reason}")
    return 0


def _passthrough(command: str, argv: list[str]) -> int:
    module_name, func_name, _ = PASSTHROUGH[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module_name.startswith(exc.name):
            raise  # a dependency of the module is missing: a real error, keep its traceback
        module = None
    func: Callable[[list[str]], int] | None = getattr(module, func_name, None)
    if func is None:
        print(f"parity: error: `parity {command}` is not available in this build "
              f"({module_name}.{func_name} is missing)", file=sys.stderr)
        return EXIT_ERROR
    return int(func(argv) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `parity` command on `argv` (default: sys.argv[1:]); returns the exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    verbose = VERBOSE in args_list
    engine_logging(verbose=verbose)
    args_list = [a for a in args_list if a != VERBOSE]
    try:
        if args_list and args_list[0] in PASSTHROUGH:  # their parsers take --verbose themselves
            return _passthrough(args_list[0], args_list[1:] + [VERBOSE] * verbose)
        args = _parser().parse_args(args_list)
        return args.func(args)
    except KeyboardInterrupt:
        print("parity: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader closed the pipe (`parity advise R.json | head`): stop quietly, as Unix tools do;
        # stdout goes to /dev/null so the interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Exception as exc:  # one line, exit 2: CI must never read a crash as a parity failure
        return report_error("parity", exc, verbose=verbose)
