"""`parity loop`: the on-policy RL loop from the command line, one line per step and backend.

Exit 0 when every step had every backend in sync and the reference engine bitwise with the
training forward, and every update's differentiable forward bitwise with it; 1 when not; 2 on any
error (the JSON keeps earlier steps); 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from parity.backends import parse_options
from parity.core.errors import EXIT_FAILED, ConfigError
from parity.core.schema import DTYPES, REFERENCE
from parity.loop import loop
from parity.loop.record import LoopRecord
from parity.runtime.frame import Parser, run_command

#: columns of the per-step lines: (header, row key, width, format spec).
COLUMNS: tuple[tuple[str, str, int, str], ...] = (
    ("step", "step", 4, "d"), ("backend", "backend", 12, "s"),
    ("max|dlogp|", "max_abs_logprob_diff", 10, ".3g"), ("mean|dlogp|", "mean_abs_logprob_diff", 11, ".3g"),
    ("k3_kl", "k3_kl", 9, ".3g"), ("is_mean", "is_ratio_mean", 8, ".4f"), ("clip", "clip_fraction", 6, ".3f"),
    ("reward", "reward_mean", 7, ".4f"), ("policy_kl", "policy_kl_from_start", 9, ".3g"),
    ("bitwise", "bitwise", 7, ""), ("in_sync", "weights_in_sync", 7, ""), ("s", "seconds", 6, ".2f"),
)


def _parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="parity loop",
        description="Run an on-policy GRPO loop: every step samples on every backend, measures each one's "
                    "drift against the training forward at that step's weights, trains on one backend's "
                    "rollouts (AdamW), pushes the new weights to every backend and verifies them.")
    p.add_argument("--model", required=True, help="built-in checkpoint name or local HF checkpoint directory")
    p.add_argument("--backends", default=REFERENCE, help="comma-separated backends (default: reference)")
    p.add_argument("--steps", type=int, default=20, help="training steps (default: 20)")
    p.add_argument("--case", help="case file or name whose prompts to use (needs --reward)")
    p.add_argument("--reward", metavar="MODULE:FUNCTION",
                   help="a reward function of a parity Rollout (default: the arithmetic task's check)")
    p.add_argument("--train-on", default=REFERENCE,
                   help="backend whose rollouts train the policy (default: reference)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    p.add_argument("--correction", default="none",
                   help="rollout correction of the loss: none, token_tis[:U], sequence_tis[:U], "
                        "geometric_tis[:U], icepop[:L_U], seq_mask_tis[:L_U] or a rollout_rs criterion with "
                        "its threshold, e.g. seq_mean_k3:0.01 (default: none)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the prompts and of every step's sampling (default: 0)")
    p.add_argument("--n", type=int, default=4, help="responses per prompt, one GRPO group (default: 4)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per response (default: 16)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: 1.0)")
    p.add_argument("--prompts", type=int, default=8, help="prompts of the built-in task (default: 8)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="dtype of the trainer and of each backend without --backend-dtype (default: float32)")
    p.add_argument("--backend-dtype", action="append", default=[], metavar="BACKEND=DTYPE",
                   help="a backend's own dtype, e.g. vllm=bfloat16 (repeatable)")
    p.add_argument("--device", default="auto",
                   help="device of the trainer and the reference engine (default: auto = cuda when a "
                        "backend runs there, vLLM on a CUDA host, else cpu)")
    p.add_argument("--lora-rank", type=int, metavar="R",
                   help="train only a LoRA adapter of rank R (base frozen); push only the adapter each step")
    p.add_argument("--micro-batch-size", type=int, help="sequences per differentiable forward (default: all)")
    p.add_argument("--option", action="append", default=[], metavar="BACKEND.KEY=VALUE",
                   help="a backend option, e.g. vllm.enable_prefix_caching=false (repeatable)")
    p.add_argument("--json", type=Path, metavar="OUT",
                   help="write the record to OUT (rewritten after every step)")
    p.add_argument("--html", type=Path, metavar="OUT", help="write the page with per-step charts to OUT")
    return p


def _reward(spec: str | None) -> Any:
    """`module:function` -> the function."""
    if spec is None:
        return None
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ConfigError(f"--reward {spec!r}: expected MODULE:FUNCTION, e.g. my_rewards:exact_match")
    try:
        fn = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--reward {spec!r}: cannot import it ({exc})") from exc
    if not callable(fn):
        raise ConfigError(f"--reward {spec!r} is not a function")
    return fn


def _backend_dtypes(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, dtype = item.partition("=")
        if not sep:
            raise ConfigError(f"--backend-dtype {item!r}: expected BACKEND=DTYPE, e.g. vllm=bfloat16")
        out[name] = dtype
    return out


def _backend_options(items: list[str]) -> dict[str, dict[str, Any]]:
    texts: dict[str, list[str]] = {}
    for item in items:
        backend, dot, rest = item.partition(".")
        if not dot:
            raise ConfigError(f"--option {item!r}: expected BACKEND.KEY=VALUE, "
                              "e.g. vllm.enable_prefix_caching=false")
        texts.setdefault(backend, []).append(rest)
    return {backend: parse_options(rest) for backend, rest in texts.items()}


def format_row(row: dict[str, Any]) -> str:
    """One step row as a line of the table (`COLUMNS`)."""
    cells = []
    for _, key, width, spec in COLUMNS:
        value = row.get(key)
        text = "-" if value is None else format(value, spec) if spec else str(value)
        cells.append(f"{text:<{width}}" if key == "backend" else f"{text:>{width}}")
    return " ".join(cells)


def header() -> str:
    return " ".join(f"{h:<{width}}" if key == "backend" else f"{h:>{width}}" for h, key, width, _ in COLUMNS)


def verdict(record: LoopRecord) -> int:
    """EXIT_FAILED when a row was out of sync, the reference engine was not bitwise, or an update's
    differentiable forward differed from the no-grad one the rows measure (`forward_bitwise`), else 0."""
    bad = [row for row in record.steps if not row["weights_in_sync"]
           or (row["backend"] == REFERENCE and not row["bitwise"])]
    bad += [update for update in record.updates if not update["forward_bitwise"]]
    return EXIT_FAILED if bad else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run `parity loop` on `argv` (the arguments after the subcommand); returns the exit code."""
    return run_command("parity", argv, _parser(), _run)


def _run(args: argparse.Namespace) -> int:
    print(header(), flush=True)
    record = loop(args.model, [b.strip() for b in args.backends.split(",") if b.strip()], steps=args.steps,
                  case=args.case, reward=_reward(args.reward), train_on=args.train_on, lr=args.lr,
                  correction=args.correction, seed=args.seed, n=args.n, max_tokens=args.max_tokens,
                  temperature=args.temperature, prompts=args.prompts, dtype=args.dtype, device=args.device,
                  micro_batch_size=args.micro_batch_size, backend_dtypes=_backend_dtypes(args.backend_dtype),
                  backend_options=_backend_options(args.option), lora_rank=args.lora_rank, json=args.json,
                  html=args.html,
                  progress=lambda rows: print("\n".join(format_row(r) for r in rows), flush=True))
    for path in (args.json, args.html):
        if path is not None:
            print(f"wrote {path}")
    return verdict(record)
