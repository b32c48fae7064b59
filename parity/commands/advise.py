"""`parity advise REPORT`: which rollout correction fixes a stored report's drift. Exit 0, or 2 on
an error. Never loads torch.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from parity.advisor import advise
from parity.commands.report_output import check_distinct, count
from parity.core.errors import InputError
from parity.core.outputs import output_file
from parity.render import report_html
from parity.report.document import ParityReport
from parity.runtime.frame import Parser, run_command


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="parity advise",
        description="Evaluate a grid of rollout corrections (verl rollout_is / rollout_rs, IcePop, geometric "
                    "IS, seq-mask-TIS) on REPORT's per-token logprobs, print every candidate's figures and "
                    "the recommendation with the config to paste; exit 0, or 2 on bad input.")
    parser.add_argument("report", type=Path, metavar="REPORT",
                        help="a report JSON written by `parity compare --json`")
    parser.add_argument("--bootstrap", type=count, default=200, metavar="B",
                        help="bootstrap resamples of sequences for the bias interval (default: 200; 0: no "
                             "interval)")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed (default: 0)")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the advice section as JSON to OUT")
    parser.add_argument("--html", type=Path, metavar="OUT",
                        help="write the report's HTML page, with this advice section, to OUT")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `parity advise` on `argv` (the arguments after the command); returns the exit code."""
    return run_command("parity", argv, _parser(), _run)


#: the first bytes of every SQLite database file (a Monitor's store is one).
SQLITE_MAGIC = b"SQLite format 3\x00"


def _run(args: argparse.Namespace) -> int:
    for option, path in (("--json", args.json), ("--html", args.html)):
        if path is not None:
            output_file(path, option)
    check_distinct([("--json", args.json), ("--html", args.html)], [("REPORT", args.report)])
    try:
        data = args.report.read_bytes()
    except OSError as exc:
        raise InputError(f"advise: cannot read REPORT {args.report}: {exc.strerror}") from exc
    if data.startswith(SQLITE_MAGIC):
        raise InputError(f"advise: REPORT {args.report} is an SQLite file (a parity.Monitor store?), not a "
                         "report JSON; for a monitored run use `parity monitor OUT_DIR` (its page and "
                         "alerts carry the advice of its steps)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"advise: REPORT {args.report} is not UTF-8 text; give a report JSON written by "
                         "`parity compare --json` or `parity score --json`") from exc
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
