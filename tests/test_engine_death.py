"""One bad row must not kill the night: a shared engine that died is closed and started again.

The fast tests use a fake adapter whose engine dies on a poisoned request; the acceptance test
runs `parity nightly` on the real vLLM CPU engine with a case whose out-of-vocabulary id is
slipped past parity's validation (which would otherwise refuse it when the case loads): vLLM's
engine core dies on it ("EngineCore encountered an issue"), that row is an error row, the rows
after it run on a fresh engine, the run exits 2 and no vLLM process outlives it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest

from parity.backends import Backend, registry, shared_backend
from parity.core.errors import BackendError
from parity.core.types import Rollout
from parity.nightly import main

ROOT = Path(__file__).resolve().parent.parent
POISON = 511  # in the tiny vocabulary, so only the fake treats it as fatal


class Mortal(Backend):
    """A backend whose engine dies on the prompt token `POISON`, after which every call fails."""

    name = "mortal"
    started: ClassVar[list[Mortal]] = []

    def __init__(self, model: str, *, dtype: str = "float32") -> None:
        super().__init__(model, dtype=dtype)
        self.dead = self.closed = False
        Mortal.started.append(self)

    @property
    def alive(self) -> bool:
        return not self.dead and not self.closed

    def generate(self, requests):
        if self.dead or any(POISON in r.prompt_ids for r in requests):
            self.dead = True
            raise BackendError("mortal generate failed: engine core encountered an issue")
        return [Rollout(r.request_id, i, r.prompt_ids, (5,), (-0.5,), "length", self.name)
                for r in requests for i in range(r.sampling.n)]

    def _score(self, pairs, sampling):
        raise AssertionError

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def mortal(monkeypatch):
    """Fake engines in a cache of their own: the session's real shared engines are neither seen
    nor closed by these tests."""
    Mortal.started = []
    monkeypatch.setattr(registry, "get_backend", lambda name, model, **kw: Mortal(model, dtype=kw["dtype"]))
    monkeypatch.setattr(registry, "_SHARED", {})
    yield
    registry.close_shared_backends()


def test_a_dead_shared_engine_is_closed_and_replaced(mortal):
    first = shared_backend("vllm", "tiny-llama", dtype="float32")
    assert shared_backend("vllm", "tiny-llama", dtype="float32") is first
    first.dead = True
    second = shared_backend("vllm", "tiny-llama", dtype="float32")
    assert second is not first and first.closed and not second.closed


def test_close_dead_backends_closes_only_the_dead(mortal):
    a = shared_backend("vllm", "tiny-llama", dtype="float32")
    b = shared_backend("vllm", "tiny-llama", dtype="bfloat16")
    b.dead = True
    assert registry.close_dead_backends() == ["mortal"]
    assert b.closed and not a.closed
    assert shared_backend("vllm", "tiny-llama", dtype="float32") is a


def cases_with_a_poisoned_one(root: Path, poison: int) -> Path:
    cases = root / "cases"
    cases.mkdir()
    body = 'model = "tiny-llama"\n[prompts]\ntoken_ids = [[3, 4, 5, 6], [{}]]\n[sampling]\nmax_tokens = 4\n'
    for name, last in (("a-good", 8), ("b-poisoned", poison), ("c-good", 9)):
        (cases / f"{name}.toml").write_text(body.format(f"7, {last}"))
    return cases


def test_the_row_that_kills_the_engine_is_an_error_row_and_later_rows_run(mortal, tmp_path, monkeypatch):
    def fake_compare(model: Any, engine: Backend, *, case: Any, **kwargs: Any) -> Any:
        engine.generate(list(case.requests))
        raise BackendError("stop after sampling")  # scoring is not what this test is about

    monkeypatch.setattr("parity.nightly.execute.compare", fake_compare)
    cases = cases_with_a_poisoned_one(tmp_path, POISON)
    out = tmp_path / "reports"
    assert main(["--cases", str(cases), "--backends", "vllm", "--out", str(out), "--run-id", "r",
                 "--no-progress"]) == 2
    errors = {r["case"]: r["error"] for r in json.loads((out / "r" / "results.json").read_text())["rows"]}
    assert errors["b-poisoned"].startswith("case failed: BackendError: mortal generate failed")
    assert "the mortal engine died and was closed; the next row starts a new one" in errors["b-poisoned"]
    assert errors["c-good"] == "case failed: BackendError: stop after sampling"  # it ran, on a new engine
    assert len(Mortal.started) == 2 and Mortal.started[0].closed


def test_a_server_parity_started_is_dead_once_its_process_exits():
    from parity.backends.vllm_server import VLLMServerBackend
    from parity.runtime.processes import ServerProcess, free_loopback_port

    port = free_loopback_port()
    fake = Path(__file__).resolve().parent / "data" / "processes" / "fake_server.py"
    server = ServerProcess([sys.executable, str(fake), str(port), "healthy"], port=port, name="fake server")
    server.start(60)
    backend = object.__new__(VLLMServerBackend)  # the liveness check alone, without a vLLM server
    backend.server = server
    try:
        assert backend.alive
        os.kill(server.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while backend.alive and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not backend.alive
    finally:
        server.stop()


# -- the acceptance test on the real vLLM CPU engine --------------------------------------------------

#: runs `parity nightly` with the prompt-id check switched off, so the poisoned id reaches vLLM.
UNCHECKED = textwrap.dedent("""
    import sys
    from parity.models.limits import ModelLimits

    ModelLimits.vocabulary_problem = lambda self, ids: None
    from parity.cli import main

    if __name__ == "__main__":
        sys.exit(main(sys.argv[1:]))
""")


def vllm_processes(pids: set[int]) -> list[str]:
    import psutil

    alive = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid} {p.name()}")
        except psutil.NoSuchProcess:
            continue
    return alive


@pytest.mark.vllm
@pytest.mark.own_engines
@pytest.mark.own_engine(reason="a poisoned case kills its vLLM engine process mid-night")
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_a_poisoned_case_on_vllm_costs_one_row_not_the_night(tmp_path):
    import psutil

    cases = cases_with_a_poisoned_one(tmp_path, 100_000)
    script = tmp_path / "unchecked.py"
    script.write_text(UNCHECKED)
    out = tmp_path / "reports"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_LOGGING_LEVEL": "ERROR"}
    nightly = subprocess.Popen(
        [sys.executable, str(script), "nightly", "--cases", str(cases), "--backends", "vllm",
         "--out", str(out), "--run-id", "poison", "--no-progress"],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: set[int] = set()  # every process the run started, sampled while it runs
    while nightly.poll() is None:
        try:
            seen.update(p.pid for p in psutil.Process(nightly.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            break
        time.sleep(0.5)
    output = nightly.communicate()[0]
    assert nightly.returncode == 2, output[-4000:]
    with sqlite3.connect(out / "history.sqlite") as db:
        rows = dict(db.execute("SELECT case_name, status FROM rows WHERE run_id = 'poison'").fetchall())
        error = db.execute("SELECT error FROM rows WHERE case_name = 'b-poisoned'").fetchone()[0]
    # the good rows ran (pass or a tolerance verdict on 8 tokens); only the poisoned one errored
    assert sorted(rows) == ["a-good", "b-poisoned", "c-good"], output[-4000:]
    assert [c for c, s in rows.items() if s == "error"] == ["b-poisoned"], output[-4000:]
    assert "EngineCore encountered an issue" in error and "died and was closed" in error
    deadline = time.monotonic() + 30
    while vllm_processes(seen) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not vllm_processes(seen)
