"""The `parity` command: it only dispatches. Each subcommand is a `main(argv) -> int` of its own
module, listed in `COMMANDS` and imported only when it runs, and each runs in the shared frame
(`parity.runtime.frame`).

    parity compare --model tiny-llama --backend vllm --json r.json --html r.html --record run.jsonl
    parity score rollouts.parquet --model ./my-checkpoint --temperature 0.7 --top-p 0.9
    parity advise r.json [--json advice.json] [--html r.html]
    parity models | parity backends | parity kernels --model M
    parity nightly ... | parity replay ... | parity attribute ... | parity lifecycle ... | parity loop ...
    parity audit --model M --backend B [--case C] [--json OUT] [--html OUT]
    parity monitor OUT_DIR [--html OUT] [--json OUT]

`--verbose`, anywhere on the line, shows the engines' own log lines (vLLM's INFO) and the
traceback of an error; without it engines print errors only (`parity.runtime.quiet`).

Exit codes: 0 the tolerance holds (or the command succeeded), 1 it does not, 2 any error (bad
input, a backend failure, anything unexpected: one line on stderr, the traceback with
--verbose), 130 on Ctrl-C, 141 when the reader of the output went away.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from parity.core.errors import EXIT_ERROR, report_error
from parity.core.schema import VERSION
from parity.runtime.frame import VERBOSE, VERBOSE_HELP

#: command name -> ("module:function" taking the arguments after the name, one line of help).
COMMANDS: dict[str, tuple[str, str]] = {
    "compare": ("parity.commands.compare:main", "compare one backend with the training forward"),
    "score": ("parity.commands.score:main",
              "score rollouts produced elsewhere (dumps, records) with the training forward"),
    "advise": ("parity.commands.advise:main", "which rollout correction fixes a stored report's drift"),
    "models": ("parity.commands.info:models", "list the built-in checkpoints and trained models"),
    "backends": ("parity.commands.info:backends", "list backends and whether each can run here"),
    "kernels": ("parity.commands.info:kernels",
                "show which matmul route each weight shape of a model takes and why"),
    "nightly": ("parity.nightly.command:main", "run the nightly matrix and write regression reports"),
    "replay": ("parity.rollouts.command:main", "replay a recorded run through another backend"),
    "attribute": ("parity.attribute.command:main", "attribute drift to ops and layers"),
    "lifecycle": ("parity.audit.lifecycle_command:main", "check sleep/wake, weight updates and cache resets"),
    "monitor": ("parity.monitor.command:main", "draw and summarise a run a parity.Monitor logged"),
    "loop": ("parity.loop.command:main", "an on-policy RL loop: drift per step as weights move"),
    "audit": ("parity.audit.command:main", "is this engine deterministic and batch-invariant?"),
}


def _parser() -> argparse.ArgumentParser:
    """The top-level parser: it reads the command's name only."""
    width = max(map(len, COMMANDS))
    parser = argparse.ArgumentParser(
        prog="parity", description="Train/infer logprob parity for LLM reinforcement learning.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands (`parity COMMAND --help` for each one's options):\n" + "\n".join(
            f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()))
    parser.add_argument(VERBOSE, action="store_true", help=VERBOSE_HELP)
    parser.add_argument("--version", action="version", version=f"parity {VERSION}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                help="the command to run (listed below)")
    for name in COMMANDS:
        sub.add_parser(name, add_help=False)  # each command parses its own arguments
    return parser


def _load(name: str) -> Callable[[list[str]], int] | None:
    """The `main(argv)` of command `name`, imported now; None when this build lacks its module."""
    module_name, func_name = COMMANDS[name][0].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module_name.startswith(exc.name):
            raise  # a dependency of the module is missing: a real error, keep its traceback
        return None
    return getattr(module, func_name, None)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `parity` command on `argv` (default: sys.argv[1:]); returns the exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    words = [a for a in args_list if a != VERBOSE]
    # `parity`, `parity --help` and `parity nope` end here, in argparse's help or usage error
    name = _parser().parse_args(words[:1]).command
    try:
        func = _load(name)
    except Exception as exc:  # the command's module is there but cannot load (a missing dependency): one line
        return report_error("parity", exc, verbose=len(words) < len(args_list))
    if func is None:
        print(f"parity: error: `parity {name}` is not available in this build "
              f"({COMMANDS[name][0]} is missing)", file=sys.stderr)
        return EXIT_ERROR
    # the command's own frame takes --verbose wherever it stood on the line
    return int(func(words[1:] + [VERBOSE] * (len(words) < len(args_list))) or 0)


if __name__ == "__main__":
    sys.exit(main())
