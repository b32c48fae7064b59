"""`parity monitor OUT_DIR [--html OUT] [--json OUT]`: draw and summarise a monitored run.

Reads `OUT_DIR/monitor.sqlite` (a run still going, or one whose process was killed, reads the
same: every committed step), prints one line per step with alerts and the latest step's key
figures, draws the page (default `OUT_DIR/index.html`) and with `--json` writes
`{"run_name": ..., "steps": [{"step": int, ...the stored record...}]}`. Exit 0, or 2 on an error
(one line). Light: never loads torch.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from parity.core.outputs import output_file
from parity.monitor.page import PAGE_FILE, flat_values, write_page
from parity.monitor.store import MonitorStore
from parity.runtime.frame import run_command

#: the latest step's figures the command prints.
SHOWN = ("max_abs_logprob_diff", "mean_abs_logprob_diff", "k3_kl", "is_ratio_mean", "rollout_probs_diff_max",
         "num_tokens")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="parity monitor",
        description="Draw and summarise a run a parity.Monitor wrote (also one still going): the page, the "
                    "alerts, the latest step; exit 0, or 2 on an error.")
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="the Monitor's out_dir")
    parser.add_argument("--html", type=Path, metavar="OUT",
                        help=f"write the page to OUT (default: OUT_DIR/{PAGE_FILE})")
    parser.add_argument("--json", type=Path, metavar="OUT",
                        help='write {"run_name", "steps": [{"step", ...the stored record...}]} to OUT')
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `parity monitor` on `argv`; returns the exit code."""
    return run_command("parity monitor", argv, _parser(), _run)


def _run(args: argparse.Namespace) -> int:
    for option, path in (("--html", args.html), ("--json", args.json)):
        if path is not None:
            output_file(path, option)
    store = MonitorStore.open(args.out_dir)
    try:
        run, steps = store.run_info(), store.steps()
    finally:
        store.close()
    alerts = sum(len(s.get("alerts", [])) for s in steps)
    print(f"run {run['run_name']}: {len(steps)} steps"
          + (f" ({steps[0]['step']}-{steps[-1]['step']})" if steps else "") + f", {alerts} alert(s)")
    for s in steps:
        for a in s.get("alerts", []):
            print(f"  step {s['step']}: {a['message']}")
    if steps:
        values = flat_values(steps[-1])
        print(f"latest step {steps[-1]['step']}: "
              + ", ".join(f"{k} {values[k]:.4g}" for k in SHOWN if isinstance(values.get(k), (int, float))))
        rec = steps[-1].get("recommendation")
        if rec is not None:
            print(f"recommended correction: {rec['name']} ({rec['reason']})")
    page = write_page(args.out_dir, args.html)
    print(f"wrote {page}")
    if args.json is not None:
        text = json.dumps({"run_name": run["run_name"], "steps": steps}, indent=1, allow_nan=False)
        args.json.write_text(text, encoding="utf-8")
        print(f"wrote {args.json}")
    return 0
