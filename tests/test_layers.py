"""The one-way layers: the import-linter contracts hold, and the light paths stay light.

Parsing a case and rendering a stored report (a `ParityReport` JSON, a nightly history) must
never load torch: each path runs in a fresh interpreter, which then lists the heavy modules it
holds. The static side (no light module reaches torch through any import, however deep) is
the "light modules" contract in pyproject.toml, checked here by running `lint-imports`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from test_nightly_runner import install, write_cases
from test_report import make_report

from parity.models import resolve_model
from parity.nightly import main as nightly_main
from parity.nightly import runner

ROOT = Path(__file__).resolve().parent.parent
#: modules a light path must not load: the engines and what loads them.
HEAVY = ("torch", "transformers", "vllm", "sglang", "tensorrt_llm", "triton")
#: case files whose prompts are token ids or generated; text and chat prompts load the model's
#: own tokenizer through transformers, which imports torch (the one documented exception).
TOKEN_CASES = sorted(p.name for p in (ROOT / "cases").glob("*.toml")
                     if not {"text", "messages"} & set(tomllib.loads(p.read_text())["prompts"]))


@pytest.fixture(scope="module", autouse=True)
def _checkpoints_cached():
    """Generating a built-in checkpoint loads torch (once, on first use): do it here, not in the probes."""
    for path in (ROOT / "cases").glob("*.toml"):
        resolve_model(tomllib.loads(path.read_text())["model"])


def heavy_modules_after(code: str) -> list[str]:
    """Run `code` in a fresh interpreter; the HEAVY modules it left in sys.modules."""
    probe = f"{code}\nimport sys\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                            cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1].replace("'", '"'))


def test_import_parity_is_light():
    assert heavy_modules_after("import parity") == []


def test_token_and_generated_cases_parse_without_torch():
    assert len(TOKEN_CASES) >= 5  # every case file but the text and chat ones
    assert heavy_modules_after(textwrap.dedent(f"""
        import parity.workload.cases
        for name in {TOKEN_CASES!r}:
            parity.workload.cases.load_case("cases/" + name)
    """)) == []


def test_a_token_id_dataset_case_and_a_rollout_dump_load_without_torch(tmp_path):
    (tmp_path / "ids.jsonl").write_text('{"prompt": [5, 6, 7]}\n{"prompt": [8, 9]}\n')
    (tmp_path / "case.toml").write_text('model = "tiny-llama"\n[prompts.dataset]\npath = "ids.jsonl"\n')
    assert heavy_modules_after(textwrap.dedent(f"""
        import json, pathlib, parity.workload.cases, parity.rollouts.dumps
        parity.workload.cases.load_case({str(tmp_path / "case.toml")!r})
        dump = pathlib.Path({str(tmp_path / "dump.jsonl")!r})
        dump.write_text(json.dumps({{"prompt_ids": [1], "response_ids": [2], "rollout_logprobs": [-1.0],
                                    "temperature": 0.7}}) + "\\n")
        parity.rollouts.dumps.read_dump(dump)
    """)) == []


@pytest.mark.slow
def test_the_probe_sees_torch_when_a_path_loads_it():
    """Negative control: a text-prompt case tokenizes through transformers, and the probe says so."""
    assert "torch" in heavy_modules_after(
        "import parity.workload.cases; parity.workload.cases.load_case('cases/smoke.toml')")


@pytest.mark.slow
def test_a_stored_report_renders_without_torch(tmp_path):
    report = make_report()
    report.extras["attribution"] = {"axes": [{
        "axis": "batch", "description": "A alone; B batched",
        "layers": {"setting_a": {"label": "a"}, "setting_b": {"label": "b"}, "first_differing": "layer.0",
                   "stages": [{"stage": s, "max_abs": 0.1 * i, "rel_error": 1e-3 * i, "differing": i,
                               "elements": 8} for i, s in enumerate(("embed", "layer.0", "logits"))]}}]}
    path = tmp_path / "report.json"
    path.write_text(report.to_json())
    assert heavy_modules_after(textwrap.dedent(f"""
        from parity.render import report_html
        from parity.report.document import ParityReport
        report = ParityReport.from_json(open({str(path)!r}).read())
        page = report_html(report)
        assert page.startswith("<!DOCTYPE html>") and "Drift attribution" in page
        assert page.count("data:image/svg") == 4 and report.summary_text()
    """)) == []


@pytest.mark.slow
def test_a_stored_loop_record_renders_without_torch(tmp_path):
    """`parity loop --json` output read back and drawn (parity.loop.record, parity.render.loop)."""
    row = {"step": 0, "backend": "reference", "max_abs_logprob_diff": 0.0, "mean_abs_logprob_diff": 0.0,
           "k3_kl": 0.0, "is_ratio_mean": 1.0, "reward_mean": 0.1, "policy_kl_from_start": 0.0,
           "weights_in_sync": True, "seconds": 0.5, "bitwise": True, "trained_on": True}
    document = {"model": "tiny-llama", "backends": ["reference"], "seed": 0, "train_on": "reference",
                "steps": [row, {**row, "step": 1, "policy_kl_from_start": 0.2}], "status": "complete"}
    path = tmp_path / "loop.json"
    path.write_text(json.dumps(document))
    assert heavy_modules_after(textwrap.dedent(f"""
        from parity.loop.record import LoopRecord
        from parity.render.loop import loop_page
        page = loop_page(LoopRecord.read({str(path)!r}).to_dict())
        assert page.startswith("<!DOCTYPE html>") and page.count("data:image/svg") == 4
    """)) == []


def test_a_stored_audit_renders_without_torch(tmp_path):
    """`parity audit --json` output read back and drawn: the result and its page need no engine."""
    check = {"identical": False, "requests": 4, "differing_requests": 1,
             "first_difference": {"what": "tokens"}, "max_abs_logprob_diff": 0.5,
             "mean_abs_logprob_diff": 0.01, "skipped": None}
    skipped = {**check, "identical": False, "requests": 0, "differing_requests": 0, "first_difference": None,
               "max_abs_logprob_diff": 0.0, "mean_abs_logprob_diff": 0.0, "skipped": "no prefix cache"}
    checks = {name: check for name in ("repeat", "batch", "order", "prefill_decode", "seed")}
    stored = {"backend": "vllm-server", "model": "tiny-llama", "dtype": "bfloat16",
              "provenance": {"backend_meta": {"server_settings": {"dtype": "bfloat16",
                                                                  "source": "server_info"}}},
              "checks": {**checks, "prefix_cache": skipped}, "deterministic": False, "batch_invariant": False}
    path = tmp_path / "audit.json"
    path.write_text(json.dumps(stored))
    assert heavy_modules_after(textwrap.dedent(f"""
        from parity.audit.result import AuditResult
        from parity.render.audit import audit_html
        result = AuditResult.from_json(open({str(path)!r}).read())
        page = audit_html(result.to_dict())
        assert "deterministic: no" in page and "Server settings" in page and "no prefix cache" in page
        assert result.summary_text()
    """)) == []


@pytest.mark.slow
def test_a_stored_nightly_history_renders_without_torch(tmp_path, monkeypatch):
    install(runner, patch=monkeypatch.setattr)
    cases = write_cases(tmp_path)
    out = tmp_path / "reports"
    assert nightly_main(["--cases", f"{cases}/alpha.toml", "--backends", "reference,hf,vllm",
                         "--out", str(out), "--run-id", "n1", "--no-progress"]) == 0
    assert heavy_modules_after(textwrap.dedent(f"""
        from parity.nightly.history import History
        from parity.nightly.html_report import render_page
        from parity.nightly.markdown_report import render_summary
        with History({str(out / "history.sqlite")!r}) as history:
            run = history.require_run("n1", option="--run-id")
            rows = history.rows("n1", with_report=True)
            trend = history.trend([r.key for r in rows], up_to_run="n1")
        page, summary = render_page(run, rows, trend), render_summary(run, rows)
        assert page.count('class="row"') == 3 and "Trends" in page and "plots unavailable" not in page
        assert summary.startswith("## parity nightly `n1`: 3 pass")
    """)) == []


@pytest.mark.parametrize("module", ["parity.cli", "parity.pytest_plugin", "parity.backends",
                                    "parity.nightly"])
@pytest.mark.slow
def test_entry_points_import_without_torch(module):
    """The command line, the pytest plugin (imported by every pytest run) and the backend registry
    load the engines only when a command or a parity test runs one."""
    assert heavy_modules_after(f"import {module}") == []


def test_import_contracts_hold():
    """`lint-imports` (pyproject.toml [tool.importlinter]): the layers point one way, inside the
    packages too, and no light module reaches an engine."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([str(Path(sys.executable).parent / "lint-imports")], capture_output=True,
                            text=True, timeout=300, cwd=ROOT, env=env, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout
