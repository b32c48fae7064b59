"""`parity models`, `parity backends`, `parity kernels`: what this installation has and how it runs."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from parity.backends import BACKENDS, available_backends
from parity.core.errors import ModelNotFoundError
from parity.core.schema import DTYPES
from parity.models import BUILTIN_MODELS, TRAINED_MODELS, builtin_dir, cache_dir, trained_dir
from parity.models.trained import packaged_file
from parity.runtime.frame import Parser, run_command


def models(argv: Sequence[str] | None = None) -> int:
    """Run `parity models`: one line per model, then where its checkpoint lives; returns the exit code."""
    parser = Parser(
        prog="parity models", description="List the built-in tiny checkpoints and the trained models "
                                          "converted from installed packages.")
    return run_command("parity", argv, parser, _models)


def backends(argv: Sequence[str] | None = None) -> int:
    """Run `parity backends`: one line per backend adapter and whether it can run here."""
    parser = Parser(prog="parity backends",
                                     description="List backend adapters and whether each is usable here.")
    return run_command("parity", argv, parser, _backends)


def kernels(argv: Sequence[str] | None = None) -> int:
    """Run `parity kernels`: the matmul route of each weight shape of a model; returns the exit code."""
    parser = Parser(
        prog="parity kernels",
        description="Load MODEL on DEVICE (running the load-time matmul probe on CUDA) and print, for "
                    "each distinct linear weight shape, the route the invariant linear takes and why.")
    parser.add_argument("--model", required=True, help="model name (see `parity models`) or a local HF "
                                                       "checkpoint directory")
    parser.add_argument("--device", default="cuda", help="device to load on (default: cuda)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="model dtype (default: bfloat16)")
    parser.add_argument("--cublaslt", action="store_true",
                        help="set this process up for cuBLASLt without split-K first, as an engine process "
                             "would be (else the routes of a process without that setup are shown)")
    return run_command("parity", argv, parser, _kernels)


def _models(args: argparse.Namespace) -> int:
    """One line per model, then where its checkpoint lives (made on first use)."""
    width = max(len(n) for n in (*BUILTIN_MODELS, *TRAINED_MODELS))
    print(f"checkpoints live in {cache_dir()} (set PARITY_CACHE to move them)")
    for name in sorted(BUILTIN_MODELS):
        spec = BUILTIN_MODELS[name]
        print(f"{name.ljust(width)}  {spec.architecture:<22}  {spec.description}")
        print(f"{'':{width}}  {_location(builtin_dir(name), 'generated on first use')}")
    for name in sorted(TRAINED_MODELS):
        trained = TRAINED_MODELS[name]
        try:
            packaged_file(name)
            status = f"from {trained.package} {trained.version}"
        except ModelNotFoundError:
            status = f"not installed: {trained.install_hint}"
        print(f"{name.ljust(width)}  {trained.architecture:<22}  {trained.description}  [{status}]")
        print(f"{'':{width}}  {_location(trained_dir(name, cache_dir()), 'converted on first use')}")
    return 0


def _location(path: Path, later: str) -> str:
    return f"at {path}" if (path / "config.json").is_file() else f"at {path} ({later})"


def _backends(args: argparse.Namespace) -> int:
    width = max(len(n) for n in BACKENDS)
    for name, reason in available_backends().items():
        status = "available" if reason is None else f"unavailable: {reason}"
        print(f"{name.ljust(width)}  {BACKENDS[name].description}  [{status}]")
    return 0


def _kernels(args: argparse.Namespace) -> int:
    from parity.engine.matmul_routes import linear_routes  # loads torch: after parsing, so --help stays light

    rows = linear_routes(args.model, dtype=args.dtype, device=args.device, cublaslt=args.cublaslt)
    # one shape with and without a bias is two rows (two routes on CUDA): the bias tells them apart
    shapes = [f"{row.n} x {row.k}" + (" + bias" if row.has_bias else "") for row in rows]
    wide = max([len(s) for s in shapes] + [16])
    width = max([len(r.route) for r in rows] + [9])
    print(f"{'layers':>6}  {'weight [N, K]':<{wide}}  {'dtype':<9}  {'route':<{width}}  why")
    for row, shape in zip(rows, shapes, strict=True):
        print(f"{row.count:>6}  {shape:<{wide}}  {row.dtype:<9}  {row.route:<{width}}  {row.reason}")
    return 0
