"""The production engines on a GPU: parity's GPU backend tests, drift tables and side-by-side throughput.

One command on any CUDA host with vLLM installed (`pip install vllm`; on the lent H200s vLLM comes
from carried wheels, `tools/h200_vllm.sh`):

    python3 -m benchmarks.gpu_backends --out OUT       # every section, or --sections a,b
    bash tools/h200_vllm.sh run --out $OUT             # the lent H200: stage, install once, run

It resumes: each section, and each row of a long one, is kept in a ledger under `--state`
(default /tmp/parity-gpu-state, `benchmarks.gpu_ledger`) as it finishes, and a later run on the
same machine skips what is there (`--redo` runs the named sections again), so a run cut by a
call's time limit continues in the next call. `--deadline SECONDS` ends a run cleanly inside such a
limit: no row or section starts once it has passed (set it to the call's limit less the longest
row, ~90 s for an engine start). Every run writes the results of every section done so far:
OUT/gpu_backends.json and OUT/gpu_backends.md (the table, also printed last).

Sections, in this order:
- `install`: versions, and whether vLLM's FP8 (humming) and server imports are there.
- `tests`: the GPU-marked backend tests (`pytest -m gpu`, tests/test_vllm_gpu.py and the GPU tests
  of the files given with `--tests`), their outcome per test.
- `audit`: `parity audit --backend vllm` on tiny-qwen3 and the Qwen3-1.7B shape (28 layers) with
  vLLM's batch-invariant mode off and on, then one knob at a time on the latter (enforce_eager,
  cudagraph mode, each attention backend): `benchmarks.gpu_checks.AUDIT_ROWS`, `--audit-rows`.
- `probe`: inside vLLM (`benchmarks.gpu_probe`): `parity attribute --backend vllm` on the Qwen3-1.7B
  shape (batch-invariant mode, one request per call against eight; against the training forward),
  the MoE shape without and with R3 (`--replay-routes`), tiny-qwen3 (mode off against on), and the
  compiled engine's raw logits alone against in a batch.
- `server`: `vllm-server` on the GPU bitwise equal to the offline engine (its test).
- `fp8`: FP8 rollouts against the bf16 trainer and the memory-refusal test (their tests).
- `drift`: vLLM against parity's training forward on the same GPU, one row per setting: bf16 and
  fp16, vLLM's batch-invariant mode off and on, R3 off and on (MoE), FP8 rollouts (`quantization=
  "fp8"`, `kv_cache_dtype="fp8"`) scored against the bf16 trainer; models: the Qwen3-1.7B shape (28
  layers, random weights), the Qwen3-30B-A3B shape (`--moe-layers`) and the trained SmolLM2-135M when
  its package is installed (`--models`, `--settings` pick rows). Each row is one `parity.compare`
  with a fresh engine, in a process of its own; a row kept with an error runs again next time.
- `throughput`: output tok/s of parity's invariant engine and vLLM (batch-invariant off and on) on
  one workload (`--workload requests,prompt,output`, default 256,256,512) and the dense Qwen3-1.7B
  shape, each side in its own process (one GPU's memory each), in the order given by `--order` and
  then in the opposite order (the host's drift shows), with the ratios. Each process times
  `--repeats` runs of the workload after its warm-up (the figure is their median, the spread is
  (max - min) / median) and reports its setup (engine start, compile, capture, warm-up) apart.
- `loop`: the RL loop with the reference engine and vLLM (`benchmarks.loop`, `--loop-steps`,
  `--loop-model`, `--loop-option vllm.weight_transfer=ipc` for vLLM's in-memory push), its JSON and
  page in OUT.

"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.gpu_checks import (
    TEST_ROWS,
    audit_section,
    failure,
    install_section,
    loop_section,
    pytest_row,
    test_row_section,
    throughput_requests,
)
from benchmarks.gpu_ledger import DEFAULT_STATE, Deadline, DeadlineReached, Ledger, pending, to_run
from benchmarks.gpu_probe import probe_markdown, probe_section

SECTIONS = ("install", "tests", "audit", "probe", "server", "fp8", "drift", "throughput", "loop")
THROUGHPUT_SIDES = ("parity", "vllm", "vllm-bi")
#: engine settings of the drift rows: a memory share that leaves the GPU to the training forward.
DRIFT_ENGINE = {"gpu_memory_utilization": 0.5}


@dataclass(frozen=True)
class DriftRow:
    """One `parity.compare` of vLLM against the training forward; nats over `tokens` tokens."""

    model: str
    setting: str
    max_abs_logprob_diff: float
    mean_abs_logprob_diff: float
    k3_kl: float
    tokens: int
    router_agreement: float | None
    seconds: float


def _shaped(out: Path, shape: str, layers: int) -> str:
    from parity.models.shaped import save_random_model, shaped_config

    path = out / f"{shape}-{layers}"
    if not (path / "config.json").exists():
        save_random_model(shaped_config(shape, layers), path)
    return str(path)


def _drift_settings(moe: bool) -> list[tuple[str, dict[str, Any], str | None, str]]:
    """(setting, vllm options, router replay, trainer dtype) of each drift row."""
    rows = [("bf16", {}, None, "bfloat16"),
            ("bf16 batch-invariant", {"batch_invariant": True}, None, "bfloat16"),
            ("fp16", {}, None, "float16"),
            ("fp8 (weights and KV) vs bf16 trainer",
             {"engine_kwargs": {"quantization": "fp8", "kv_cache_dtype": "fp8"}}, None, "bfloat16")]
    if moe:
        rows.insert(1, ("bf16 R3", {"capture_routes": True}, "R3", "bfloat16"))
    return rows


@dataclass(frozen=True)
class DriftPlan:
    """One drift row to run: `key` is "model label | setting"."""

    key: str
    label: str
    path: str
    setting: str
    options: dict[str, Any]
    replay: str | None
    dtype: str


def drift_plan(args: argparse.Namespace) -> list[DriftPlan]:
    """The drift rows `--models` and `--settings` select, in order (shaped checkpoints made here)."""
    models = [("qwen3-1.7b x28", _shaped(args.state, "qwen3-1.7b", 28), False),
              (f"qwen3-30b-a3b x{args.moe_layers}", _shaped(args.state, "qwen3-30b-a3b", args.moe_layers),
               True)]
    try:
        from parity.models.trained import packaged_file

        packaged_file("smollm2-135m-instruct")
        models.append(("smollm2-135m-instruct", "smollm2-135m-instruct", False))
    except Exception as e:  # the package is optional here: said in the output
        print(f"smollm2-135m-instruct not run: {e}", flush=True)
    return [DriftPlan(f"{label} | {setting}", label, path, setting, options, replay, dtype)
            for label, path, moe in models if label in args.models or "all" in args.models
            for setting, options, replay, dtype in _drift_settings(moe)
            if setting in args.settings or "all" in args.settings]


def drift_row(args: argparse.Namespace, plan: DriftPlan) -> dict[str, Any]:
    """One `parity.compare` of a fresh vLLM engine against the training forward, in this process."""
    import parity
    from parity.backends import get_backend
    from parity.core.types import SamplingParams
    from parity.workload.cases import load_case

    sampling = SamplingParams(n=4, temperature=1.0, top_p=0.95, max_tokens=args.tokens, seed=1)
    prompts = [[1, *range(100 + 7 * i, 100 + 7 * i + 32 + 4 * i)] for i in range(args.prompts)]
    options = dict(plan.options)
    engine_kwargs = {**DRIFT_ENGINE, "gpu_memory_utilization": args.memory_share,
                     **({"enforce_eager": True} if args.eager else {}), **options.pop("engine_kwargs", {})}
    kwargs: dict[str, Any] = {"case": load_case("cases/trained-chat.toml")} \
        if plan.path == "smollm2-135m-instruct" else {"prompts": prompts, "sampling": sampling}
    start = time.perf_counter()
    with get_backend("vllm", plan.path, dtype=plan.dtype, engine_kwargs=engine_kwargs, **options) as engine:
        report = parity.compare(plan.path if "prompts" in kwargs else None, engine, dtype=plan.dtype,
                                device="cuda", router_replay=plan.replay, **kwargs)
    s = report.summary
    return asdict(DriftRow(plan.label, plan.setting, s["max_abs_logprob_diff"], s["mean_abs_logprob_diff"],
                           s["k3_kl"], int(s["num_tokens"]), s.get("router_agreement"),
                           time.perf_counter() - start))


def _child_row(cmd: list[str], fallback: dict[str, Any]) -> dict[str, Any]:
    """The last JSON line a child `benchmarks.gpu_backends` printed, else `fallback` with its
    `failure` line."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_backends", *cmd], capture_output=True,
                          text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    output = done.stderr.strip() or done.stdout.strip() or f"exit code {done.returncode}"
    return {**fallback, "error": failure(output)[:600]}


def _kept(ledger: Ledger, section: str, key: str) -> bool:
    """Whether `key` is kept without an error (a row that failed, e.g. for memory, runs again)."""
    row = ledger.rows(section).get(key)
    return row is not None and "error" not in row


def drift_section(args: argparse.Namespace, ledger: Ledger) -> list[dict[str, Any]]:
    """Each planned row in its own process, so every row starts on an empty GPU: rows in one process
    left 91 of 140 GiB held after the first (H200, 2026-12-03) and every later engine was refused."""
    shared = ["--state", str(args.state), "--moe-layers", str(args.moe_layers),
              "--prompts", str(args.prompts), "--tokens", str(args.tokens),
              "--memory-share", str(args.memory_share),
              *(["--eager"] if args.eager else [])]
    for plan in drift_plan(args):
        if _kept(ledger, "drift", plan.key):
            continue
        args.clock.check(f"drift row {plan.key}")
        row = _child_row([*shared, "--drift-row", plan.key], {"model": plan.label, "setting": plan.setting})
        ledger.keep("drift", plan.key, row)
        print(json.dumps(row), flush=True)
    return list(ledger.rows("drift").values())


def tests_section(args: argparse.Namespace, ledger: Ledger) -> dict[str, Any]:
    """The GPU-marked tests of tests/test_vllm_gpu.py (less the server and FP8 rows' own) and of
    `--tests`, per file."""
    files = {"tests/test_vllm_gpu.py": "not (" + " or ".join(TEST_ROWS.values()) + ")",
             **dict.fromkeys(args.tests)}
    for name, selection in files.items():
        if name not in ledger.rows("tests"):
            args.clock.check(f"tests of {name}")
            row = pytest_row([name], selection, ledger.root / f"{Path(name).stem}.xml")
            ledger.keep("tests", name, {"file": name, **row})
    return list(ledger.rows("tests").values())


def measure(side: str, model: str, workload: tuple[int, int, int], repeats: int) -> dict[str, Any]:
    """Output tok/s of one side on `workload`, `repeats` timed runs after the warm-up, in this
    process (called in a child of the section); `setup_s` is the engine's start and warm-up."""
    import statistics

    import torch

    count, prompt_len, max_tokens = workload
    requests = throughput_requests(workload)
    runs: list[tuple[int, float]] = []  # (output tokens, seconds) of each timed run
    began = time.perf_counter()
    if side == "parity":
        from parity.engine import ReferenceEngine

        with ReferenceEngine(model, dtype="bfloat16", device="cuda", max_num_seqs=count,
                             chunk_size=prompt_len, max_num_batched_tokens=8192) as engine:
            engine.warm_up(prompt_len + max_tokens)  # every shape compiled and captured: not timed
            engine.generate(requests[:4])
            torch.cuda.synchronize()
            setup = time.perf_counter() - began
            for _ in range(repeats):
                start = time.perf_counter()
                produced = sum(len(r.token_ids) for r in engine.generate(requests))
                runs.append((produced, time.perf_counter() - start))
        peak = torch.cuda.max_memory_allocated() / 2**30
    else:
        os.environ["VLLM_BATCH_INVARIANT"] = "1" if side == "vllm-bi" else "0"
        import vllm
        from vllm.inputs import TokensPrompt

        # no prefix cache: each timed run prefills its prompts again, as the first one did
        llm = vllm.LLM(model=model, dtype="bfloat16", skip_tokenizer_init=True, max_num_seqs=count,
                       gpu_memory_utilization=0.85, seed=0, enable_prefix_caching=False)
        params = [vllm.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=r.sampling.seed,
                                      logprobs=0,
                                      ignore_eos=True, detokenize=False) for r in requests]
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        llm.generate(prompts[:4], params[:4], use_tqdm=False)
        setup = time.perf_counter() - began
        for _ in range(repeats):
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            runs.append((sum(len(o.outputs[0].token_ids) for o in outputs), time.perf_counter() - start))
        peak = float("nan")  # vLLM's memory is its pre-allocated share, not a peak of this process
    rates = [tokens / seconds for tokens, seconds in runs]
    median = statistics.median(rates)
    return {"side": side, "output_tokens": runs[-1][0], "seconds": statistics.median(s for _, s in runs),
            "output_tok_s": median, "runs_tok_s": [round(r) for r in rates],
            "spread": (max(rates) - min(rates)) / median, "setup_s": round(setup, 1), "peak_gib": peak}


def throughput_section(args: argparse.Namespace, ledger: Ledger) -> list[dict[str, Any]]:
    """Each side in `--order`, then in the reverse order; one process per measurement."""
    model = _shaped(args.state, "qwen3-1.7b", 28)
    runs = [(f"order 1: {side}", side) for side in args.order] + \
        [(f"order 2: {side}", side) for side in reversed(args.order)]
    for key, side in runs:
        if _kept(ledger, "throughput", key):
            continue
        args.clock.check(f"throughput {key}")
        row = _child_row(["--measure", side, "--model", model, "--workload",
                          ",".join(map(str, args.workload)), "--repeats", str(args.repeats)], {"side": side})
        ledger.keep("throughput", key, {"run": key, **row})
        print(json.dumps(row), flush=True)
    return list(ledger.rows("throughput").values())


def _check_cell(check: dict[str, Any]) -> str:
    if check.get("skipped"):
        return "skipped"
    if not check["differing"]:
        return "identical"
    return f"{check['differing']}/{check['requests']}, {check['max_abs_logprob_diff']:.2g}"


def _test_lines(name: str, row: dict[str, Any]) -> list[str]:
    outcomes = ", ".join(f"{test} {outcome}" for test, outcome in row.get("outcomes", {}).items())
    return [f"| {name} | {row.get('summary', '')} | {row.get('seconds', 0):.0f} | {outcomes} |"]


def markdown(results: dict[str, Any]) -> str:
    """The table of every section in `results` (section -> its result or rows so far)."""
    lines: list[str] = []
    if "install" in results:
        lines += ["install: " + ", ".join(f"{k} {v}" for k, v in results["install"].items()), ""]
    tests = {**{row["file"]: row for row in results.get("tests") or []},
             **{name: results[name] for name in TEST_ROWS if name in results}}
    if tests:
        lines += ["| tests | summary | s | outcomes |", "| --- | --- | --- | --- |"]
        for name, row in tests.items():
            lines += _test_lines(name, row)
        lines.append("")
    if "audit" in results:
        checks = ("repeat", "batch", "order", "prefill_decode", "prefix_cache")
        lines += ["| audit row | deterministic | batch-invariant | attention | cudagraph | "
                  + " | ".join(checks) + " |", "| --- " * (5 + len(checks)) + "|"]
        for r in results["audit"]:
            if "checks" not in r:
                error = " ".join(r.get("error", []))[:160]
                lines.append(f"| {r['row']} | error: {error} |" + " |" * (3 + len(checks)))
                continue
            cells = [_check_cell(r["checks"][c]) if c in r["checks"] else "" for c in checks]
            lines.append(f"| {r['row']} | {r['deterministic']} | {r['batch_invariant']} | "
                         f"{r['attention_backend']} | {r['cudagraph_mode']} | " + " | ".join(cells) + " |")
        lines.append("")
    if "probe" in results:
        lines += [*probe_markdown(results["probe"]), ""]
    if "drift" in results:
        lines += ["| model | setting | max abs dlogp | mean abs dlogp | k3 KL | tokens | router agreement "
                  "| s |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in results["drift"]:
            if "error" in r:
                lines.append(f"| {r['model']} | {r['setting']} | error: {r['error'][:120]} | | | | | |")
                continue
            agree = "" if r["router_agreement"] is None else f"{r['router_agreement']:.4f}"
            lines.append(f"| {r['model']} | {r['setting']} | {r['max_abs_logprob_diff']:.4f} | "
                         f"{r['mean_abs_logprob_diff']:.5f} | {r['k3_kl']:.2e} | {r['tokens']} | {agree} | "
                         f"{r['seconds']:.0f} |")
        lines.append("")
    if "throughput" in results:
        lines += ["| run | output tok/s (median) | runs tok/s | spread | setup s "
                  "| parity / this (same order) |",
                  "| --- | --- | --- | --- | --- | --- |"]
        parity = {r["run"].split(":")[0]: r["output_tok_s"] for r in results["throughput"]
                  if r["side"] == "parity" and "error" not in r}
        for r in results["throughput"]:
            if "error" in r:
                lines.append(f"| {r['run']} | error | | | | |")
                continue
            order = r["run"].split(":")[0]
            ratio = f"{parity[order] / r['output_tok_s']:.2f}" if order in parity else ""
            runs = ", ".join(f"{x:,}" for x in r.get("runs_tok_s", []))
            spread = f"{r['spread']:.1%}" if "spread" in r else ""
            lines.append(f"| {r['run']} | {r['output_tok_s']:,.0f} | {runs} | {spread} | "
                         f"{r.get('setup_s', '')} | {ratio} |")
        lines.append("")
    if "loop" in results:
        r = results["loop"]
        lines += [f"loop: exit {r['exit_code']} in {r['seconds']:.0f} s: {r['command']}"]
    return "\n".join(lines)


def _ints(text: str) -> tuple[int, int, int]:
    count, prompt, output = (int(x) for x in text.split(","))
    return count, prompt, output


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.gpu_backends",
                                description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("gpu-backends"))
    p.add_argument("--sections", type=lambda t: [s for s in t.split(",") if s], default=list(SECTIONS))
    p.add_argument("--tests", type=lambda t: [s for s in t.split(",") if s], default=[],
                   help="more test files whose GPU tests run in the tests section")
    p.add_argument("--models", type=lambda t: t.split(","), default=["all"],
                   help="drift: model labels to run (default all)")
    p.add_argument("--settings", type=lambda t: t.split(","), default=["all"],
                   help="drift: settings to run, e.g. 'bf16,bf16 R3' (default all)")
    p.add_argument("--moe-layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--eager", action="store_true", help="drift: vLLM engines without compile and graphs")
    p.add_argument("--memory-share", type=float, default=DRIFT_ENGINE["gpu_memory_utilization"],
                   help="drift: each vLLM engine's gpu_memory_utilization (lower it when other work shares "
                        "the GPU)")
    p.add_argument("--workload", type=_ints, default=(256, 256, 512))
    p.add_argument("--order", type=lambda t: t.split(","), default=list(THROUGHPUT_SIDES))
    p.add_argument("--repeats", type=int, default=3, help="throughput: timed runs per process (default 3)")
    p.add_argument("--deadline", type=float,
                   help="seconds after which no further row or section starts (resume in the next run)")
    p.add_argument("--state", type=Path, default=DEFAULT_STATE,
                   help="where finished sections and rows are kept (a later run skips them)")
    p.add_argument("--redo", action="store_true", help="forget the named sections' state and run them again")
    p.add_argument("--audit-rows", type=lambda t: t.split(";"), default=["all"],
                   help="audit: ';'-separated row keys of benchmarks.gpu_checks.AUDIT_ROWS (default all)")
    p.add_argument("--probe-rows", type=lambda t: t.split(";"), default=["all"],
                   help="probe: ';'-separated row keys of benchmarks.gpu_probe (default all)")
    p.add_argument("--loop-steps", type=int, default=200)
    p.add_argument("--loop-model", type=lambda t: t.split(),
                   default=["--shape", "qwen3-1024", "--layers", "12"],
                   help="loop: the model flags of benchmarks.loop (default: the qwen3-1024 shape, 12 layers: "
                        "190 steps took 530 s on an H200, so 200 steps fill one 10-minute call)")
    p.add_argument("--loop-option", action="append", default=[], metavar="BACKEND.KEY=VALUE",
                   help="loop: a backend option of benchmarks.loop, e.g. vllm.weight_transfer=ipc (vLLM's "
                        "in-memory push by CUDA IPC instead of the per-step reload; needs Ray importable)")
    p.add_argument("--measure", choices=THROUGHPUT_SIDES, help=argparse.SUPPRESS)
    p.add_argument("--drift-row", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = [s for s in args.sections if s not in SECTIONS] + \
        [s for s in args.order if s not in THROUGHPUT_SIDES]
    if unknown:
        p.error(f"unknown sections or sides {unknown}; sections: {SECTIONS}, sides: {THROUGHPUT_SIDES}")
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    args.clock = Deadline(args.deadline, time.monotonic())
    return args


def run_sections(args: argparse.Namespace, ledger: Ledger, runners: dict[str, Callable[[], Any]],
                 header: dict[str, Any]) -> dict[str, Any]:
    """Run each section of `args.sections` still to run (`gpu_ledger.to_run`), marking it done when it
    returns; write OUT/gpu_backends.json and .md with every section done or partial so far after
    each. A section that raises stays pending (its kept rows stay) and the next one runs."""
    def write() -> dict[str, Any]:
        results = {**header, "sections": {s: ledger.result(s) for s in args.sections
                                          if ledger.result(s) is not None},
                   "pending": pending(args.sections, ledger)}
        (args.out / "gpu_backends.json").write_text(json.dumps(results, indent=1, default=str))
        (args.out / "gpu_backends.md").write_text(markdown(results["sections"]) + "\n")
        return results

    args.out.mkdir(parents=True, exist_ok=True)
    clock = getattr(args, "clock", Deadline(None, 0.0))
    for section in to_run(args.sections, ledger):
        start = time.perf_counter()
        try:
            clock.check(f"section {section}")
            ledger.finish(section, runners[section]())
            print(f"[{section}] done in {time.perf_counter() - start:.0f} s", flush=True)
        except DeadlineReached as e:
            print(f"[{section}] {e}: stays pending", flush=True)
        except Exception as e:  # the next section still runs; this one resumes in the next call
            print(f"[{section}] failed after {time.perf_counter() - start:.0f} s: {type(e).__name__}: {e}",
                  flush=True)
        write()
    return write()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, args.model, args.workload, args.repeats)), flush=True)
        return
    if args.drift_row:
        plan = {row.key: row for row in drift_plan(args)}
        if args.drift_row not in plan:
            raise SystemExit(f"no drift row {args.drift_row!r}; rows: {sorted(plan)}")
        print(json.dumps(drift_row(args, plan[args.drift_row])), flush=True)
        return
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_backends needs an NVIDIA GPU (CUDA not available)")
    try:
        import vllm
    except ImportError:
        raise SystemExit("benchmarks.gpu_backends needs vLLM's GPU build: pip install vllm "
                         "(on the lent H200s: bash tools/h200_vllm.sh run)") from None
    ledger = Ledger(args.state)
    if args.redo:
        ledger.forget(args.sections)
    header = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "vllm": vllm.__version__,
              "argv": sys.argv[1:]}
    runners: dict[str, Callable[[], Any]] = {
        "install": lambda: install_section(args),
        "tests": lambda: tests_section(args, ledger),
        "audit": lambda: audit_section(args, ledger, _shaped),
        "probe": lambda: probe_section(args, ledger, _shaped),
        "server": lambda: test_row_section("server", ledger),
        "fp8": lambda: test_row_section("fp8", ledger),
        "drift": lambda: drift_section(args, ledger),
        "throughput": lambda: throughput_section(args, ledger),
        "loop": lambda: loop_section(args, ledger),
    }
    results = run_sections(args, ledger, runners, header)
    print(markdown(results["sections"]))
    if results["pending"]:
        print(f"pending (run the same command again to resume): {', '.join(results['pending'])}")


if __name__ == "__main__":
    main()
