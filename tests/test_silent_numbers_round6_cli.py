"""A single-value flag given twice with two values is refused by every command (argparse kept the
last one unsaid: `--dtype float32 ... --dtype bfloat16` ran in bf16)."""

from __future__ import annotations

import argparse
import pathlib

import pytest

import parity
from parity import cli
from parity.runtime.frame import Parser

PACKAGE = pathlib.Path(parity.__file__).parent


def _parser() -> Parser:
    parser = Parser(prog="parity demo")
    parser.add_argument("source")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--option", action="append", default=[])
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("-v", action="count", default=0)
    return parser


def test_two_values_for_one_flag_are_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        _parser().parse_args(["x", "--dtype", "float32", "--dtype=bfloat16"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "argument --dtype: given twice ('float32', then 'bfloat16'); give it once" in err


def test_the_same_value_twice_and_repeatable_flags_still_parse() -> None:
    args = _parser().parse_args(["x", "--dtype", "float32", "--dtype", "float32", "--option", "a=1",
                                 "--option", "b=2", "--quiet", "--quiet", "-vv"])
    assert (args.dtype, args.option, args.quiet, args.v) == ("float32", ["a=1", "b=2"], True, 2)
    assert not hasattr(args, "_parity_given")  # the bookkeeping leaves with the parse


def test_the_default_is_not_a_first_value() -> None:
    assert _parser().parse_args(["x", "--dtype", "bfloat16"]).dtype == "bfloat16"


@pytest.mark.parametrize("argv", [
    ["compare", "--dtype", "float32", "--dtype", "bfloat16"],
    ["score", "rollouts.jsonl", "--backend", "vllm", "--backend", "reference"],
    ["advise", "report.json", "--seed", "1", "--seed", "2"],
])
def test_commands_refuse_a_flag_given_twice(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 2
    assert "given twice" in capsys.readouterr().err


def test_every_command_parser_is_a_parity_parser() -> None:
    """A command built on plain argparse would let the last of two values win again."""
    plain = [str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
             if "argparse.ArgumentParser(" in path.read_text() and path.name != "cli.py"]
    assert plain == []
    assert issubclass(Parser, argparse.ArgumentParser)
