"""`parity nightly`: the command line of the nightly regression run. Exit 0 when every row passed,
1 on a regression or tolerance failure, 2 on an error row or any error, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from parity.core.errors import EXIT_INTERRUPTED, ConfigError
from parity.core.schema import KERNEL_MODES
from parity.nightly.history import History
from parity.nightly.regression import TEST_NAME, RegressionPolicy
from parity.nightly.rows import RowResult, check_run_id
from parity.nightly.runner import AUTO, DEVICES, EXECUTORS, NightlyConfig, RunInterrupted, run_nightly
from parity.runtime.frame import Parser, run_command

#: options that define the matrix; a resumed run takes them from the history instead.
_MATRIX_OPTIONS = ("cases", "backends", "dtypes", "baseline", "alpha", "min_effect", "reference", "device",
                   "gold", "lora")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="parity nightly",
        description="Run cases x backends x dtypes, keep the history, flag drift regressions "
                    "and write a report.",
        epilog=f"A row regresses when the {TEST_NAME} against its baseline row is significant at "
               "--alpha and its mean |Δlogp| grows by more than --min-effect nats. Exit codes: 0 every "
               "row passed, 1 a regression or tolerance failure, 2 an error row or bad options.",
    )
    p.add_argument("--cases", help="case directory, file, or comma-separated files/names (e.g. "
                                    "cases/smoke.toml,cases/moe.toml); required unless --resume")
    p.add_argument("--backends", help=f"comma-separated backend names, or '{AUTO}' (default) for every "
                                      "backend installed here")
    p.add_argument("--dtypes", help="comma-separated dtypes to run every case in (default: each case's own)")
    p.add_argument("--out", type=Path, default=Path("reports"), help="report directory (default: reports/)")
    p.add_argument("--history", type=Path, help="SQLite history file (default: <out>/history.sqlite)")
    p.add_argument("--run-id", help="id of this run (default: UTC time); an existing id is continued")
    p.add_argument("--resume", metavar="RUN_ID", help="finish an interrupted run with its stored options")
    p.add_argument("--baseline", metavar="RUN_ID",
                   help="compare with this run (default: the last passing run of each row)")
    p.add_argument("--alpha", type=float, help="significance level of the regression test (default 0.01)")
    p.add_argument("--min-effect", type=float,
                   help="smallest change of mean per-token |Δlogp| that counts, nats (default 1e-3)")
    p.add_argument("--reference", choices=KERNEL_MODES,
                   help="training-forward kernels (default invariant)")
    p.add_argument("--device", choices=DEVICES,
                   help="where the reference and hf engines and the training forward run (default auto: "
                        "cuda when a backend runs there, vLLM or SGLang on a CUDA host, else cpu); "
                        "a cuda row asks its executor for one GPU")
    p.add_argument("--gold", action=argparse.BooleanOptionalAction,
                   help="score every row's tokens with the gold forward too (--no-gold: none; default: the "
                        "rows where it costs under a second or at most 20%% of the row's time)")
    p.add_argument("--lora", metavar="PATH",
                   help="a LoRA adapter every case runs with (a peft adapter directory or a built-in adapter "
                        "name); default: each case's own `lora`, if any")
    p.add_argument("--executor", choices=EXECUTORS, default="local",
                   help="local: rows one after another in this process (default); ray: rows on the "
                        "actors of a Ray cluster, this process keeps the history")
    p.add_argument("--ray-address", metavar="ADDRESS",
                   help="Ray cluster to run on, e.g. auto or HEAD_IP:6379 (default: start a local one "
                        "on 127.0.0.1 for this run)")
    p.add_argument("--ray-cpus", type=int, metavar="N",
                   help="CPUs of the local Ray cluster (default: this machine's count)")
    p.add_argument("--engine-memory", type=float, metavar="GIB",
                   help="with --executor ray: most host memory the actors' engines may hold at once, GiB "
                        "(default: what is available when the run starts)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def _split(text: str | None) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip()) if text else ()


def config_from_args(args: argparse.Namespace) -> NightlyConfig:
    """The run's configuration: from the options, or from the history for `--resume`."""
    if args.resume is not None:
        given = [o for o in _MATRIX_OPTIONS if getattr(args, o) is not None]
        if given or args.run_id is not None:
            flags = ["--" + o.replace("_", "-") for o in given + (["run_id"] if args.run_id else [])]
            raise ConfigError(f"--resume takes the matrix from the stored run; drop {flags}")
        check_run_id(args.resume, option="--resume")
        history_path = args.history or args.out / "history.sqlite"
        if not history_path.is_file():  # opening it would create it: a resume creates nothing
            raise ConfigError(f"--resume {args.resume!r}: no history at {history_path}; point --out or "
                              "--history at the run's history")
        with History(history_path) as history:
            record = history.require_run(args.resume, option="--resume").config
        return NightlyConfig.from_record(record, out=args.out, history=args.history, run_id=args.resume,
                                         executor=args.executor, ray_address=args.ray_address,
                                         ray_cpus=args.ray_cpus, engine_memory_gib=args.engine_memory)
    if args.cases is None:
        raise ConfigError("--cases is required (a directory, a file, or comma-separated files/names), "
                          "unless --resume RUN_ID")
    # a flag given but naming nothing must not become its default (every backend, each case's dtypes)
    for option, text, default in (("--backends", args.backends, f"'{AUTO}' (every backend installed here)"),
                                  ("--dtypes", args.dtypes, "each case's own dtypes")):
        if text is not None and not _split(text):
            raise ConfigError(f"{option} names nothing ({text!r}); give comma-separated names, or drop "
                              f"{option} for {default}")
    return NightlyConfig(
        cases=args.cases, backends=_split(args.backends) or (AUTO,), dtypes=_split(args.dtypes), out=args.out,
        history=args.history, run_id=args.run_id, baseline=args.baseline,
        policy=RegressionPolicy(**{k: v for k, v in (("alpha", args.alpha), ("min_effect", args.min_effect))
                                   if v is not None}),
        reference=args.reference or "invariant", device=args.device or "auto", gold=args.gold,
        executor=args.executor, ray_address=args.ray_address, ray_cpus=args.ray_cpus,
        engine_memory_gib=args.engine_memory,
        lora=args.lora,
    )


def format_rows(rows: list[RowResult]) -> str:
    """The rows as an aligned text table (what the command prints)."""
    table = [("row", "status", "max|Δlogp|", "mean|Δlogp|", "vs baseline")]
    for r in rows:
        s, v = r.summary, r.verdict
        table.append((
            r.key.label, r.status,
            f"{s['max_abs_logprob_diff']:.3g}" if "max_abs_logprob_diff" in s else "",
            f"{s['mean_abs_logprob_diff']:.3g}" if "mean_abs_logprob_diff" in s else "",
            (r.error or "").splitlines()[0][:70] if r.error else "" if v is None else
            f"{v.change} ({v.effect:+.2g} nats vs {v.baseline_run})",
        ))
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in table)


def resume_command(args: argparse.Namespace, run_id: str) -> str:
    """The command line that finishes run `run_id` of the history `args` point at."""
    argv = ["parity", "nightly", "--resume", run_id, "--out", str(args.out)]
    if args.history is not None:
        argv += ["--history", str(args.history)]
    if args.executor != "local":
        argv += ["--executor", args.executor]
    if args.ray_address is not None:
        argv += ["--ray-address", args.ray_address]
    if args.ray_cpus is not None:
        argv += ["--ray-cpus", str(args.ray_cpus)]
    if args.engine_memory is not None:
        argv += ["--engine-memory", str(args.engine_memory)]
    return shlex.join(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `parity nightly`; returns the exit code (see the parser's epilog)."""
    return run_command("parity nightly", argv, build_parser(), _run)


def _run(args: argparse.Namespace) -> int:
    # an interrupt says what was stored and how to finish; every other error is the frame's one line
    try:
        result = run_nightly(config_from_args(args), progress=not args.no_progress)
    except RunInterrupted as stop:
        n = stop.finished_rows
        print(f"parity nightly: interrupted; {n} finished row{'' if n == 1 else 's'} of run {stop.run_id} "
              f"{'is' if n == 1 else 'are'} stored"
              + (f" ({stop.held_rows} more finished but waited for their backend's audit: not stored, "
                 "the resumed run runs them again)" if stop.held_rows else "")
              + f"; finish it with: {resume_command(args, stop.run_id)}",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        print("parity nightly: interrupted before the run started; nothing was stored", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(format_rows(result.rows))
    print(f"\nrun {result.run.run_id}: exit code {result.exit_code}; "
          f"report: {result.report_dir / 'index.html'}")
    return result.exit_code
