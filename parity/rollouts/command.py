"""`parity replay`: send a recorded run's requests, unchanged, through another backend.

    parity replay RECORD --backend NAME [--model M] [--lora PATH] [--dtype D] [--option K=V ...] [--out PATH]

The backend samples in --dtype, else the dtype the record's rollouts were sampled in, else bfloat16.

Writes a record with the original requests and rollouts plus the new backend's rollouts (default:
RECORD with `.NAME` before the suffix; checked before any backend starts) and prints its path. The
backend applies `--lora`, else the LoRA adapter the record names (the one `compare --record`
sampled with), else none. Exit 0, or 2 on any error (one line on stderr; the traceback with
--verbose), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from parity.backends import get_backend, lora_options, parse_options
from parity.core.errors import ConfigError
from parity.core.outputs import output_file
from parity.core.schema import DTYPES
from parity.rollouts.record import Record, read_record, replay, write_record
from parity.runtime.frame import MODEL_VALUES, Parser, refuse_empty, run_command


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="parity replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("record", type=Path, help="record file (JSONL) written by parity")
    parser.add_argument("--backend", required=True, help="backend to replay through")
    parser.add_argument("--model", help="model (built-in name or HF directory); default: the record's")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="model dtype (default: the one the record's rollouts were sampled in, else "
                             "bfloat16)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="backend option; VALUE is parsed as JSON when it can be")
    parser.add_argument("--out", type=Path, help="output record path")
    parser.add_argument("--lora", metavar="PATH",
                        help="a LoRA adapter the backend applies (peft directory or built-in adapter name); "
                             "default: the record's")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `parity replay` on `argv` (the arguments after the command); returns the exit code."""
    return run_command("parity replay", argv, _parser(), _run)


def _recorded_dtype(record: Record) -> str:
    """The dtype the record's rollouts were sampled in (their meta), so that the replay samples as the
    run did; bfloat16 when they name none; ConfigError when they name several."""
    dtypes = {r.meta.get("dtype") for rs in record.rollouts.values() for r in rs} - {None}
    if len(dtypes) > 1:
        raise ConfigError(f"the record's rollouts were sampled in several dtypes {sorted(map(str, dtypes))}; "
                          "pick the replay's with --dtype")
    return str(dtypes.pop()) if dtypes else "bfloat16"


def _run(args: argparse.Namespace) -> int:
    refuse_empty("--model", args.model, MODEL_VALUES, "replay with the record's model")
    refuse_empty("--lora", args.lora, "a peft adapter directory or a built-in adapter's name",
                 "apply the record's adapter (if any)")
    record = read_record(args.record)
    model = args.model or record.model
    if model is None:
        raise ConfigError("the record names no model; pass --model")
    out = args.out or args.record.with_suffix(f".{args.backend}{args.record.suffix}")
    output_file(out, "--out")
    lora = args.lora or (record.meta.get("lora") or {}).get("path")
    given = parse_options(args.option, {"lora": "--lora and --option lora are both given; give the adapter "
                                                "once, with --lora"} if args.lora is not None else None)
    options = {**lora_options(args.backend, lora), **given}
    with get_backend(args.backend, model, dtype=args.dtype or _recorded_dtype(record), **options) as backend:
        new = replay(record, backend)
    previous = [r for name, rs in record.rollouts.items() if name != args.backend for r in rs]
    write_record(out, record.requests, previous + new, model=str(model), meta=record.meta)
    sys.stdout.write(f"{out}\n")
    return 0
