"""The `probe` section of `benchmarks.gpu_backends` (issue 48 requirement 4): inside vLLM on the GPU.

Each row is one child process, kept in the ledger as it finishes (a run cut by the call limit
resumes at the next row):
- `parity attribute --backend vllm` rows (PROBE_ROWS): which stage first varies with batch size
  under vLLM's batch-invariant mode, and vLLM against the training forward layer by layer on the
  Qwen3-1.7B shape (28 layers) and the MoE shape. The probe runs vLLM eager (its hooks do not run
  inside a compiled graph or a CUDA graph), and on the H200 eager execution is the setting in which
  the batch-invariant mode does least (docs/BACKENDS.md): these rows locate the variation of the
  eager engine.
- the logits rows (LOGITS_ROWS): the compiled engine (vLLM's default compile and CUDA graphs)
  with the batch-invariant mode, asked for raw logits (`logprobs_mode="raw_logits"`, greedy): the
  sampled token's logit alone and in a batch of all requests, compared bit for bit. The compiled
  model is out of the probe's reach, its logits are not: they say whether the bf16 logits vary
  with batch size or only the float32 normalisation after them. The row also records the
  attention backend the worker resolved (parity's `parity_attention_backends`).

    python3 -m benchmarks.gpu_backends --sections probe --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_checks import failure, parity_command, run_json_command
from benchmarks.gpu_ledger import Ledger
from parity.backends.vllm_weights import DIGEST_EXTENSION
from parity.models.checkpoints import resolve_model

#: the engine's share of the GPU: the training forward runs beside it.
PROBE_MEMORY = 0.3
_ENGINE = "engine_kwargs=" + json.dumps({"gpu_memory_utilization": PROBE_MEMORY})

#: key -> (model label, `parity attribute` arguments after --model).
PROBE_ROWS: dict[str, tuple[str, list[str]]] = {
    "q28 batch-invariant, 1 vs 8 per call": (
        "q28", ["--option", "batch_invariant=true", "--versus", "batch"]),
    "q28 vs training forward": ("q28", []),
    "moe vs training forward": ("moe", []),
    "moe vs training forward, R3": ("moe", ["--replay-routes"]),
    "tiny-qwen3 mode off vs on": ("tiny-qwen3", ["--versus", "batch_invariant=true"]),
    "tiny-qwen3 batch-invariant, 1 vs 8 per call": (
        "tiny-qwen3", ["--option", "batch_invariant=true", "--versus", "batch"]),
    "tiny-qwen3 batch-invariant, TRITON_ATTN, 1 vs 8 per call": (
        "tiny-qwen3", ["--option", "batch_invariant=true", "--option", "engine_kwargs=" + json.dumps(
            {"gpu_memory_utilization": PROBE_MEMORY, "attention_config": {"backend": "TRITON_ATTN"}}),
                       "--versus", "batch"]),
    "tiny-qwen3 batch-invariant, 1 vs 8 among 56 fillers per call": (
        "tiny-qwen3", ["--option", "batch_invariant=true", "--versus", "batch", "--fillers", "56"]),
}
#: key -> (model label, batch-invariant mode on).
LOGITS_ROWS: dict[str, tuple[str, bool]] = {
    "q28 compiled, batch-invariant: logits 1 vs 8": ("q28", True),
    "tiny-qwen3 compiled, batch-invariant: logits 1 vs 8": ("tiny-qwen3", True),
}


def _model(label: str, state: Path, shaped: Any, moe_layers: int) -> str:
    if label == "q28":
        return shaped(state, "qwen3-1.7b", 28)
    if label == "moe":
        return shaped(state, "qwen3-30b-a3b", moe_layers)
    return label


def summary(engine: dict[str, Any]) -> dict[str, Any]:
    """The row of one `parity attribute --json` engine diff: per phase the first differing stage,
    the growth over depth, and each stage's relative error and share of differing elements."""
    return {"side_a": engine["side_a"], "side_b": engine["side_b"], "parted": engine["parted"],
            "sequences": len(engine["sequences"]), "positions": engine["positions"],
            "phases": {p["phase"]: {"first_differing": p["first_differing"], "growth": p["growth"],
                                    "stages": {s["stage"]: [s["rel_error"], s["share"], s["max_abs"]]
                                               for s in p["stages"]}}
                       for p in engine["phases"]}}


def _attribute_row(model: str, extra: list[str], json_path: Path, html_path: Path) -> dict[str, Any]:
    cmd = parity_command("attribute", "--backend", "vllm", "--model", model, "--device", "cuda",
                         "--dtype", "bfloat16", "--max-sequences", "8", "--option", _ENGINE, *extra,
                         "--json", str(json_path), "--html", str(html_path))
    row, result, done = run_json_command(cmd, json_path)
    if result is None:
        json_path.with_suffix(".err").write_text(done.stdout + done.stderr)
        return {**row, "error": [failure(done.stderr or done.stdout)]}
    return {**row, **summary(result["engine"])}


def logits_row(model: str, batch_invariant: bool, count: int = 8, tokens: int = 32) -> dict[str, Any]:
    """Greedy raw logits of `count` requests, each alone and all in one call, in one compiled
    vLLM engine: how many requests differ, and the largest difference of a sampled token's logit
    (positions up to the first token the two runs disagree on)."""
    os.environ["VLLM_BATCH_INVARIANT"] = "1" if batch_invariant else "0"
    import vllm
    from vllm.inputs import TokensPrompt

    llm = vllm.LLM(model=str(resolve_model(model)), dtype="bfloat16", skip_tokenizer_init=True, seed=0,
                   logprobs_mode="raw_logits", enable_prefix_caching=False,
                   gpu_memory_utilization=PROBE_MEMORY, worker_extension_cls=DIGEST_EXTENSION)
    params = vllm.SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=0, ignore_eos=True,
                                 detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=[1, *range(100 + 7 * i, 132 + 11 * i)]) for i in range(count)]

    def sampled(outputs: list[Any]) -> list[tuple[list[int], list[float]]]:
        return [(list(o.outputs[0].token_ids),
                 [next(iter(step.values())).logprob for step in o.outputs[0].logprobs]) for o in outputs]

    alone = [sampled(llm.generate([p], params, use_tqdm=False))[0] for p in prompts]
    batch = sampled(llm.generate(prompts, params, use_tqdm=False))
    differing, worst, parted = 0, 0.0, 0
    for (tok_a, log_a), (tok_b, log_b) in zip(alone, batch, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(tok_a, tok_b, strict=True)) if x != y), len(tok_a))
        parted += same < len(tok_a)
        gaps = [abs(x - y) for x, y in zip(log_a[:same + 1], log_b[:same + 1], strict=False)]
        differing += any(g > 0 for g in gaps)
        worst = max(worst, *gaps)
    config = llm.llm_engine.vllm_config
    return {"requests": count, "tokens": tokens, "differing": differing, "max_abs_logit_diff": worst,
            "parted": parted, "batch_invariant": batch_invariant,
            "attention_backend": sorted({n for names in llm.collective_rpc("parity_attention_backends")
                                         for n in names}),
            "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
            "enforce_eager": bool(config.model_config.enforce_eager)}


def probe_section(args: argparse.Namespace, ledger: Ledger, shaped: Any) -> list[dict[str, Any]]:
    """Every PROBE_ROWS and LOGITS_ROWS row not kept yet, each in a child process; each
    `parity attribute` row's JSON and HTML are kept beside the ledger and copied to `args.out`."""
    chosen = [k for k in [*PROBE_ROWS, *LOGITS_ROWS] if "all" in args.probe_rows or k in args.probe_rows]
    for key, (label, extra) in PROBE_ROWS.items():
        if key not in chosen or "error" not in ledger.rows("probe").get(key, {"error": 1}):
            continue
        args.clock.check(f"probe row {key}")
        model = _model(label, args.state, shaped, args.moe_layers)
        stem = "probe-" + re.sub("[^A-Za-z0-9]+", "-", key).strip("-")
        row = {"row": key, **_attribute_row(model, extra, ledger.root / f"{stem}.json",
                                            ledger.root / f"{stem}.html")}
        ledger.keep("probe", key, row)
        print(json.dumps(row)[:600], flush=True)
    for key, (label, on) in LOGITS_ROWS.items():
        if key not in chosen or "error" not in ledger.rows("probe").get(key, {"error": 1}):
            continue
        args.clock.check(f"probe row {key}")
        model = _model(label, args.state, shaped, args.moe_layers)
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_probe", model, "1" if on else "0"],
                              capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        row = {"row": key, "seconds": round(time.perf_counter() - start, 1),
               **(json.loads(lines[-1]) if done.returncode == 0 and lines else
                  {"error": [failure(done.stderr or done.stdout)]})}
        ledger.keep("probe", key, row)
        print(json.dumps(row)[:600], flush=True)
    return list(ledger.rows("probe").values())


def probe_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """Table lines of the probe section: per row and phase, the first differing stage and growth."""
    lines = ["| probe row | phase | first differing stage | growth over depth | last layer rel error "
             "| logits rel error | s |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | error: {' '.join(r['error'])[:200]} | | | | | |")
        elif "phases" in r:
            for phase, p in r["phases"].items():
                layers = [v for k, v in p["stages"].items() if re.fullmatch(r"layer\.\d+", k)]
                last = f"{layers[-1][0]:.2e}" if layers else ""
                logits = p["stages"].get("logits", [None])[0]
                growth = "" if p["growth"] is None else f"x{p['growth']:.1f}"
                lines.append(f"| {r['row']} | {phase} | {p['first_differing'] or 'none'} | {growth} | {last} "
                             f"| {'' if logits is None else f'{logits:.2e}'} | {r['seconds']:.0f} |")
        else:
            lines.append(f"| {r['row']} | decode | {r['differing']}/{r['requests']} requests differ, "
                         f"max {r['max_abs_logit_diff']:.3g} (raw logit; {'+'.join(r['attention_backend'])}) "
                         f"| | | | {r['seconds']:.0f} |")
    return lines


if __name__ == "__main__":
    print(json.dumps(logits_row(sys.argv[1], sys.argv[2] == "1")), flush=True)
