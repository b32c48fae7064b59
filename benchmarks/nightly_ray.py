"""Wall time of one GPU nightly matrix on one vs two GPUs, on the Ray executor, back to back.

Run from the repository root on a host with two GPUs (Ray installed):

    PYTHONUNBUFFERED=1 python3 -m benchmarks.nightly_ray --out $OUT [--repeats 3]

Each repeat runs `parity nightly --executor ray --device cuda` on the same matrix (reference
rows of `CASES` in bfloat16 and float32) twice, alternating: with `CUDA_VISIBLE_DEVICES=0` (the
local cluster sees one GPU) and with `0,1`, each in a fresh history so no run resumes another.
Prints a table of median wall seconds and the ratio, and which GPU each row ran on.
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
CODE = "import sys; from parity.nightly import main; sys.exit(main(sys.argv[1:]))"


def run(out: Path, gpus: str) -> tuple[float, list[tuple[str, str, list[str]]]]:
    """One matrix on the GPUs `gpus`: wall seconds and (row, status, GPU ids) per row."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", CODE, "--cases", CASES, "--backends", "reference", "--dtypes",
            "bfloat16,float32", "--device", "cuda", "--executor", "ray", "--run-id", "bench",
            "--out", str(out), "--no-progress"]
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if done.returncode not in (0, 1):
        raise SystemExit(f"nightly on GPUs {gpus} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    with sqlite3.connect(out / "history.sqlite") as db:
        rows = [(key, status, json.loads(prov)["ran_on"].get("gpu_ids", [])) for key, status, prov in
                db.execute("SELECT row_key, status, provenance FROM rows ORDER BY id")]
    return wall, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    walls: dict[str, list[float]] = {"0": [], "0,1": []}
    placements = {}
    for r in range(args.repeats):
        for gpus in walls:
            wall, rows = run(args.out / f"gpus-{gpus.replace(',', '_')}-{r}", gpus)
            walls[gpus].append(wall)
            placements[gpus] = rows
            print(f"repeat {r}: GPUs {gpus}: {wall:.1f} s, {len(rows)} rows", flush=True)
    one, two = statistics.median(walls["0"]), statistics.median(walls["0,1"])
    print("\n| GPUs | rows | median wall s | all walls s |\n|---|---|---|---|")
    for gpus, label in (("0", "1"), ("0,1", "2")):
        print(f"| {label} | {len(placements[gpus])} | {statistics.median(walls[gpus]):.1f} | "
              f"{', '.join(f'{w:.1f}' for w in walls[gpus])} |")
    print(f"\nspeed-up 2 vs 1 GPU: {one / two:.2f}x")
    print("rows per GPU with two:", {g: sum(1 for _, _, ids in placements["0,1"] if ids == [g])
                                     for g in ("0", "1")})
    record = {"walls": walls, "placements": placements}
    (args.out / "nightly_ray.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
