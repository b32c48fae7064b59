"""What `parity compare` and `parity score` share: the training-forward and output arguments, the
up-front check of the output paths, and the summary, worst tokens and files a report ends in."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from parity.core.errors import EXIT_ERROR, ConfigError
from parity.core.outputs import output_file, write_atomic
from parity.core.schema import KERNEL_MODES
from parity.render import report_html
from parity.report.document import ParityReport, format_worst_tokens


def report_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the training-forward and output arguments `compare` and `score` share."""
    parser.add_argument("--reference", choices=KERNEL_MODES, default="invariant",
                        help="training-forward kernels (default: invariant)")
    parser.add_argument("--router-replay", metavar="MODE", help="MoE router replay mode, e.g. R3")
    parser.add_argument("--attribute", action="append", nargs="?", const="batch", metavar="AXIS",
                        help="attribute the drift to op families and layers along AXIS (batch, layout, mode, "
                             "dtype; repeatable; default batch)")
    parser.add_argument("--device", default="auto",
                        help="device of the training forward (default: auto = cuda when the backend runs "
                             "there, vLLM or SGLang on a CUDA host, else cpu)")
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
    parser.add_argument("--worst", type=count, default=5, metavar="K",
                        help="worst tokens to print (default: 5)")


def count(text: str) -> int:
    """An argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def check_outputs(args: argparse.Namespace, inputs: Iterable[tuple[str, Path | None]] = (),
                  outputs: Iterable[tuple[str, Path | None]] = ()) -> None:
    """--json/--html (and `outputs`) checked before any work: a run never loses its report to a bad
    path, to another output written over it, or writes over one of its `inputs`."""
    given = [("--json", args.json), ("--html", args.html), *outputs]
    for option, path in given:
        if path is not None:
            output_file(path, option)
    check_distinct(given, inputs)


def check_distinct(outputs: Iterable[tuple[str, Path | None]],
                   inputs: Iterable[tuple[str, Path | None]] = ()) -> None:
    """ConfigError naming both options when two outputs are one file (the second would replace the
    first) or an output is an input file (writing it would destroy what was read)."""
    seen: list[tuple[str, Path]] = [(o, Path(p)) for o, p in inputs if p is not None and Path(p).is_file()]
    n_inputs = len(seen)
    for option, path in outputs:
        if path is None:
            continue
        for i, (other, before) in enumerate(seen):
            if _same_file(Path(path), before):
                what = "the input" if i < n_inputs else "the output"
                raise ConfigError(f"{option} {path} is {what} {other} {before}: writing it would replace "
                                  f"{'that file' if i < n_inputs else 'the other'}; give {option} a path "
                                  "of its own")
        seen.append((option, Path(path)))


def _same_file(a: Path, b: Path) -> bool:
    """Whether `a` and `b` name one file (through links, `..` and relative paths alike)."""
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return a.resolve() == b.resolve()


def report_out(report: ParityReport, args: argparse.Namespace, failed: list[str] | None = None) -> int:
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
