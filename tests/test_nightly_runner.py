"""`parity nightly` end to end with a synthetic `compare` (no engines): rows, reports, baselines,
regressions, faults, kill-and-resume, and the page in headless Chromium.

The fake draws per-token drift whose size depends on the backend and on the reference kernels,
seeded by the case, so two runs of one setting give identical arrays (no change) and
`--reference native` gives a larger drift (a regression).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from browser import chromium, console_lines, decoded_images, needs_chromium

from parity.core.errors import BackendError
from parity.core.schema import SUMMARY_KEYS
from parity.drift.tolerance import Tolerance
from parity.nightly import execute, main, runner
from parity.nightly.runner import plan
from parity.report.document import ParityReport

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
SCALE = {"reference": 0.0, "hf": 0.002, "vllm": 0.004}
AVAILABLE = {"reference": None, "hf": None, "vllm": None, "sglang": "sglang is not installed",
             "trtllm": "tensorrt_llm is not installed"}


def fake_engine(name: str, model: str, *, dtype: str, **options: Any) -> SimpleNamespace:
    if name == "sglang":
        raise BackendError("sglang engine died while starting")
    return SimpleNamespace(name=name, model=model, dtype=dtype, options=options)


def fake_compare(model: Any, engine: SimpleNamespace, *, case: Any, dtype: str, tolerance: Any,
                 reference: str, router_replay: str | None, device: str = "cpu",
                 gold: bool | None = None) -> ParityReport:
    if case.name == "crashy" and engine.name == "vllm":
        raise RuntimeError("vllm worker crashed mid-case")
    assert (router_replay == "R3") == (engine.options == {"record_routes": True})
    scale = SCALE[engine.name] if reference == "invariant" else 10 * SCALE[engine.name] or 0.02
    rng = np.random.default_rng(zlib.crc32(f"{case.hash}/{engine.name}/{dtype}/{router_replay}".encode()))
    rows = sum(r.sampling.n for r in case.requests)
    width = max(r.sampling.max_tokens for r in case.requests)
    rollout = -rng.exponential(1.0, (rows, width)).astype(np.float32)
    train = (rollout + scale * rng.standard_normal((rows, width))).astype(np.float32)
    mask = np.ones((rows, width), bool)
    d = train.astype(np.float64) - rollout
    ratio = np.exp(d)
    summary = {key: float(np.mean(np.abs(d))) for key in SUMMARY_KEYS}  # filler, overwritten below
    summary.update(max_abs_logprob_diff=float(np.abs(d).max()), mean_abs_logprob_diff=float(np.abs(d).mean()),
                   is_ratio_mean=float(ratio.mean()), is_ratio_p99=float(np.quantile(ratio, 0.99)),
                   k3_kl=float(np.mean(ratio - 1 - d)), num_tokens=int(mask.sum()), num_sequences=rows,
                   frac_tokens_ratio_gt_2=float(np.mean(np.abs(d) > 0.69)))
    buckets = [{"lo": lo, "hi": lo + 10, "num_tokens": rows * 10,
                "mean_abs_logprob_diff": float(np.abs(d[:, lo:lo + 10]).mean()),
                "max_abs_logprob_diff": float(np.abs(d[:, lo:lo + 10]).max())} for lo in range(0, width, 10)]
    tol = Tolerance.resolve(tolerance, engine.name)
    violations = tol.violations(summary)
    return ParityReport(
        train_logprobs=train, rollout_logprobs=rollout, mask=mask,
        positions=np.tile(np.arange(width), (rows, 1)) + 4, token_ids=rng.integers(3, 259, (rows, width)),
        sequences=[{"request_id": r.request_id, "sample_index": i} for r in case.requests
                   for i in range(r.sampling.n)], summary=summary,
        metrics={"rollout_corr/rollout_is_mean": summary["is_ratio_mean"]},
        breakdowns={"by_position": buckets, "by_probability": buckets[::-1]}, passed=not violations,
        tolerance=tol, violations=violations,
        provenance={"backend": engine.name, "dtype": dtype, "case": case.name, "case_hash": case.hash,
                    "router_replay": router_replay, "reference_kernels": reference},
    )


def install(target: Any, *, compare: Any = fake_compare, patch: Any = setattr) -> None:
    """Swap the runner's engines for the fakes (`patch` = monkeypatch.setattr in tests); `target`
    is the runner module, whose rows run in `parity.nightly.execute`."""
    from parity.nightly import execute

    patch(execute, "compare", compare)
    patch(execute, "shared_backend", fake_engine)
    patch(target, "available_backends", lambda: dict(AVAILABLE))


def write_cases(root: Path) -> Path:
    cases = root / "cases"
    cases.mkdir()
    (cases / "alpha.toml").write_text(textwrap.dedent("""
        description = "two prompts"
        model = "tiny-llama"
        [prompts]
        token_ids = [[3, 4, 5, 6], [7, 8, 9]]
        [sampling]
        n = 2
        max_tokens = 40
        seed = 1
    """))
    (cases / "beta.toml").write_text(textwrap.dedent("""
        description = "moe-like, with replay variants, two dtypes"
        model = "tiny-llama"
        dtypes = ["bfloat16", "float16"]
        router_replay = ["none", "R3"]
        backends = ["reference", "hf"]
        [prompts.generate]
        kind = "random"
        count = 3
        length = { min = 4, max = 12 }
        [sampling]
        max_tokens = 30
    """))
    return cases


def leave_figures_undrawn(patch: Any) -> None:
    """The page's figures are built but not drawn (an empty SVG): drawing them is two thirds of a
    fake run's time. `patch` = monkeypatch.setattr."""
    from parity.render import figures

    patch(figures, "figure_data_uri", lambda fig: "data:image/svg+xml;base64,")


@pytest.fixture
def drawn_figures():
    """Asked for by the tests whose claim is the page's figures: `workspace` then draws them."""


@pytest.fixture
def workspace(tmp_path, monkeypatch, request):
    """The fake engines and two cases; the figures are left undrawn unless the test asks for
    `drawn_figures`."""
    install(runner, patch=monkeypatch.setattr)
    if "drawn_figures" not in request.fixturenames:
        leave_figures_undrawn(monkeypatch.setattr)
    cases = write_cases(tmp_path)
    return SimpleNamespace(root=tmp_path, cases=cases, out=tmp_path / "reports",
                           db=tmp_path / "reports" / "history.sqlite")


def nightly(ws: SimpleNamespace, *args: str, cases: str | None = None) -> int:
    return main(["--cases", cases or f"{ws.cases}/alpha.toml", "--out", str(ws.out), "--no-progress", *args])


def db_rows(ws: SimpleNamespace) -> list[tuple[str, str, str]]:
    with sqlite3.connect(ws.db) as db:
        return db.execute("SELECT run_id, row_key, status FROM rows ORDER BY id").fetchall()


def test_plan_expands_backends_dtypes_and_replay_variants(workspace):
    from parity.workload.cases import load_cases

    cells = [str(k) for k, _ in plan(load_cases(workspace.cases), ("reference", "hf", "vllm"))]
    assert cells[:3] == ["alpha|reference|bfloat16|", "alpha|hf|bfloat16|", "alpha|vllm|bfloat16|"]
    # beta: 2 dtypes x (no replay on reference and hf; R3 on reference only, as hf records no
    # routes); vllm is not in its list
    assert len(cells) == 3 + 6 and "beta|reference|float16|R3" in cells and "beta|hf|float16|R3" not in cells
    assert not any("beta|vllm" in c for c in cells)
    cells = plan(load_cases(workspace.cases), ("reference",), ("float32",))
    assert [str(k) for k, _ in cells] == ["alpha|reference|float32|", "beta|reference|float32|none",
                                          "beta|reference|float32|R3"]


@pytest.mark.slow
def test_gold_reaches_every_compare_row_and_is_kept_for_resume(workspace, monkeypatch):
    """--gold / --no-gold / neither: every row's compare gets True / False / None (the default rule),
    and a resumed run keeps the stored choice."""
    seen = []

    def recording(*args: Any, gold: bool | None = None, **kwargs: Any) -> ParityReport:
        seen.append(gold)
        return fake_compare(*args, gold=gold, **kwargs)

    monkeypatch.setattr("parity.nightly.execute.compare", recording)
    for flags, want in ((["--gold"], True), (["--no-gold"], False), ([], None)):
        seen.clear()
        assert nightly(workspace, "--backends", "reference,hf", *flags) == 0
        assert seen == [want, want]
    from parity.nightly.runner import NightlyConfig

    config = NightlyConfig(cases="x", gold=True)
    assert NightlyConfig.from_record(config.to_record(), out=Path("o"), history=None, run_id="r").gold is True


@pytest.mark.slow
def test_a_run_writes_rows_reports_and_latest_and_prints_a_summary(workspace, drawn_figures, capsys):
    code = main(["--cases", f"{workspace.cases}/alpha.toml,{workspace.cases}/beta.toml", "--backends",
                 "reference,hf,vllm", "--out", str(workspace.out), "--run-id", "n1", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert len(db_rows(workspace)) == 9 and {s for _, _, s in db_rows(workspace)} == {"pass"}
    run_dir = workspace.out / "n1"
    assert "alpha / vllm / bfloat16" in out and f"report: {run_dir / 'index.html'}" in out
    page = (run_dir / "index.html").read_text()
    assert "<script" not in page and "http://" not in page and "https://" not in page
    assert page.count('class="row"') == 9 and "Trends" in page and page.count("data:image/svg+xml") > 30
    results = json.loads((run_dir / "results.json").read_text(),
                         parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert results["exit_code"] == 0 and len(results["rows"]) == 9
    row = results["rows"][0]
    assert set(row["summary"]) >= {"max_abs_logprob_diff", "k3_kl", "is_ratio_p99", "num_tokens"}
    assert row["provenance"]["case_hash"] and row["provenance"]["seeds"] == [1, 2]
    assert set(row["timing"]) == {"start_s", "case_s"}
    assert "versions" in results["environment"] and "git" in results["environment"]
    summary = (run_dir / "summary.md").read_text()
    assert summary.startswith("## parity nightly `n1`: 9 pass") and summary.count("| ✅ pass |") == 9
    assert (workspace.out / "latest").resolve() == run_dir.resolve()


@pytest.mark.slow
def test_a_second_run_against_the_first_reports_no_regression(workspace):
    assert nightly(workspace, "--backends", "reference,hf,vllm", "--run-id", "n1") == 0
    assert nightly(workspace, "--backends", "reference,hf,vllm", "--run-id", "n2") == 0
    results = json.loads((workspace.out / "n2" / "results.json").read_text())
    verdicts = [r["verdict"] for r in results["rows"]]
    assert all(v["baseline_run"] == "n1" and v["change"] == "unchanged" for v in verdicts)
    assert (workspace.out / "latest").resolve().name == "n2"


@pytest.mark.slow
def test_a_worse_setting_against_a_fixed_baseline_is_a_regression(workspace, capsys):
    assert nightly(workspace, "--backends", "reference,hf", "--run-id", "good") == 0
    assert nightly(workspace, "--backends", "hf", "--run-id", "other") == 0
    code = nightly(workspace, "--backends", "reference,hf", "--run-id", "bad", "--reference", "native",
                   "--baseline", "good")
    assert code == 1
    results = json.loads((workspace.out / "bad" / "results.json").read_text())
    by_backend = {r["backend"]: r for r in results["rows"]}
    assert by_backend["hf"]["status"] == "regression"
    verdict = by_backend["hf"]["verdict"]
    assert verdict["baseline_run"] == "good" and verdict["p_worse"] < 0.01
    # reference: exact tolerance breaks and the drift regressed from exact zero
    assert by_backend["reference"]["status"] == "regression" and by_backend["reference"]["violations"]
    summary = (workspace.out / "bad" / "summary.md").read_text()
    assert "regression vs good" in summary and "📉 regression" in summary
    # a regressed row is never the automatic baseline of a later run
    assert nightly(workspace, "--backends", "hf", "--run-id", "after") == 0
    after = json.loads((workspace.out / "after" / "results.json").read_text())["rows"][0]
    assert after["verdict"]["baseline_run"] == "other"
    # going back to the good setting against the bad run is reported as an improvement
    assert nightly(workspace, "--backends", "hf", "--run-id", "fixed", "--baseline", "bad") == 0
    fixed = json.loads((workspace.out / "fixed" / "results.json").read_text())["rows"][0]
    assert fixed["status"] == "improved" and fixed["verdict"]["effect"] < 0
    assert "📈 improved" in (workspace.out / "fixed" / "summary.md").read_text()


@pytest.mark.slow
def test_a_failing_backend_becomes_an_error_row_and_the_rest_still_runs(workspace, capsys):
    crashy = workspace.cases / "crashy.toml"
    crashy.write_text((workspace.cases / "alpha.toml").read_text())
    code = main(["--cases", f"{workspace.cases}/alpha.toml,{crashy}", "--backends", "reference,sglang,vllm",
                 "--out", str(workspace.out), "--run-id", "e1", "--no-progress"])
    assert code == 2
    rows = {k: s for _, k, s in db_rows(workspace)}
    assert rows["alpha|reference|bfloat16|"] == "pass" and rows["alpha|vllm|bfloat16|"] == "pass"
    assert rows["alpha|sglang|bfloat16|"] == "error" and rows["crashy|vllm|bfloat16|"] == "error"
    results = json.loads((workspace.out / "e1" / "results.json").read_text())
    errors = {r["key"]: r["error"] for r in results["rows"] if r["status"] == "error"}
    assert errors["alpha|sglang|bfloat16|"].startswith(
        "backend failed to start: BackendError: sglang engine died")
    assert errors["crashy|vllm|bfloat16|"].startswith("case failed: RuntimeError: vllm worker crashed")
    assert "vllm worker crashed" in (workspace.out / "e1" / "index.html").read_text()
    assert "crashy|vllm" not in capsys.readouterr().err


@pytest.mark.slow
def test_an_interrupted_run_resumes_without_duplicates(workspace, monkeypatch):
    calls: list[str] = []

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[1].name)
        if len(calls) == 2:
            raise KeyboardInterrupt  # not an error row: the whole run stops, like Ctrl-C
        return fake_compare(*args, **kwargs)

    monkeypatch.setattr(execute, "compare", interrupted)
    assert nightly(workspace, "--backends", "reference,hf,vllm", "--run-id", "k1") == 130
    assert [k for _, k, _ in db_rows(workspace)] == ["alpha|reference|bfloat16|"]
    with sqlite3.connect(workspace.db) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    monkeypatch.setattr(execute, "compare", fake_compare)
    assert main(["--resume", "k1", "--out", str(workspace.out), "--no-progress"]) == 0
    assert calls == ["reference", "hf"]  # the resumed run did only what was missing
    keys = [k for _, k, _ in db_rows(workspace)]
    assert keys == ["alpha|reference|bfloat16|", "alpha|hf|bfloat16|", "alpha|vllm|bfloat16|"]
    # running the same run id again finds nothing left to do and adds nothing
    assert nightly(workspace, "--backends", "reference,hf,vllm", "--run-id", "k1") == 0
    assert len(db_rows(workspace)) == 3


def test_a_sweep_case_shows_drift_per_sampling_block(workspace):
    sweep = workspace.cases / "sweep.toml"
    sweep.write_text(textwrap.dedent("""
        model = "tiny-llama"
        [prompts]
        token_ids = [[3, 4, 5]]
        [[sampling]]
        temperature = 0.6
        [[sampling]]
        label = "hot"
        temperature = 1.2
        top_k = 20
    """))
    assert nightly(workspace, "--backends", "hf", "--run-id", "s1", cases=str(sweep)) == 0
    page = (workspace.out / "s1" / "index.html").read_text()
    assert "Drift by sampling block" in page and "<td>t0.6</td>" in page and "<td>hot</td>" in page


KILL_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import test_nightly_runner as fakes
from parity.nightly import execute, main, runner

calls = []
def dies_on_the_second_row(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return fakes.fake_compare(*args, **kwargs)

fakes.install(runner, compare=dies_on_the_second_row)
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_killed_process_leaves_a_valid_history_and_resume_finishes_it(workspace):
    script = workspace.root / "kill.py"
    script.write_text(KILL_SCRIPT.format(tests=str(TESTS)))
    args = ["--cases", str(workspace.cases / "alpha.toml"), "--backends", "reference,hf,vllm",
            "--out", str(workspace.out), "--run-id", "killed", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert [k for _, k, _ in db_rows(workspace)] == ["alpha|reference|bfloat16|"]
    assert not (workspace.out / "killed").exists()
    assert main(["--resume", "killed", "--out", str(workspace.out), "--no-progress"]) == 0
    assert [k for _, k, _ in db_rows(workspace)] == ["alpha|reference|bfloat16|", "alpha|hf|bfloat16|",
                                                    "alpha|vllm|bfloat16|"]
    assert len(json.loads((workspace.out / "killed" / "results.json").read_text())["rows"]) == 3


@pytest.mark.slow
def test_the_parity_command_runs_nightly_with_the_backends_available_here(workspace, capsys):
    from parity.cli import main as parity_main

    # the Makefile's `make demo` line, on the fakes
    assert parity_main(["nightly", "--cases", str(workspace.cases / "alpha.toml"), "--backends", "auto",
                        "--out", str(workspace.out), "--run-id", "a1", "--no-progress"]) == 0
    assert f"report: {workspace.out / 'a1' / 'index.html'}" in capsys.readouterr().out
    assert [k.split("|")[1] for _, k, _ in db_rows(workspace)] == ["reference", "hf", "vllm"]


@pytest.mark.parametrize(("args", "message"), [
    (["--backends", "tgi"], "--backends: unknown ['tgi']"),
    (["--dtypes", "fp8"], "--dtypes: unknown ['fp8']"),
    (["--alpha", "2"], "--alpha must be"),
    (["--baseline", "nope"], "--baseline 'nope': no history at"),
    (["--run-id", "../escape"], "--run-id '../escape'"),
    (["--resume", "x"], "--resume takes the matrix from the stored run; drop ['--cases']"),
])
def test_bad_options_exit_2_with_a_message(workspace, capsys, args, message):
    assert nightly(workspace, *args) == 2
    assert message in capsys.readouterr().err


def test_resume_of_an_unknown_run_and_missing_cases(workspace, capsys):
    assert main(["--resume", "ghost", "--out", str(workspace.out)]) == 2
    assert "--resume 'ghost': no history at" in capsys.readouterr().err
    assert nightly(workspace, "--backends", "hf", "--run-id", "real") == 0
    assert main(["--resume", "ghost", "--out", str(workspace.out)]) == 2
    assert "--resume 'ghost': no such run" in capsys.readouterr().err
    assert main(["--out", str(workspace.out)]) == 2
    assert "--cases is required" in capsys.readouterr().err


@needs_chromium
@pytest.mark.slow
def test_the_page_loads_in_headless_chromium_without_console_errors(workspace, drawn_figures, tmp_path,
                                                                     monkeypatch):
    crashy = workspace.cases / "crashy.toml"
    crashy.write_text((workspace.cases / "alpha.toml").read_text())
    spec = f"{workspace.cases}/alpha.toml,{workspace.cases}/beta.toml,{crashy}"

    def run(run_id: str, *extra: str) -> None:
        main(["--cases", spec, "--backends", "reference,hf,vllm", "--dtypes", "bfloat16", "--out",
              str(workspace.out), "--run-id", run_id, "--no-progress", *extra])

    with monkeypatch.context() as m:
        leave_figures_undrawn(m.setattr)  # c1 is c2's baseline and trend history; only c2's page is loaded
        run("c1")
    run("c2", "--reference", "native", "--baseline", "c1")
    page = workspace.out / "c2" / "index.html"
    loaded, total, console = decoded_images(page, tmp_path)
    assert loaded == total > 40 and console == []
    shot = tmp_path / "nightly.png"
    result = chromium(page, tmp_path, f"--screenshot={shot}", "--window-size=1400,2000", "--hide-scrollbars")
    assert result.returncode == 0 and shot.stat().st_size > 10_000 and console_lines(result) == []
    kept = ROOT / ".venv" / "parity-screenshots"
    kept.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, kept / "nightly.png")  # for a person to look at after the run


# -- audit rows and the noise floor they give the rest of the run --------------------------------------

AUDIT_CASE = """
    description = "audit"
    kind = "audit"
    model = "tiny-llama"
    backends = ["reference", "hf"]
    [prompts]
    token_ids = [[3, 4, 5, 6], [7, 8, 9]]
    [sampling]
    n = 2
    max_tokens = 8
"""


def fake_audit(repeat_differs: dict[str, int], seed_ignored: tuple[str, ...] = ()):
    """`parity.audit` for the fake engines: `repeat_differs[backend]` requests of 2 differ on repeat
    (mean |Δlogp| 0.05 nats), the others are identical everywhere; backends in `seed_ignored` fail the
    control."""
    from parity.audit import CHECKS, AuditResult, CheckResult

    def audit(model, engine, *, case, dtype, device):
        differing = repeat_differs.get(engine.name, 0)
        same = CheckResult(identical=True, requests=2, differing_requests=0, first_difference=None,
                           max_abs_logprob_diff=0.0, mean_abs_logprob_diff=0.0)
        checks = {name: same for name in CHECKS}
        if differing:
            checks["repeat"] = CheckResult(identical=False, requests=2, differing_requests=differing,
                                           first_difference={"what": "logprobs"}, max_abs_logprob_diff=0.4,
                                           mean_abs_logprob_diff=0.05)
        if engine.name not in seed_ignored:
            checks["seed"] = CheckResult(identical=False, requests=2, differing_requests=2,
                                         first_difference={"what": "tokens"}, max_abs_logprob_diff=0.0,
                                         mean_abs_logprob_diff=0.0)
        return AuditResult(backend=engine.name, model=case.model, dtype=dtype, provenance={}, checks=checks)
    return audit


def audited_engine(name: str, model: str, *, dtype: str, **options: Any) -> SimpleNamespace:
    """A fake engine with the meta an audit row reads: the reference says it is batch-invariant."""
    return SimpleNamespace(name=name, model=model, dtype=dtype, options=options,
                           meta={"batch_invariant": name == "reference"})


def shifted_compare(shift: dict[str, float]):
    """`fake_compare` with each backend's training logprobs moved by `shift[backend]` nats."""
    def compare(model, engine, **kw):
        report = fake_compare(model, engine, **kw)
        report.train_logprobs = report.train_logprobs + np.float32(shift.get(engine.name, 0.0))
        return report
    return compare


@pytest.mark.slow
def test_audit_rows_run_first_and_judge_the_rest_of_their_backend_against_its_noise(workspace, monkeypatch):
    (workspace.cases / "noise.toml").write_text(textwrap.dedent(AUDIT_CASE))
    monkeypatch.setattr(execute, "shared_backend", audited_engine)
    monkeypatch.setattr(importlib.import_module("parity.audit"), "audit", fake_audit({"hf": 1}))
    cases = f"{workspace.cases}/alpha.toml,{workspace.cases}/noise.toml"

    def run(run_id, shift):
        monkeypatch.setattr(execute, "compare", shifted_compare(shift))
        code = main(["--cases", cases, "--backends", "reference,hf", "--out", str(workspace.out), "--run-id",
                     run_id, "--no-progress"])
        return code, {(r["case"], r["backend"]): r for r in
                      json.loads((workspace.out / run_id / "results.json").read_text())["rows"]}

    code, rows = run("n1", {})
    assert code == 0 and plan(runner.load_cases(cases), ("reference", "hf"))[0][0].case == "noise"
    audit_row = rows[("noise", "hf")]
    assert audit_row["status"] == "pass" and audit_row["summary"]["audit_deterministic"] == 0.0
    assert audit_row["summary"]["audit_repeat_mean_abs_logprob_diff"] == 0.05
    # every alpha row shows its backend's noise, with no baseline yet
    assert rows[("alpha", "hf")]["summary"]["noise_mean_abs_logprob_diff"] == 0.05
    assert rows[("alpha", "reference")]["summary"]["noise_deterministic"] == 1.0
    assert "noise (repeat mean)" in (workspace.out / "n1" / "index.html").read_text()
    # hf moves 0.01 nats (significant, inside its 0.05 of noise); the deterministic reference moves 1e-6
    code, rows = run("n2", {"hf": 0.01, "reference": 1e-6})
    assert rows[("alpha", "hf")]["verdict"]["change"] == "noise" and rows[("alpha", "hf")]["status"] == "pass"
    ref = rows[("alpha", "reference")]
    assert ref["verdict"]["change"] == "changed" and ref["status"] == "regression" and code == 1
    assert ref["verdict"]["effect"] < 1e-3  # below min_effect: without the audit this passed as unchanged
    assert "changed vs n1" in (workspace.out / "n2" / "summary.md").read_text()


def test_an_audit_row_fails_when_a_batch_invariant_backend_differs_or_seeds_change_nothing(workspace,
                                                                                             monkeypatch):
    (workspace.cases / "noise.toml").write_text(textwrap.dedent(AUDIT_CASE))
    monkeypatch.setattr(execute, "shared_backend", audited_engine)
    audit = fake_audit({"reference": 2, "hf": 2}, seed_ignored=("hf",))
    monkeypatch.setattr(importlib.import_module("parity.audit"), "audit", audit)
    code = main(["--cases", f"{workspace.cases}/noise.toml", "--backends", "reference,hf", "--out",
                 str(workspace.out), "--run-id", "a1", "--no-progress"])
    rows = {r["backend"]: r for r in json.loads((workspace.out / "a1" / "results.json").read_text())["rows"]}
    assert code == 1 and rows["reference"]["status"] == "fail" and rows["hf"]["status"] == "fail"
    assert "although the backend is batch-invariant" in rows["reference"]["violations"][0]["metric"]
    assert "seeds ignored" in rows["hf"]["violations"][0]["metric"]
