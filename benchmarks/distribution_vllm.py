"""Findings for docs/BACKENDS.md: on vLLM-CPU, the full-distribution drift against the sampled-token
drift (is the sampled-token metric hiding anything?), and the engine's extra time for k = 20.

Run: VLLM_TARGET_DEVICE=cpu .venv/bin/python benchmarks/distribution_vllm.py [model ...] [--prompts N]
[--tokens T] [--setting LABEL] (default: tiny-llama smollm2-135m-instruct, the default case's 8
prompts x n=2 of 32 tokens, both settings). Prints one Markdown table row per (model, setting).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from parity.backends import close_shared_backends, shared_backend
from parity.compare import compare
from parity.workload.cases import default_case

K = 20
SETTINGS = {"t1.0/top_p0.95": {}, "t0.7/top_k20": {"temperature": 0.7, "top_k": 20, "top_p": 1.0}}


def main(models: list[str], prompts: int, tokens: int, settings: list[str]) -> None:
    print("| model | sampling | positions | max / mean abs dlogp (sampled) | KL(train||vllm) mean / max "
          "| KL(vllm||train) mean / max | TV mean / max | top-20 overlap | argmax agree "
          "| engine s k=0 / k=20 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    try:
        for model in models:
            backend = shared_backend("vllm", model, dtype="bfloat16")
            for label in settings:
                changes = SETTINGS[label]
                case = default_case(model, num_prompts=prompts, max_tokens=tokens)
                requests = tuple(replace(r, sampling=r.sampling.replace(**changes)) for r in case.requests)
                case = replace(case, requests=requests)
                seconds = []
                for k in (0, K, 0, K):  # alternated: the machine's load drifts
                    asked = [replace(r, sampling=r.sampling.replace(top_k_logprobs=k)) for r in requests]
                    start = time.perf_counter()
                    backend.generate(asked)
                    seconds.append(time.perf_counter() - start)
                s = compare(model, backend, case=case, dtype="bfloat16", gold=False, top_k_logprobs=K).summary
                d = "distribution/"
                print(f"| {model} | {label} | {s[d + 'num_positions']} | {s['max_abs_logprob_diff']:.3g} / "
                      f"{s['mean_abs_logprob_diff']:.3g} | {s[d + 'kl_train_engine_mean']:.3g} / "
                      f"{s[d + 'kl_train_engine_max']:.3g} | {s[d + 'kl_engine_train_mean']:.3g} / "
                      f"{s[d + 'kl_engine_train_max']:.3g} | {s[d + 'tv_mean']:.3g} / "
                      f"{s[d + 'tv_max']:.3g} | "
                      f"{s[d + 'top_k_overlap']:.4f} | {s[d + 'argmax_agreement']:.4f} | "
                      f"{min(seconds[0::2]):.2f} / {min(seconds[1::2]):.2f} |", flush=True)
    finally:
        close_shared_backends()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*", default=["tiny-llama", "smollm2-135m-instruct"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--setting", action="append", choices=list(SETTINGS))
    args = parser.parse_args()
    main(args.models, args.prompts, args.tokens, args.setting or list(SETTINGS))
