"""The sections of `benchmarks.gpu_backends` that run parity's own commands and tests as child
processes: the install check, `parity audit` of vLLM (batch-invariant mode off and on, one knob
at a time), the bitwise server row, the FP8 row and the RL loop. Each row is kept in the ledger as
it finishes (`benchmarks.gpu_ledger`), so a run cut by the call limit resumes at the next row.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

from benchmarks.gpu_ledger import Ledger


def _on(**engine: Any) -> list[str]:
    """Options of a batch-invariant row with `engine` as vLLM engine arguments."""
    return ["batch_invariant=true", *([f"engine_kwargs={json.dumps(engine)}"] if engine else [])]


#: the audit rows: key -> (model label, --option values). "q28" is the Qwen3-1.7B shape (28
#: layers, random bf16 weights); each knob row changes one setting of "q28 on".
AUDIT_ROWS: dict[str, tuple[str, list[str]]] = {
    "tiny-qwen3 off": ("tiny-qwen3", []),
    "tiny-qwen3 on": ("tiny-qwen3", _on()),
    "tiny-qwen3 on, attention TRITON_ATTN": ("tiny-qwen3", _on(attention_config={"backend": "TRITON_ATTN"})),
    "tiny-qwen3 on, enforce_eager": ("tiny-qwen3", _on(enforce_eager=True)),
    "tiny-qwen3 on, cudagraph NONE": ("tiny-qwen3", _on(compilation_config={"cudagraph_mode": "NONE"})),
    # the same prompts and seeds, logprobs before temperature and top-p (`write_audit_case`)
    "tiny-qwen3 on, raw logprobs": ("tiny-qwen3", [*_on(), "logprobs_mode=raw"]),
    "q28 off": ("q28", []),
    "q28 on": ("q28", _on()),
    "q28 on, raw logprobs": ("q28", [*_on(), "logprobs_mode=raw"]),
    "q28 on, enforce_eager": ("q28", _on(enforce_eager=True)),
    **{f"q28 on, cudagraph {mode}": ("q28", _on(compilation_config={"cudagraph_mode": mode}))
       for mode in ("PIECEWISE", "NONE")},
    **{f"q28 on, attention {name}": ("q28", _on(attention_config={"backend": name}))
       for name in ("TRITON_ATTN", "FLEX_ATTENTION", "FLASHINFER", "FLASH_ATTN")},
}
#: test selections of tests/test_vllm_gpu.py that are rows of their own.
TEST_ROWS = {"server": "server_on_the_gpu", "fp8": "fp8 or without_its_gpu_memory"}
#: the audit's engine takes this share of the GPU (PARITY_GPU_AUDIT_MEMORY for audits side by side).
AUDIT_MEMORY = float(os.environ.get("PARITY_GPU_AUDIT_MEMORY", "0.5"))


def throughput_requests(workload: tuple[int, int, int]) -> list[Any]:
    """The throughput workload `(count, prompt_len, max_tokens)` as requests: deterministic prompt
    ids, temperature 1, EOS ignored, so every side produces count * max_tokens tokens."""
    from parity.core.types import Request, SamplingParams  # the section's child imports parity

    count, prompt_len, max_tokens = workload
    return [Request(tuple(3 + (i * 7919 + j * 104729) % 150000 for j in range(prompt_len)),
                    SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True),
                    f"r{i}") for i in range(count)]


def parity_command(*args: str) -> list[str]:
    """The `parity` command line run by this interpreter (no installed entry point needed)."""
    return [sys.executable, "-c", "import sys; from parity.cli import main; sys.exit(main())", *args]


def install_section(args: argparse.Namespace) -> dict[str, Any]:
    """Versions and the imports the GPU paths need (vLLM, its FP8 and server dependencies)."""
    import torch

    found: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for module in ("vllm", "triton", "humming", "model_hosting_container_standards", "flashinfer"):
        try:
            imported = __import__(module)
            found[module] = getattr(imported, "__version__", "importable")
        except Exception as e:  # a missing piece is a finding of the install check, not a crash
            found[module] = f"missing: {type(e).__name__}: {e}"[:200]
    return found


def run_json_command(cmd: list[str], json_path: Path) -> tuple[dict[str, Any], Any,
                                                               subprocess.CompletedProcess[str]]:
    """Run a `parity_command` that writes `json_path`: (its row: command, exit code, seconds; the
    JSON it wrote or None; the finished process)."""
    json_path.unlink(missing_ok=True)  # a killed earlier try's file must not stand for this run
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    row: dict[str, Any] = {"command": " ".join(cmd[3:]), "exit_code": done.returncode,
                           "seconds": round(time.perf_counter() - start, 1)}
    return row, json.loads(json_path.read_text()) if json_path.exists() else None, done


def failure(output: str) -> str:
    """A failed child's last line, after the last exception line of any of its processes: vLLM's
    engine core prints the root cause, the parent's last line only says "see root cause above"."""
    lines = output.strip().splitlines() or ["(no output)"]
    causes = [line.strip() for line in lines[:-1] if re.search(r"\w(Error|Exception): ", line)]
    return (f"{causes[-1]} | " if causes else "") + lines[-1]


def write_audit_case(model: str, path: Path) -> Path:
    """The audit's built-in case (`default_case`: its prompts, n, temperature, top-p, tokens, seeds
    1000+i) as a case file with raw logprobs: its processed logprobs under top-p 0.95 are not what
    SGLang can report (temperature-scaled, untruncated), and a vLLM row in raw mode asks whether a
    difference enters before or after the sampler's processing."""
    from parity.workload.cases import default_case

    requests = default_case(model).requests
    first = requests[0].sampling
    prompts = ",\n  ".join(json.dumps(list(r.prompt_ids)) for r in requests)
    path.write_text(
        f'name = "sglang-audit-raw"\nkind = "audit"\nmodel = {json.dumps(model)}\nlogprobs_mode = "raw"\n\n'
        f"[prompts]\ntoken_ids = [\n  {prompts},\n]\n\n"
        f"[sampling]\nn = {first.n}\ntemperature = {first.temperature}\ntop_p = {first.top_p}\n"
        f"max_tokens = {first.max_tokens}\nseed = {first.seed}\n")
    return path


def _audit_row(model: str, options: list[str], json_path: Path) -> dict[str, Any]:
    cmd = parity_command("audit", "--model", model, "--backend", "vllm", "--device", "cuda", "--dtype",
                         "bfloat16", "--json", str(json_path))
    if "logprobs_mode=raw" in options:
        cmd += ["--case", str(write_audit_case(model, json_path.with_suffix(".case.toml")))]
    for option in options:
        if option.startswith("engine_kwargs="):
            extra = json.loads(option.split("=", 1)[1])
            option = "engine_kwargs=" + json.dumps({"gpu_memory_utilization": AUDIT_MEMORY, **extra})
        cmd += ["--option", option]
    if not any(o.startswith("engine_kwargs=") for o in options):
        cmd += ["--option", "engine_kwargs=" + json.dumps({"gpu_memory_utilization": AUDIT_MEMORY})]
    row, audit, done = run_json_command(cmd, json_path)
    if audit is None:
        return {**row, "error": [failure(done.stderr or done.stdout)]}
    meta = audit["provenance"]["backend_meta"]
    return {**row, "deterministic": audit["deterministic"], "batch_invariant": audit["batch_invariant"],
            "attention_backend": meta.get("attention_backend"), "cudagraph_mode": meta.get("cudagraph_mode"),
            "checks": {name: {"differing": c["differing_requests"], "requests": c["requests"],
                              "max_abs_logprob_diff": c["max_abs_logprob_diff"], "skipped": c["skipped"]}
                       for name, c in audit["checks"].items()}}


def audit_section(args: argparse.Namespace, ledger: Ledger, shaped: Any) -> list[dict[str, Any]]:
    """`parity audit --backend vllm` per AUDIT_ROWS key in `args.audit_rows` (all by default)."""
    keys = [k for k in AUDIT_ROWS if "all" in args.audit_rows or k in args.audit_rows]
    for key in keys:
        if key in ledger.rows("audit"):
            continue
        args.clock.check(f"audit row {key}")
        label, options = AUDIT_ROWS[key]
        model = shaped(args.state, "qwen3-1.7b", 28) if label == "q28" else label
        stored = ledger.root / f"audit-{re.sub('[^A-Za-z0-9]+', '-', key)}.json"
        row = {"row": key, **_audit_row(model, options, stored)}
        ledger.keep("audit", key, row)
        print(json.dumps(row)[:400], flush=True)
    return [ledger.rows("audit")[k] for k in keys]


def junit_outcomes(report: Path) -> dict[str, str]:
    """Test name -> passed / failed / skipped / error, from pytest's JUnit XML."""
    outcomes: dict[str, str] = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[case.get("name", "?")] = {"failure": "failed"}.get(kinds[0], kinds[0]) if kinds else "passed"
    return outcomes


def pytest_row(files: list[str], selection: str | None, report: Path) -> dict[str, Any]:
    """Run the GPU-marked tests of `files` (those matching `selection`), their outcomes."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:randomly", "-rA",
           f"--junitxml={report}", *files, *(["-k", selection] if selection else [])]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    return {"command": " ".join(cmd[2:]), "exit_code": done.returncode,
            "seconds": round(time.perf_counter() - start, 1), "summary": lines[-1] if lines else "",
            "outcomes": junit_outcomes(report) if report.exists() else {},
            **({"tail": done.stdout[-3000:] + done.stderr[-1000:]} if done.returncode else {})}


def test_row_section(name: str, ledger: Ledger) -> dict[str, Any]:
    """The TEST_ROWS selection `name` of tests/test_vllm_gpu.py."""
    return pytest_row(["tests/test_vllm_gpu.py"], TEST_ROWS[name], ledger.root / f"{name}-tests.xml")


def loop_section(args: argparse.Namespace, ledger: Ledger) -> dict[str, Any]:
    """`benchmarks.loop` with the reference engine and vLLM on the GPU; its JSON and page in --out."""
    cmd = [sys.executable, "-m", "benchmarks.loop", "--backends", "reference,vllm", "--device", "cuda",
           "--dtype", "bfloat16", "--steps", str(args.loop_steps), "--lr", "1e-5",
           "--json", str(args.out / "loop.json"), "--html", str(args.out / "loop.html"), *args.loop_model,
           *(f"--option={option}" for option in args.loop_option)]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    return {"command": " ".join(cmd[2:]), "exit_code": done.returncode,
            "seconds": round(time.perf_counter() - start, 1), "tail": (done.stdout + done.stderr)[-2000:]}
