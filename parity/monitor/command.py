"""`parity monitor OUT_DIR [--html OUT] [--json OUT] [--step N ...] [--log-scale]`: draw and
summarise a monitored run, read-only (a live, killed or read-only run alike). Exit 0, 2 on an
error, 141 when stdout's reader left. Never loads torch.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path

from parity.core.errors import ConfigError, InputError
from parity.core.outputs import output_file
from parity.monitor.page import PAGE_FILE, flat_values, write_page
from parity.monitor.store import MonitorStore, plain, store_path, stored_form
from parity.runtime.frame import Parser, run_command

#: the latest step's figures the command prints.
SHOWN = ("max_abs_logprob_diff", "mean_abs_logprob_diff", "k3_kl", "is_ratio_mean", "rollout_probs_diff_max",
         "num_tokens")


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="parity monitor",
        description="Draw and summarise a run a parity.Monitor wrote (also one still going): the page, the "
                    "alerts, the latest step; exit 0, or 2 on an error.")
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="the Monitor's out_dir")
    parser.add_argument("--html", type=Path, metavar="OUT",
                        help=f"write the page to OUT (default: OUT_DIR/{PAGE_FILE})")
    parser.add_argument("--json", type=Path, metavar="OUT",
                        help='write {"run_name", "steps": [{"step", ...the stored record...}]} to OUT (a '
                             'non-finite value is null, named in its object\'s "nonfinite" entry, or '
                             '"nonfinite_items" inside a list or meta)')
    parser.add_argument("--step", type=int, action="append", metavar="N",
                        help="detail step N on the page (repeat for more; default: the latest and the worst "
                             "by k3_kl)")
    parser.add_argument("--log-scale", action="store_true", help="trend charts on a log scale")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `parity monitor` on `argv`; returns the exit code."""
    return run_command("parity monitor", argv, _parser(), _run)


def _run(args: argparse.Namespace) -> int:
    for option, path in (("--html", args.html), ("--json", args.json)):
        if path is not None:
            output_file(path, option)
    page = args.html if args.html is not None else args.out_dir / PAGE_FILE
    store = store_path(args.out_dir)
    for option, path, others in (("--html", args.html, [("the run's store", store)]),
                                 ("--json", args.json, [("the run's store", store), ("the page", page)])):
        for other, taken in others:
            if path is not None and _same_file(path, taken):
                raise ConfigError(f"{option} {path} is {other} {taken}: writing it would replace that file; "
                                  f"give {option} a path of its own")
    opened = MonitorStore.open(args.out_dir)
    try:
        run, steps, problems = opened.run_info(), opened.steps(), opened.problems
    finally:
        opened.close()
    known = {s["step"] for s in steps}
    for n in args.step or ():
        if n not in known:
            raise InputError(f"--step {n}: the run has no such step (it has {len(known)}: "
                             f"{_span(sorted(known))})")
    readable = [s for s in steps if "undecodable" not in s]
    alerts = sum(len(s.get("alerts", [])) for s in readable)
    print(f"run {plain(run['run_name'])}: {len(steps)} steps"
          + (f" ({steps[0]['step']}-{steps[-1]['step']})" if steps else "") + f", {alerts} alert(s)")
    for line in problems:
        print(f"  unreadable: {plain(line)}")
    for s in readable:
        if s.get("restart"):
            print(f"  step {s['step']}: the run was resumed (attempt {s['restart']['attempt']}, superseding "
                  f"{s['restart'].get('superseded', 0)} stored step(s))")
        for a in s.get("alerts", []):
            print(f"  step {s['step']}: {plain(a['message'])}")
    if readable:
        values = flat_values(readable[-1])
        print(f"latest step {readable[-1]['step']}: " + ", ".join(f"{k} {_value(values[k])}" for k in SHOWN
                                                                   if k in values))
        rec = readable[-1].get("recommendation")
        if rec is not None:
            print(f"recommended correction: {plain(rec['name'])} ({plain(rec['reason'])})")
    # the snapshot printed above: a live run's store moves on, and a second read could draw
    # other steps than those printed and written to --json
    page = write_page(args.out_dir, args.html, log_scale=args.log_scale, detail=args.step,
                      read=(run, steps, problems))
    print(f"wrote {page}")
    if args.json is not None:
        text = json.dumps({"run_name": run["run_name"], "steps": stored_form(steps)}, indent=1,
                          allow_nan=False)
        args.json.write_text(text, encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


def _same_file(a: Path, b: Path) -> bool:
    """Whether `a` and `b` name one file (through links and relative paths alike)."""
    return (os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)) or a.resolve() == b.resolve()


def _value(value: object) -> str:
    """A stored value as printed: a number (inf and nan as such), null as not measured."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.4g}"
    return "null (not measured)" if value is None else plain(value)


def _span(steps: list[int]) -> str:
    return "none" if not steps else f"{steps[0]}..{steps[-1]}"
