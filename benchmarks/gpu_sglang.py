"""SGLang on a GPU: drift against parity's training forward, its deterministic mode through `parity
audit`, and throughput beside parity's reference engine.

One command on a CUDA host where PARITY_SGLANG_PYTHON names a Python with SGLang (on the lent H200s
SGLang comes from carried parts, `tools/h200_sglang.sh`, which sets it):

    python3 -m benchmarks.gpu_sglang --out OUT        # every section, or --sections a,b
    bash tools/h200_sglang.sh run --out $OUT          # the lent H200: stage, install once, run

Every SGLang server is started by the adapter (`launch_server=True`) with `SERVER_ARGS` (Triton
attention: the carried sgl-kernel has no FlashAttention library; PyTorch sampling: no flashinfer
JIT build). It resumes like `benchmarks.gpu_backends` (`benchmarks.gpu_ledger`, --state): a run cut
by a call's limit continues in the next call on the same machine. Writes OUT/gpu_sglang.json.

Sections, in this order:
- `install`: versions the server's Python imports (sglang, sgl_kernel, flashinfer, torch,
  transformers).
- `compare`: `parity.compare` rows, each with a fresh server: the Qwen3-1.7B shape (28 layers,
  random bf16 weights) raw, processed, multi-turn and with --enable-deterministic-inference; the
  Qwen3-30B-A3B shape (`--moe-layers`) raw with routed experts returned, R3 replayed. The two raw
  Qwen3-1.7B servers (deterministic mode off and on) are also audited by `parity audit` (`cli_audit`).
- `probe`: the engine probe from SGLang's per-pass tensor dumps (`parity attribute --backend sglang`)
  on the Qwen3-1.7B shape against the training forward, one sample per call; the whole diff (every
  stage, both phases) in OUT/probe-q28.json.
- `throughput`: output tok/s on `--workload` (requests, prompt, output; default 256,256,512) of
  parity's reference engine and SGLang with deterministic mode off and on, one process each, in
  one call; after its timed run each SGLang server is audited by `parity audit --backend sglang
  --device cuda --option base_url=...` (the built-in case's prompts and seeds with raw logprobs,
  `write_audit_case`), its JSON kept as OUT/audit-SIDE.json.
- `tests`: the gpu + sglang tests (tests/test_sglang_gpu.py), junit XML kept as OUT/tests.xml.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_checks import parity_command, pytest_row, throughput_requests, write_audit_case
from benchmarks.gpu_ledger import Ledger, pending

SECTIONS = ("install", "compare", "probe", "throughput", "tests")
SIDES = ("parity", "sglang", "sglang-det")
#: flags of every server here: see the module docstring; a memory share that leaves room for the trainer.
SERVER_ARGS = ("--attention-backend", "triton", "--sampling-backend", "pytorch", "--random-seed", "0")
SHARED_GPU = ("--mem-fraction-static", "0.35", "--cuda-graph-max-bs", "64")
DETERMINISTIC = ("--enable-deterministic-inference",)
DEFAULT_STATE = Path("/tmp/parity-sglang-state")
STARTED = time.monotonic()


class OutOfTime(RuntimeError):
    """The call's `--budget-s` is spent: the rest of the section waits for the next call."""


def check_budget(args: argparse.Namespace) -> None:
    """OutOfTime once `--budget-s` seconds have passed since the start (a row then does not start,
    so no server is left running when the device call ends)."""
    if args.budget_s is not None and time.monotonic() - STARTED > args.budget_s:
        raise OutOfTime(f"--budget-s {args.budget_s:.0f} spent; run the same command again to resume")


def shaped(state: Path, shape: str, layers: int) -> str:
    """A random bf16 checkpoint of `shape` with `layers` layers, built once on the GPU."""
    from parity.models.shaped import save_random_model, shaped_config

    path = state / f"{shape}-{layers}"
    if not (path / "config.json").exists():
        save_random_model(shaped_config(shape, layers), path, device="cuda", dtype="bfloat16")
    return str(path)


def install_section(args: argparse.Namespace) -> dict[str, Any]:
    code = ("import json, sglang, sgl_kernel, flashinfer, torch, transformers; print(json.dumps("
            "{m.__name__: getattr(m, '__version__', '?') for m in "
            "(sglang, sgl_kernel, flashinfer, torch, transformers)}))")
    done = subprocess.run([os.environ.get("PARITY_SGLANG_PYTHON", sys.executable), "-c", code],
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def _compare_rows(args: argparse.Namespace) -> list[tuple[str, str, str, tuple[str, ...], bool]]:
    """(row key, model, logprobs mode, extra server flags, MoE) of the compare section."""
    dense, moe = shaped(args.state, "qwen3-1.7b", 28), shaped(args.state, "qwen3-30b-a3b", args.moe_layers)
    return [("q28 raw", dense, "raw", (), False), ("q28 processed", dense, "processed", (), False),
            ("q28 raw deterministic", dense, "raw", DETERMINISTIC, False),
            (f"moe{args.moe_layers} raw", moe, "raw", (), True)]


def _summary(report: Any) -> dict[str, Any]:
    s = report.summary
    keys = ("num_tokens", "max_abs_logprob_diff", "mean_abs_logprob_diff", "k3_kl", "router_agreement")
    return {key: s.get(key) for key in keys}


def compare_section(args: argparse.Namespace, ledger: Ledger) -> list[dict[str, Any]]:
    import parity
    from parity.backends import get_backend
    from parity.core.turns import Generate, Inject
    from parity.core.types import SamplingParams

    prompts = [[1, *range(100 + 7 * i, 100 + 7 * i + 32 + 4 * i)] for i in range(args.prompts)]
    for key, model, mode, flags, moe in _compare_rows(args):
        if key in ledger.rows("compare"):
            continue
        check_budget(args)
        # processed logprobs are SGLang's only untruncated: top_p stays 1 there (the adapter refuses less)
        sampling = SamplingParams(n=4, temperature=1.0 if mode == "raw" else 0.8, top_p=0.95 if mode == "raw"
                                  else 1.0, max_tokens=args.tokens, seed=1, logprobs_mode=mode)
        start = time.perf_counter()
        row: dict[str, Any] = {"row": key, "server_args": [*SERVER_ARGS, *SHARED_GPU, *flags]}
        try:
            with get_backend("sglang", model, dtype="bfloat16", logprobs_mode=mode, launch_server=True,
                             server_args=[*SERVER_ARGS, *SHARED_GPU, *flags], return_routed_experts=moe,
                             concurrency=256) as engine:
                row["started_s"] = round(time.perf_counter() - start, 1)
                row["meta"] = {k: engine.meta.get(k) for k in ("backend_version", "server_settings")}
                report = parity.compare(model, engine, prompts=prompts, sampling=sampling, dtype="bfloat16",
                                        device="cuda", router_replay="R3" if moe else None)
                row["single_turn"] = _summary(report)
                if moe:
                    row["sides"] = {side: v["drift"] for side, v in report.extras["router"]["sides"].items()}
                if key.startswith("q28 raw"):
                    row["audit"] = cli_audit(model, engine.server.url,
                                             args.out / f"audit-{key.replace(' ', '-')}.json")
                if key == "q28 raw":
                    turns = parity.compare(model, engine, prompts=prompts[:8], sampling=sampling,
                                           turns=[Generate(16), Inject([50, 51, 52]), Generate(16)],
                                           dtype="bfloat16", device="cuda")
                    row["multi_turn"] = {**_summary(turns), "by_turn": turns.breakdowns.get("by_turn")}
        except Exception as e:  # a row that fails is a row with its error, not a lost table
            row["error"] = f"{type(e).__name__}: {e}"[-3000:]
        row["seconds"] = round(time.perf_counter() - start, 1)
        ledger.keep("compare", key, row)
        print(json.dumps(row, default=str)[:3000], flush=True)
    return list(ledger.rows("compare").values())


def probe_section(args: argparse.Namespace, ledger: Ledger) -> list[dict[str, Any]]:
    """SGLang's stages against the training forward (`engine_diff(backend="sglang")`, its per-pass
    dumps) on the Qwen3-1.7B shape, one sample per call: per phase the first differing stage and the
    relative error layer by layer."""
    from parity.attribute import EngineSide, engine_diff
    from parity.core.types import Request, SamplingParams

    key = "q28 vs training forward"
    if key not in ledger.rows("probe"):
        check_budget(args)
        sampling = SamplingParams(temperature=1.0, max_tokens=32, seed=1, logprobs_mode="raw")
        requests = [Request(tuple(range(100 + 7 * i, 140 + 9 * i)), sampling, f"p{i}") for i in range(4)]
        side = EngineSide({"launch_server": True, "server_args": [*SERVER_ARGS, *SHARED_GPU],
                           "logprobs_mode": "raw"})
        start = time.perf_counter()
        try:
            diff = engine_diff(shaped(args.state, "qwen3-1.7b", 28), requests, backend="sglang", side=side)
            (args.out / "probe-q28.json").write_text(json.dumps(diff.to_dict()))  # every stage, both phases
            row = {"row": key, **{p.phase: {"first_differing": p.first_differing, "depth": p.depth,
                                            "growth": p.growth} for p in diff.phases}}
        except Exception as e:  # a row that fails is a row with its error
            row = {"row": key, "error": f"{type(e).__name__}: {e}"[-3000:]}
        row["seconds"] = round(time.perf_counter() - start, 1)
        ledger.keep("probe", key, row)
        print(json.dumps(row, default=str)[:3000], flush=True)
    return list(ledger.rows("probe").values())


def cli_audit(model: str, url: str, out: Path) -> dict[str, Any]:
    """`parity audit --backend sglang --device cuda` on the running server at `url` (raw case,
    `write_audit_case`); its JSON written to `out`, a summary returned."""
    case = write_audit_case(model, Path(tempfile.mkdtemp()) / "sglang-audit-raw.toml")
    cmd = parity_command("audit", "--backend", "sglang", "--model", model, "--case", str(case), "--device",
                         "cuda", "--dtype", "bfloat16", "--option", f"base_url={url}",
                         "--option", "logprobs_mode=raw", "--json", str(out))
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    row: dict[str, Any] = {"command": " ".join(["parity", *cmd[3:]]), "exit_code": done.returncode,
                           "seconds": round(time.perf_counter() - start, 1), "stdout": done.stdout[-2500:]}
    if not out.exists():
        return {**row, "stderr": done.stderr[-2000:]}
    data = json.loads(out.read_text())
    return {**row, "deterministic": data["deterministic"], "batch_invariant": data["batch_invariant"],
            "checks": {n: {"differing": c["differing_requests"], "requests": c["requests"],
                           "max_abs_logprob_diff": c["max_abs_logprob_diff"], "skipped": c["skipped"]}
                       for n, c in data["checks"].items()},
            "notes": data["provenance"].get("audit")}


def measure(side: str, model: str, workload: tuple[int, int, int], audit_out: Path | None) -> dict[str, Any]:
    """Output tok/s of one side on `workload`, in this process (a child of the section); parity's
    side is `benchmarks.gpu_backends.measure`'s, one timed run after its warm-up. An SGLang
    server reports raw logprobs (at temperature 1, untruncated, the same numbers as processed
    ones) so that, after the timed run, `cli_audit` audits it into `audit_out`."""
    if side == "parity":
        from benchmarks.gpu_backends import measure as measure_once

        return measure_once("parity", model, workload, repeats=1)
    from parity.backends import get_backend

    count = workload[0]
    requests = [dataclasses.replace(r, sampling=r.sampling.replace(logprobs_mode="raw"))
                for r in throughput_requests(workload)]
    flags = [*SERVER_ARGS, "--mem-fraction-static", "0.85", "--max-running-requests", str(count),
             "--cuda-graph-max-bs", str(count), *(DETERMINISTIC if side == "sglang-det" else ())]
    began = time.perf_counter()
    with get_backend("sglang", model, dtype="bfloat16", logprobs_mode="raw", launch_server=True,
                     server_args=flags, concurrency=count) as engine:
        engine.generate(requests[:4])
        setup = time.perf_counter() - began
        start = time.perf_counter()
        produced = sum(len(r.token_ids) for r in engine.generate(requests))
        seconds = time.perf_counter() - start
        audit = None if audit_out is None else cli_audit(model, engine.server.url, audit_out)
    return {"side": side, "output_tokens": produced, "seconds": seconds, "output_tok_s": produced / seconds,
            "setup_s": round(setup, 1), "server_args": flags, **({"audit": audit} if audit else {})}


def throughput_section(args: argparse.Namespace, ledger: Ledger) -> list[dict[str, Any]]:
    model = shaped(args.state, "qwen3-1.7b", 28)
    for side in args.order:
        if side in ledger.rows("throughput"):
            continue
        check_budget(args)
        cmd = [sys.executable, "-m", "benchmarks.gpu_sglang", "--measure", side, "--model", model,
               "--workload", ",".join(map(str, args.workload)), "--out", str(args.out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        row = json.loads(lines[-1]) if done.returncode == 0 and lines else \
            {"side": side, "error": (done.stderr or done.stdout)[-2000:]}
        ledger.keep("throughput", side, row)
        print(json.dumps(row), flush=True)
    return list(ledger.rows("throughput").values())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.gpu_sglang", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("gpu-sglang"))
    p.add_argument("--sections", type=lambda t: [s for s in t.split(",") if s], default=list(SECTIONS))
    p.add_argument("--moe-layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--workload", type=lambda t: tuple(int(x) for x in t.split(",")), default=(256, 256, 512))
    p.add_argument("--order", type=lambda t: t.split(","), default=list(SIDES))
    p.add_argument("--state", type=Path, default=DEFAULT_STATE)
    p.add_argument("--budget-s", type=float, help="start no row after this many seconds (the call's limit)")
    p.add_argument("--redo", action="store_true", help="forget the named sections' state and run them again")
    p.add_argument("--measure", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = [s for s in args.sections if s not in SECTIONS] + [s for s in args.order if s not in SIDES]
    if unknown:
        p.error(f"unknown sections or sides {unknown}; sections: {SECTIONS}, sides: {SIDES}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.measure:
        audit_out = None if args.measure == "parity" else args.out / f"audit-{args.measure}.json"
        print(json.dumps(measure(args.measure, args.model, args.workload, audit_out)), flush=True)
        return
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_sglang needs an NVIDIA GPU (CUDA not available)")
    ledger = Ledger(args.state)
    if args.redo:
        ledger.forget(args.sections)
    runners = {"install": lambda: install_section(args), "compare": lambda: compare_section(args, ledger),
               "probe": lambda: probe_section(args, ledger),
               "throughput": lambda: throughput_section(args, ledger),
               "tests": lambda: check_budget(args) or pytest_row(["tests/test_sglang_gpu.py"], None,
                                                                  args.out / "tests.xml")}
    args.out.mkdir(parents=True, exist_ok=True)
    for section in pending(args.sections, ledger):
        start = time.perf_counter()
        try:
            ledger.finish(section, runners[section]())
            print(f"[{section}] done in {time.perf_counter() - start:.0f} s", flush=True)
        except Exception as e:  # the next section still runs; this one resumes in the next call
            print(f"[{section}] failed after {time.perf_counter() - start:.0f} s: {type(e).__name__}: {e}",
                  flush=True)
        results = {"device": torch.cuda.get_device_name(), "argv": sys.argv[1:],
                   "sections": {s: ledger.result(s) for s in args.sections if ledger.result(s) is not None},
                   "partial": {s: list(ledger.rows(s).values()) for s in pending(args.sections, ledger)},
                   "pending": pending(args.sections, ledger)}
        (args.out / "gpu_sglang.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
