"""The frame every `parity` command runs in: one place for --verbose, errors, Ctrl-C and pipes.

    def main(argv: list[str] | None = None) -> int:
        return run_command("parity audit", argv, _parser(), _run)

`run_command` adds `--verbose` to the command's parser, parses `argv`, sets the engines' logging
(`parity.runtime.quiet`) and calls the body with the parsed arguments; it returns the exit code:
the body's, `EXIT_ERROR` (2) for any error (a `ParityError` as its message, anything else as one
line and a pointer to --verbose, which prints the traceback), `EXIT_INTERRUPTED` (130) on Ctrl-C,
`EXIT_BROKEN_PIPE` (141, quietly) when the reader of stdout went away (`parity monitor D | head`).
Parsing comes first and loads nothing: a command's heavy modules are imported by its body, so
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
