"""The one error hierarchy of parity, and how a command reports an error.

A `ParityError` names the offending field and the fix, so users never see a traceback from deep
inside torch. Commands exit `EXIT_FAILED` (1) only when a tolerance or regression check failed and
`EXIT_ERROR` (2) on any error, printed as one line, so CI never reads a crash as a parity failure.
"""

from __future__ import annotations

import sys
import traceback


class ParityError(Exception):
    """Base class of every error parity raises on purpose."""


class ConfigError(ParityError, ValueError):
    """A configuration value (sampling parameter, tolerance, case field, option) is invalid."""


class InputError(ParityError, ValueError):
    """Input data (token ids, logprob arrays, masks, routes, dumps) is malformed."""


class AdapterError(ConfigError):
    """A LoRA adapter that parity cannot apply to the model: a missing file, another base model's
    modules or shapes, an unsupported target module or peft option; the message names which."""


class ModelNotFoundError(ParityError, LookupError):
    """A model argument is neither a built-in checkpoint name nor a local HF checkpoint path."""


class BackendUnavailableError(ParityError, ImportError):
    """A backend's package is not installed here; the message names the extra to install."""


class BackendError(ParityError, RuntimeError):
    """A backend failed while starting, generating or scoring."""


class UnsupportedError(BackendError):
    """The backend, or the build of it installed here, refuses an operation (e.g. sleep mode on a
    CPU build); the message quotes the backend's reason. Checks report it as skipped, not failed."""


class OutputError(ParityError, OSError):
    """An output (a record, a report file) could not be written. `report` holds the finished
    report when the work itself succeeded, so a caller can still write its other outputs."""

    def __init__(self, message: str, report: object | None = None) -> None:
        super().__init__(message)
        self.report = report


class DivergedError(ParityError, ArithmeticError):
    """Training diverged: a loss, a gradient or a logprob of the trained policy became NaN or
    infinite; the message names the step."""


#: exit code of a command whose tolerance or regression check failed (and of nothing else).
EXIT_FAILED = 1
#: exit code of a command that could not do its job: bad input, or a failure of parity or a backend.
EXIT_ERROR = 2
#: exit code after Ctrl-C (SIGINT), the shell's 128 + 2.
EXIT_INTERRUPTED = 130
#: exit code when the reader of stdout went away (`| head`), the shell's 128 + SIGPIPE (13).
EXIT_BROKEN_PIPE = 141
#: exit code after SIGTERM (a scheduler's or `timeout`'s stop), the shell's 128 + 15.
EXIT_TERMINATED = 143


class Terminated(KeyboardInterrupt):
    """SIGTERM inside a `parity` command (`parity.runtime.frame.sigterm_interrupts`): raised like
    Ctrl-C, so a run's `finally` blocks write what it finished and close its engines."""


def report_error(prog: str, exc: BaseException, *, verbose: bool = False) -> int:
    """Print `exc` on stderr as one line and return `EXIT_ERROR`; a non-`ParityError` is printed as its
    type and first line with a pointer to --verbose (the traceback).
    """
    if verbose:
        traceback.print_exception(exc, file=sys.stderr)
    if isinstance(exc, ParityError):
        line = str(exc)
    else:
        first = (str(exc).strip().splitlines() or [""])[0]
        line = f"{type(exc).__name__}: {first}"
        if not verbose:
            line += " (run with --verbose for the traceback)"
    print(f"{prog}: error: {' '.join(line.splitlines())}", file=sys.stderr)
    return EXIT_ERROR
