"""`parity audit`: is this engine deterministic and batch-invariant?

    parity audit --model tiny-llama --backend vllm [--option batch_invariant=true] [--case smoke]

Exit 0 when deterministic, batch-invariant and the seed control held, 1 when not, 2 on an error; a
verdict whose checks did not run ("not checked": not asked for, or skipped) fails nothing.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from parity.audit.derived import BATCH_SIZES
from parity.audit.result import CHECKS
from parity.audit.run import audit
from parity.backends import parse_options
from parity.core.errors import EXIT_FAILED, ConfigError
from parity.core.outputs import output_file
from parity.core.schema import AUDIT_VERDICT_CHECKS, DTYPES
from parity.render.audit import audit_html
from parity.runtime.frame import Parser, run_command
from parity.workload.cases import resolve_case


def _ints(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise ConfigError(f"--batch-sizes {text!r}: give comma-separated integers, e.g. 1,8,64") from exc


#: the audit's own arguments: an --option of one of these names would reach the audit, not the backend.
_AUDIT_ARGUMENTS = {
    **{name: f"{name} is not a backend option here; use --{name.replace('_', '-')}"
       for name in ("model", "backend", "case", "dtype", "device", "checks", "batch_sizes")},
    "seed": "the audit's own seed (of its derived requests) has this name, so it cannot reach the backend "
            "as its engine seed; drop it (the audit runs the engine with its default seed)",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the audit, print one line per check, write --json/--html; the exit code as above."""
    parser = Parser(
        prog="parity audit",
        description="Sample the same seeded requests in pairs of situations (twice; alone and inside "
                    "batches of other lengths; shuffled; decode vs the backend's own prefill; prefix cache "
                    "off and on; another seed as the control) and compare token ids and logprobs bit for "
                    "bit. Exit 0 when deterministic and batch-invariant, 1 when not, 2 on an error.")
    parser.add_argument("--backend", required=True, help="backend name (see `parity backends`)")
    parser.add_argument("--model", help="built-in checkpoint or local HF checkpoint; optional with --case")
    parser.add_argument("--case", help="case file or name in cases/ (default: the built-in workload)")
    parser.add_argument("--dtype", choices=DTYPES, help="model dtype (default: the case's first dtype)")
    parser.add_argument("--device", default="auto",
                        help="where the backend runs (default: auto = cuda for vLLM or SGLang on a CUDA "
                             "host, else cpu); a reference or hf engine is started there")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="backend option, repeatable; e.g. --option batch_invariant=true")
    parser.add_argument("--checks", default=",".join(CHECKS),
                        help=f"comma-separated checks (default: all: {','.join(CHECKS)})")
    parser.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)),
                        help="batch sizes of the batch check, in sequences; 1 and two more (default: 1,8,64)")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the result as JSON to OUT")
    parser.add_argument("--html", type=Path, metavar="OUT", help="write the result as an HTML page to OUT")
    return run_command("parity", argv, parser, _run)


def _run(args: argparse.Namespace) -> int:
    case = resolve_case(args.case, what="--case") if args.case is not None else None
    if args.model is None and case is None:
        raise ConfigError("parity audit needs --model (or --case naming a model)")
    for path, option in ((args.json, "--json"), (args.html, "--html")):
        if path is not None:
            output_file(path, option)  # before the engine starts, as compare checks its outputs
    if args.json is not None and args.html is not None and args.json.resolve() == args.html.resolve():
        raise ConfigError(f"--json and --html are one file ({args.json}): the page would replace the JSON; "
                          "give each a path of its own")
    if args.case is not None and Path(args.case).is_file() and any(
            p is not None and p.resolve() == Path(args.case).resolve() for p in (args.json, args.html)):
        raise ConfigError(f"--json/--html {args.case} is the --case file: writing it would replace the case; "
                          "give the output a path of its own")
    options = parse_options(args.option, _AUDIT_ARGUMENTS)
    result = audit(args.model, args.backend, case=case, dtype=args.dtype, device=args.device,
                   checks=[c.strip() for c in args.checks.split(",") if c.strip()],
                   batch_sizes=_ints(args.batch_sizes), **options)
    print(result.summary_text())
    if args.json is not None:
        args.json.write_text(result.to_json(), encoding="utf-8")
        print(f"wrote {args.json}")
    if args.html is not None:
        args.html.write_text(audit_html(result.to_dict()), encoding="utf-8")
        print(f"wrote {args.html}")
    failed = [name for name in AUDIT_VERDICT_CHECKS if not getattr(result, name) and result.measured(name)]
    return 0 if not failed and result.control_held else EXIT_FAILED
