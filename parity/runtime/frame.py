"""The frame every `parity` command runs in: one place for --verbose, errors, Ctrl-C and pipes.

`run_command("parity audit", argv, parser, body)` adds `--verbose`, sets engine logging and
returns the body's exit code, `EXIT_ERROR` (2) on any error (one line), `EXIT_INTERRUPTED` (130)
on Ctrl-C, `EXIT_TERMINATED` (143) on SIGTERM (raised as `Terminated`, a KeyboardInterrupt, so runs
end as they do on Ctrl-C: finished work written, engines closed), `EXIT_BROKEN_PIPE` (141) when
stdout's reader left. Parsing loads nothing heavy, so `parity X --help` never loads torch.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence

from parity.core.errors import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    ConfigError,
    Terminated,
    report_error,
)
from parity.runtime.quiet import engine_logging

#: the flag that shows the engines' log lines and the traceback of an error; every command takes it.
VERBOSE = "--verbose"
VERBOSE_HELP = "show the engines' log lines (vLLM's INFO) and the traceback of an error; default: errors only"

Body = Callable[[argparse.Namespace], int]
#: what a `--model` flag takes, for `refuse_empty`'s message.
MODEL_VALUES = "a built-in checkpoint name or a local HF checkpoint directory ('.' for the working directory)"
#: where `_StoreOnce` keeps the values given so far, on the namespace while parsing only
_GIVEN = "_parity_given"


class _StoreOnce(argparse.Action):
    """argparse's `store`, except that a flag given twice with two values is an error: argparse
    keeps the last one unsaid, so `--dtype float32 ... --dtype bfloat16` ran in bf16."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        given = namespace.__dict__.setdefault(_GIVEN, {})
        if self.dest in given and given[self.dest] != values:
            raise argparse.ArgumentError(
                self, f"given twice ({given[self.dest]!r}, then {values!r}); give it once")
        given[self.dest] = values
        setattr(namespace, self.dest, values)


class Parser(argparse.ArgumentParser):
    """The argument parser of every `parity` command: a single-value flag given twice with two
    different values is a usage error (exit 2) instead of the last one winning."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.register("action", "store", _StoreOnce)
        self.register("action", None, _StoreOnce)

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        parsed, rest = super().parse_known_args(args, namespace)
        parsed.__dict__.pop(_GIVEN, None)
        return parsed, rest


def run_command(prog: str, argv: Sequence[str] | None, parser: argparse.ArgumentParser, body: Body) -> int:
    """Parse `argv` (default: sys.argv[1:]) with `parser` plus --verbose and run `body` on the result,
    inside the frame; returns the exit code (see the module docstring). `prog` starts error lines."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    verbose = VERBOSE in args_list
    parser.add_argument(VERBOSE, action="store_true", help=VERBOSE_HELP)
    engine_logging(verbose=verbose)
    try:
        args = parser.parse_args(args_list)
        with sigterm_interrupts():
            return int(body(args) or 0)
    except Terminated:
        print(f"{prog}: terminated (SIGTERM)", file=sys.stderr)
        return EXIT_TERMINATED
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


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Inside: SIGTERM raises `Terminated` in the main thread (Python's default would end the process
    without running a single `finally`). Elsewhere than the main thread, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise Terminated("SIGTERM")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def refuse_empty(flag: str, value: str | None, give: str, fallback: str) -> None:
    """ConfigError for `flag` given an empty value: `args.X or default` would quietly run the default
    (`fallback`, what dropping the flag does) instead of what was meant."""
    if value is not None and not value:
        raise ConfigError(f"{flag} is empty; give {give}, or drop {flag} to {fallback}")
