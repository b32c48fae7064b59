"""How long the engine probe takes once the engine is up (issue 48, requirement 5: 8 sequences of 512
tokens on the tiny models on CPU in under a minute).

Run: VLLM_TARGET_DEVICE=cpu .venv/bin/python benchmarks/engine_probe.py [model ...] [--sequences N]
[--prompt P] [--tokens T] (default: tiny-llama tiny-qwen3-moe, 8 sequences of 256 prompt + 256 sampled
tokens = 512 positions each). Prints one Markdown table row per (model, stages): the engine's start,
a plain `generate_uncached` of the same requests, the probe run (sampling + capture + transfer), the
training forward with the same stages, the comparison, the whole `engine_diff` after the engine is up,
and the captured bytes. An MoE model gets one more row: every stage with the engine's routes replayed
in the training forward ("all, R3", `replay_routes=True`).
"""

from __future__ import annotations

import argparse
import time

from parity.attribute.probe import compare_probes, probe_engine, train_probe
from parity.attribute.settings import Setting
from parity.attribute.stages import STAGE_KINDS
from parity.backends import close_shared_backends, shared_backend
from parity.core.types import Request, SamplingParams
from parity.models.checkpoints import resolve_model
from parity.models.lora import is_moe_checkpoint

STAGE_SETS = {"all": tuple(STAGE_KINDS), "layer,logits": ("layer", "logits")}
#: the route-replay row of an MoE model: (label, stage kinds).
REPLAY_ROW = ("all, R3", tuple(STAGE_KINDS))


def requests(count: int, prompt: int, tokens: int) -> list[Request]:
    sp = SamplingParams(temperature=1.0, max_tokens=tokens, seed=11, ignore_eos=True)
    return [Request(request_id=f"b{i}", prompt_ids=[(31 * i + 7 * j) % 500 + 3 for j in range(prompt)],
                    sampling=sp) for i in range(count)]


def main(models: list[str], count: int, prompt: int, tokens: int) -> None:
    print("| model | stages | engine start s | plain generate s | probe s | training forward s | compare s "
          "| after engine up s | captured MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    try:
        for model in models:
            start = time.perf_counter()
            engine = shared_backend("vllm", model, dtype="bfloat16", probe=True)
            up = time.perf_counter() - start
            reqs = requests(count, prompt, tokens)
            rows = [(label, kinds, False) for label, kinds in STAGE_SETS.items()]
            if is_moe_checkpoint(resolve_model(model)):
                rows.append((*REPLAY_ROW, True))
            for label, kinds, replay in rows:
                t0 = time.perf_counter()
                engine.generate_uncached(reqs)
                t1 = time.perf_counter()
                side = probe_engine(engine, reqs, list(range(count)), kinds, label="vllm")
                t2 = time.perf_counter()
                train = train_probe(model, side, Setting(dtype="bfloat16"), kinds, replay_routes=replay)
                t3 = time.perf_counter()
                compare_probes(model, "vllm", train, side)
                t4 = time.perf_counter()
                size = sum(t.numel() * t.element_size() for s in side.states.values() for t in s.values())
                print(f"| {model} | {label} | {up:.1f} | {t1 - t0:.2f} | {t2 - t1:.2f} | {t3 - t2:.2f} | "
                      f"{t4 - t3:.2f} | {t4 - t1:.2f} | {size / 2**20:.1f} |", flush=True)
                up = 0.0
    finally:
        close_shared_backends()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*", default=["tiny-llama", "tiny-qwen3-moe"])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    main(args.models, args.sequences, args.prompt, args.tokens)
