"""Wall time of one GPU nightly matrix on one vs two GPUs, on the Ray executor, back to back.

Run from the repository root on a host with two GPUs (Ray installed):

    PYTHONUNBUFFERED=1 python3 -m benchmarks.nightly_ray --out $OUT [--repeats 3] [--matrix shaped]

Each repeat runs `parity nightly --executor ray --device cuda` on the same matrix (reference
rows, by default in bfloat16 and float32) twice, alternating: with `CUDA_VISIBLE_DEVICES=0` (the local
cluster sees one GPU) and with `0,1`, each in a fresh history so no run resumes another.
Prints a table of median wall seconds and the ratio, the row seconds (backend start + case)
each GPU spent, and which GPU each row ran on.

Matrices: `builtin` is six built-in cases on the tiny checkpoints (rows of a second or less, so
the fixed costs of a run dominate); `shaped` is `SHAPED_CASES` cases on one random checkpoint
with Qwen3-1.7B's layer shapes (8 layers, 151,936-token vocabulary), `--prompts` prompts of
200-300 tokens and `--tokens` sampled tokens each: rows of seconds, where spreading them counts.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = ",".join(str(ROOT / "cases" / name) for name in
                 ("smoke.toml", "moe.toml", "long-prompt.toml", "sampling-sweep.toml", "grpo-group.toml",
                  "shared-prefix.toml"))
SHAPED_CASES = 8
SHAPED_CASE = """description = "Qwen3-1.7B-shaped, 8 layers: {prompts} prompts, {tokens} sampled tokens."
model = "{model}"

[prompts.generate]
kind = "random"
seed = {seed}
count = {prompts}
length = {{ min = 200, max = 300 }}

[sampling]
n = 1
temperature = 1.0
top_p = 0.95
max_tokens = {tokens}
seed = {seed}
"""
CODE = "import sys; from parity.nightly import main; sys.exit(main(sys.argv[1:]))"


def shaped_cases(out: Path, prompts: int, tokens: int) -> str:
    """Write the shaped checkpoint and `SHAPED_CASES` cases on it under `out`; their paths, comma-joined."""
    from parity.models.shaped import save_random_model, shaped_config

    model = save_random_model(shaped_config("qwen3-1.7b", 8, max_position_embeddings=1024), out / "model")
    (out / "cases").mkdir(parents=True, exist_ok=True)
    paths = []
    for seed in range(SHAPED_CASES):
        path = out / "cases" / f"shaped-{seed}.toml"
        path.write_text(SHAPED_CASE.format(model=model, seed=seed + 1, prompts=prompts, tokens=tokens))
        paths.append(str(path))
    return ",".join(paths)


Row = tuple[str, str, list[str], float]


def run(out: Path, gpus: str, cases: str, dtypes: str) -> tuple[float, list[Row]]:
    """One matrix on the GPUs `gpus`: wall seconds and (row, status, GPU ids, row seconds) per row."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus, "PYTHONPATH": path}
    argv = [sys.executable, "-c", CODE, "--cases", cases, "--backends", "reference", "--dtypes",
            dtypes, "--device", "cuda", "--executor", "ray", "--run-id", "bench",
            "--out", str(out), "--no-progress"]
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if done.returncode not in (0, 1):
        raise SystemExit(f"nightly on GPUs {gpus} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    with sqlite3.connect(out / "history.sqlite") as db:
        rows = [(key, status, json.loads(prov)["ran_on"].get("gpu_ids", []), sum(json.loads(timing).values()))
                for key, status, prov, timing in
                db.execute("SELECT row_key, status, provenance, timing FROM rows ORDER BY id")]
    return wall, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--matrix", choices=("builtin", "shaped"), default="builtin")
    p.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated dtypes of every row")
    p.add_argument("--prompts", type=int, default=64, help="prompts per shaped case")
    p.add_argument("--tokens", type=int, default=256, help="sampled tokens per prompt of a shaped case")
    args = p.parse_args()
    cases = (CASES if args.matrix == "builtin" else
             shaped_cases(args.out / "shaped", args.prompts, args.tokens))
    walls: dict[str, list[float]] = {"0": [], "0,1": []}
    placements = {}
    for r in range(args.repeats):
        for gpus in walls:
            wall, rows = run(args.out / f"gpus-{gpus.replace(',', '_')}-{r}", gpus, cases, args.dtypes)
            walls[gpus].append(wall)
            placements[gpus] = rows
            busy = {g: sum(s for _, _, ids, s in rows if ids == [g]) for g in ("0", "1")}
            print(f"repeat {r}: GPUs {gpus}: {wall:.1f} s, {len(rows)} rows "
                  f"({sum(st == 'pass' for _, st, _, _ in rows)} pass), row seconds per GPU "
                  f"{ {g: round(b, 1) for g, b in busy.items()} }", flush=True)
            record = {"matrix": args.matrix, "walls": walls, "placements": placements}
            (args.out / "nightly_ray.json").write_text(json.dumps(record, indent=1))
    one, two = statistics.median(walls["0"]), statistics.median(walls["0,1"])
    print("\n| GPUs | rows | median wall s | all walls s |\n|---|---|---|---|")
    for gpus, label in (("0", "1"), ("0,1", "2")):
        print(f"| {label} | {len(placements[gpus])} | {statistics.median(walls[gpus]):.1f} | "
              f"{', '.join(f'{w:.1f}' for w in walls[gpus])} |")
    print(f"\nspeed-up 2 vs 1 GPU: {one / two:.2f}x")
    print("rows per GPU with two:", {g: sum(1 for _, _, ids, _ in placements["0,1"] if ids == [g])
                                     for g in ("0", "1")})


if __name__ == "__main__":
    main()
