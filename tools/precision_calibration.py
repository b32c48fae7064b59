"""The measurements behind docs/PRECISION.md: every built-in model and SmolLM2 in bf16, fp16 and fp32,
through the reference engine, HF and vLLM-CPU, each row scored by the training forward and the gold.

Run (under the shared lock: it starts vLLM engines):

    flock /tmp/parity-heavy.lock .venv/bin/python tools/precision_calibration.py --json precision.json

Prints one Markdown table row per (model, dtype, backend): tokens; the train/rollout drift
`Tolerance` bounds (mean and max |Δlogp|, k3 KL, share of tokens with ratio outside [1/2, 2] and
outside either side's support); each side's mean and max error from the gold; the rollout/train
error ratio with its 95% interval. Workloads: the tiny models take `default_case` with 16 prompts
of 48 tokens (32 samples, temperature 1, top-p 0.95); SmolLM2 four chat prompts, n=4, 48 tokens,
temperature 0.7. Every engine is closed after its row, so one at a time holds memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-mixtral")
SMOLLM2 = "smollm2-135m-instruct"
CHAT = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a concise math tutor."},
     {"role": "user", "content": "Natalia sold clips to 48 of her friends in April, and then she sold half "
                                 "as many clips in May. How many clips did Natalia sell altogether in April "
                                 "and May?"}],
    [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
    [{"role": "user", "content": "Give me three tips for sleeping better."}],
]
COLUMNS = (
    ("tokens", "num_tokens", "{:d}"), ("mean |Δ|", "mean_abs_logprob_diff", "{:.3g}"),
    ("max |Δ|", "max_abs_logprob_diff", "{:.3g}"), ("k3 KL", "k3_kl", "{:.2g}"),
    ("ratio>2", "frac_tokens_ratio_gt_2", "{:.2%}"), ("outside", "frac_tokens_outside_support", "{:.2%}"),
    ("train err mean", "gold/train_mean_abs_logprob_diff", "{:.3g}"),
    ("train err max", "gold/train_max_abs_logprob_diff", "{:.3g}"),
    ("rollout err mean", "gold/rollout_mean_abs_logprob_diff", "{:.3g}"),
    ("rollout err max", "gold/rollout_max_abs_logprob_diff", "{:.3g}"),
    ("rollout/train", "gold/rollout_to_train_error_ratio", "{:.3g}"),
)


def workload(model: str) -> dict:
    """compare() arguments of a model's calibration workload."""
    from parity.workload.cases import default_case

    if model == SMOLLM2:
        return {"prompts": CHAT, "sampling": {"n": 4, "temperature": 0.7, "max_tokens": 48, "seed": 7000}}
    return {"case": default_case(model, num_prompts=16, max_tokens=48)}


def measure(model: str, dtype: str, backend: str) -> dict:
    """One row: the report's summary and how long it took, or the error that stopped it."""
    import parity
    from parity.backends import get_backend

    start = time.perf_counter()
    try:
        engine = get_backend(backend, model, dtype=dtype)
    except Exception as exc:  # a backend that does not run this dtype here is a finding, not a crash
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    try:
        report = parity.compare(model, engine, dtype=dtype, gold=True, **workload(model))
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    finally:
        engine.close()
    return {"summary": report.summary, "gold": report.extras.get("gold"),
            "seconds": round(time.perf_counter() - start, 1)}


def row_text(model: str, dtype: str, backend: str, result: dict) -> str:
    if "error" in result:
        return f"| {model} | {dtype} | {backend} | {result['error']} |"
    s = result["summary"]
    cells = [fmt.format(s[key]) if key in s else "" for _, key, fmt in COLUMNS]
    low, high = s.get("gold/rollout_to_train_error_ratio_ci95", [float("nan")] * 2)
    return f"| {model} | {dtype} | {backend} | " + " | ".join(cells) + f" | [{low:.3g}, {high:.3g}] |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join((*TINY, SMOLLM2)))
    parser.add_argument("--dtypes", default="bfloat16,float16,float32")
    parser.add_argument("--backends", default="reference,hf,vllm")
    parser.add_argument("--json", type=Path, help="write every row's summary to this file")
    args = parser.parse_args(argv)
    from parity.runtime.quiet import engine_logging

    engine_logging(False)
    print("| model | dtype | backend | " + " | ".join(h for h, _, _ in COLUMNS) + " | 95% interval |")
    print("|" + "---|" * (len(COLUMNS) + 4))
    rows = []
    for model in args.models.split(","):
        for dtype in args.dtypes.split(","):
            for backend in args.backends.split(","):
                result = measure(model, dtype, backend)
                rows.append({"model": model, "dtype": dtype, "backend": backend, **result})
                print(row_text(model, dtype, backend, result), flush=True)
                if args.json is not None:
                    args.json.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
