"""Reference-engine throughput with a LoRA adapter against without one, side by side (CPU or CUDA).

Run (from the repository root):

    .venv/bin/python benchmarks/lora.py                 # CPU: tiny-llama and a SmolLM2-135M shape
    .venv/bin/python benchmarks/lora.py --device cuda --shape qwen3-1.7b --layers 28 \\
        --requests 256 --prompt 256 --output 512       # the H200 workload of docs/PERF.md
    .venv/bin/python benchmarks/lora.py --merged        # adapter vs merged checkpoint, per token
    .venv/bin/python benchmarks/lora.py --vllm          # vLLM's drift with an adapter, and the sync check

What is timed: `ReferenceEngine.generate` (invariant kernels, bf16, `max_num_seqs` = requests,
chunk 64) of `--requests` prompts x `--prompt` ids x `--output` tokens (temperature 1, EOS ignored)
on the same model with no adapter and with adapters of each `--ranks` rank on every attention and
MLP projection (rsLoRA at rank 64, as the built-in ones; weights from
`parity.models.lora_builtins.adapter_weights`). Each setting gets one warm-up call, then `--rounds`
timed calls, the settings interleaved round by round; the table shows the median output tokens/s
by wall clock and by this process's CPU time (steadier on a shared machine), and the ratios to no
adapter. The models:
tiny-llama with its built-in adapters (CPU only) and a random-weight model of `--shape` with
`--layers` layers (`parity.models.shaped`), generated once into $PARITY_CACHE/shaped/.

`--merged` measures instead how far the merged checkpoint (`parity.models.lora.merge_adapter`) is
from the adapter: 16 prompts x n=2 x 32 tokens sampled by the reference engine with the adapter,
each token scored by `train_forward` with the adapter and on the merged checkpoint (invariant
kernels), per built-in adapter and dtype.

`--vllm` compares vLLM (bf16, the build installed here) with the training forward on tiny-llama with
no adapter and with its rank-8 and rank-64 adapters (the case's 8 prompts x n=2 x 32 tokens,
`parity.compare`), then prints `check_adapter_sync`'s distances after a correct swap, a stale one
(the new directory under the old adapter's id) and a doubled lora_alpha.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402  (after the path: parity is imported from ROOT)

from parity import Request, SamplingParams  # noqa: E402
from parity.core.schema import LORA_TARGETS as TARGETS  # noqa: E402
from parity.engine import ReferenceEngine  # noqa: E402
from parity.models.checkpoints import cache_dir, resolve_model  # noqa: E402
from parity.models.lora_builtins import adapter_config, adapter_weights, write_adapter  # noqa: E402
from parity.models.shaped import save_random_model, shaped_config  # noqa: E402


def shaped_model(shape: str, layers: int, device: str) -> Path:
    """The random-weight checkpoint of `shape`, saved once (seeded: the same bits every time)."""
    path = cache_dir() / "shaped" / f"{shape}-{layers}l-bf16"
    if not (path / "config.json").exists():
        save_random_model(shaped_config(shape, layers), path, device=device, dtype="bfloat16")
    return path


def adapter(model: Path, rank: int) -> Path:
    """A rank-`rank` adapter on every projection of `model` (rsLoRA from rank 64 on), saved once."""
    rslora = rank >= 64
    scaling = 16 / (rank ** 0.5 if rslora else rank)
    path = model.parent / f"{model.name}-lora-r{rank}"
    if not (path / "adapter_model.safetensors").exists():
        write_adapter(path, adapter_config(model.name, rank, 16, rslora, TARGETS),
                      adapter_weights(model, rank, scaling, TARGETS, seed=rank), replace=False)
    return path


def workload(vocab: int, requests: int, prompt: int, output: int) -> list[Request]:
    return [Request(tuple(3 + (7919 * i + 31 * j) % (vocab - 3) for j in range(prompt)),
                    SamplingParams(temperature=1.0, max_tokens=output, seed=i, ignore_eos=True),
                    request_id=str(i)) for i in range(requests)]


def timed_rounds(model: str, adapters: dict[int, str | None], requests: list[Request], device: str,
                 rounds: int) -> dict[int, dict[str, list[float]]]:
    """Per setting (rank, 0 = no adapter): output tokens/s of each timed generate call, by wall clock
    and by this process's CPU time. Every setting's engine is started and warmed up first, then each
    round times every setting once, interleaved, so a load change on a shared machine hits all."""
    engines = {rank: ReferenceEngine(model, dtype="bfloat16", device=device, lora=lora,
                                     max_num_seqs=len(requests), chunk_size=64)
               for rank, lora in adapters.items()}
    speeds: dict[int, dict[str, list[float]]] = {rank: {"wall": [], "cpu": []} for rank in engines}
    try:
        for engine in engines.values():
            engine.generate(requests)
        for _ in range(rounds):
            for rank, engine in engines.items():
                if device == "cuda":
                    torch.cuda.synchronize()
                start, start_cpu = time.perf_counter(), time.process_time()
                rollouts = engine.generate(requests)
                if device == "cuda":
                    torch.cuda.synchronize()
                tokens = sum(len(r.token_ids) for r in rollouts)
                speeds[rank]["wall"].append(tokens / (time.perf_counter() - start))
                speeds[rank]["cpu"].append(tokens / (time.process_time() - start_cpu))
    finally:
        for engine in engines.values():
            engine.close()
    return speeds


def merged_table() -> None:
    """Per-token |Δlogp| between the adapter's training forward and the merged checkpoint's."""
    import tempfile

    from parity.engine import train_forward
    from parity.models.lora import merge_adapter

    print("| model | adapter | dtype | tokens | max |Δlogp| | mean |Δlogp| | tokens bitwise equal |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for model, adapter in (("tiny-llama", "tiny-llama-lora-r8"), ("tiny-llama", "tiny-llama-lora-r64"),
                           ("tiny-qwen3-moe", "tiny-qwen3-moe-lora-r8")):
        with tempfile.TemporaryDirectory() as tmp:
            merged = str(merge_adapter(model, adapter, Path(tmp) / "merged"))
            for dtype in ("float32", "bfloat16"):
                requests = [Request(tuple(3 + (7919 * i + 31 * j) % 500 for j in range(24)),
                                    SamplingParams(n=2, max_tokens=32, seed=i, temperature=1.0), str(i))
                            for i in range(16)]
                with ReferenceEngine(model, dtype=dtype, lora=adapter) as engine:
                    rollouts = engine.generate(requests)
                pairs = [(r.prompt_ids, r.token_ids) for r in rollouts]
                ours = torch.cat(train_forward(model, rollouts, dtype=dtype).logprobs)
                whole = torch.cat(train_forward(merged, pairs, dtype=dtype, temperature=1.0).logprobs)
                diff = (ours - whole).abs()
                print(f"| {model} | {adapter.rsplit('-', 1)[1]} | {dtype} | {diff.numel()} | "
                      f"{float(diff.max()):.3g} | {float(diff.mean()):.3g} | {int((diff == 0).sum())} |",
                      flush=True)


def vllm_table() -> None:
    """vLLM's drift with and without an adapter, and the adapter-sync check's distances."""
    import tempfile

    from vllm.lora.request import LoRARequest

    import parity
    from parity.backends import get_backend
    from parity.backends.weight_sync import check_adapter_sync
    from parity.workload.cases import default_case

    case = default_case("tiny-llama", max_tokens=32)
    print("| adapter | tokens | max |Δlogp| | mean |Δlogp| | passed |")
    print("| --- | --- | --- | --- | --- |")
    for lora in (None, "tiny-llama-lora-r8", "tiny-llama-lora-r64"):
        report = parity.compare("tiny-llama", "vllm", case=case, dtype="bfloat16", lora=lora)
        s = report.summary
        print(f"| {lora or 'none'} | {s['num_tokens']} | {s['max_abs_logprob_diff']:.3g} | "
              f"{s['mean_abs_logprob_diff']:.3g} | {report.passed} |", flush=True)
    sequences = [(r.prompt_ids, tuple(range(60 + i, 92 + i))) for i, r in enumerate(case.requests)]
    with tempfile.TemporaryDirectory() as tmp, \
            get_backend("vllm", "tiny-llama", dtype="bfloat16", lora="tiny-llama-lora-r8") as engine:
        model = resolve_model("tiny-llama")
        nxt = write_adapter(Path(tmp) / "next", adapter_config("tiny-llama", 8, 16, False, TARGETS),
                            adapter_weights(model, 8, 2.0, TARGETS, seed=31))
        doubled = write_adapter(Path(tmp) / "doubled", adapter_config("tiny-llama", 8, 32, False, TARGETS),
                                adapter_weights(model, 8, 2.0, TARGETS, seed=31))
        rows = []
        current = engine._lora_request
        engine._lora_request = LoRARequest(current.lora_name, current.lora_int_id, str(nxt))  # the stale trap
        rows.append(("stale (new path, old id)", check_adapter_sync(engine, sequences, expected=nxt,
                                                                    previous="tiny-llama-lora-r8")))
        engine._lora_request = current
        engine.load_adapter(nxt)
        rows.append(("swapped", check_adapter_sync(engine, sequences, expected=nxt,
                                                   previous="tiny-llama-lora-r8")))
        engine.load_adapter(doubled)
        rows.append(("lora_alpha doubled", check_adapter_sync(engine, sequences, expected=nxt,
                                                              previous="tiny-llama-lora-r8")))
    names = list(rows[0][1].distances)
    print("\n| engine state | verdict | " + " | ".join(f"mean |Δ| to {n}" for n in names) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in names) + " |")
    for label, result in rows:
        cells = " | ".join(f"{result.distances[n]:.3g}" for n in names)
        print(f"| {label} | {result.verdict} | {cells} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--shape", default="smollm2-135m", help="a parity.models.shaped shape")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--ranks", default="8,64", help="comma-separated adapter ranks")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--merged", action="store_true", help="the merged-checkpoint table instead")
    parser.add_argument("--vllm", action="store_true", help="vLLM's drift and the adapter-sync check instead")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.merged:
        merged_table()
        return
    if args.vllm:
        vllm_table()
        return
    ranks = [int(r) for r in args.ranks.split(",") if r]
    shaped = shaped_model(args.shape, args.layers, args.device)
    models: list[tuple[str, str, int, dict[int, str]]] = []
    if args.device == "cpu":
        models.append(("tiny-llama", "tiny-llama", 512, {r: f"tiny-llama-lora-r{r}" for r in ranks}))
    vocab = shaped_config(args.shape, args.layers).vocab_size
    models.append((f"{args.shape} x {args.layers}", str(shaped), vocab,
                   {r: str(adapter(shaped, r)) for r in ranks}))
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{os.cpu_count()} CPUs"
    print(f"# reference engine, invariant kernels, bf16, {args.requests} requests x {args.prompt} prompt x "
          f"{args.output} output tokens; torch {torch.__version__}, {args.threads} threads, {where}; "
          f"median of {args.rounds} rounds (output tok/s)", flush=True)
    print("| model | adapter | wall tok/s (median) | rounds | vs none | CPU-time tok/s (median) | vs none |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, model, vocab_size, adapters in models:
        requests = workload(vocab_size, args.requests, args.prompt, args.output)
        speeds = timed_rounds(model, {0: None, **adapters}, requests, args.device, args.rounds)
        base = {clock: statistics.median(speeds[0][clock]) for clock in ("wall", "cpu")}
        for rank in sorted(speeds):
            wall, cpu = (statistics.median(speeds[rank][clock]) for clock in ("wall", "cpu"))
            name = "none" if rank == 0 else f"r{rank}" + (" (rsLoRA)" if rank >= 64 else "")
            rounds = ", ".join(f"{s:,.0f}" for s in speeds[rank]["wall"])
            print(f"| {label} | {name} | {wall:,.0f} | {rounds} | {wall / base['wall']:.2f} | {cpu:,.0f} | "
                  f"{cpu / base['cpu']:.2f} |", flush=True)

if __name__ == "__main__":
    main()
