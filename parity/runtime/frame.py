"""The frame every `parity` command runs in: one place for --verbose, errors, Ctrl-C and pipes.

`run_command("parity audit", argv, parser, body)` adds `--verbose`, sets engine logging and
returns the body's exit code, `EXIT_ERROR` (2) on any error (one line), `EXIT_INTERRUPTED` (130)
on Ctrl-C, `EXIT_BROKEN_PIPE` (141) when stdout's reader left. Parsing loads nothing heavy, so
`parity X --help` never loads torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from parity.core.errors import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, report_error
from parity.runtime.quiet import engine_logging

#: the flag that shows the engines' log lines and the traceback of an error; every command takes it.
VERBOSE = "--verbose"
VERBOSE_HELP = "show the engines' log lines (vLLM's INFO) and the traceback of an error; default: errors only"

Body = Callable[[argparse.Namespace], int]


def run_command(prog: str, argv: Sequence[str] | None, parser: argparse.ArgumentParser, body: Body) -> int:
    """Parse `argv` (default: sys.argv[1:]) with `parser` plus --verbose and run `body` on the result,
    inside the frame; returns the exit code (see the module docstring). `prog` starts error lines."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    verbose = VERBOSE in args_list
    parser.add_argument(VERBOSE, action="store_true", help=VERBOSE_HELP)
    engine_logging(verbose=verbose)
    try:
        args = parser.parse_args(args_list)
        return int(body(args) or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader closed the pipe (`parity advise R.json | head`): stop quietly, as Unix tools do;
        # stdout goes to /dev/null so the interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Exception as exc:  # one line, exit 2: CI must never read a crash as a parity failure
        return report_error(prog, exc, verbose=verbose)
