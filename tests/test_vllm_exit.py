"""parity.backends.vllm_exit: an engine process that shut down cleanly skips the interpreter's teardown;
one that failed, ran with the switch off, or is not vLLM's keeps it (and its exit code).

Each case runs a child interpreter under a process name of vLLM's with a stand-in `vllm` package (the
three methods the plugin marks), so no engine starts. The teardown is seen through an atexit handler
registered before the plugin's (atexit runs last-in first-out): it prints unless the plugin left first.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

STANDIN = {
    "vllm/__init__.py": "",
    "vllm/v1/__init__.py": "",
    "vllm/v1/engine/__init__.py": "",
    "vllm/v1/executor/__init__.py": "",
    "vllm/v1/engine/core.py": textwrap.dedent("""
        class EngineCore:
            def shutdown(self):
                pass

        class EngineCoreProc(EngineCore):
            def _send_engine_dead(self):
                pass
        """),
    "vllm/v1/executor/multiproc_executor.py": textwrap.dedent("""
        class WorkerProc:
            def shutdown(self):
                pass
        """),
}

CHILD = textwrap.dedent("""
    import atexit, multiprocessing, sys
    atexit.register(lambda: print("teardown ran", flush=True))
    multiprocessing.current_process().name = sys.argv[1]
    from parity.backends import vllm_exit
    vllm_exit.install()
    from vllm.v1.engine import core
    from vllm.v1.executor import multiproc_executor
    proc = core.EngineCoreProc()
    for step in sys.argv[2].split(","):
        {"core": proc.shutdown, "worker": multiproc_executor.WorkerProc().shutdown,
         "dead": proc._send_engine_dead, "none": lambda: None}[step]()
    print("work done", flush=True)
    sys.exit(int(sys.argv[3]))
    """)


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("standin")
    for name, text in STANDIN.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def _child(standin: Path, name: str, steps: str, code: int, switch: str = "1") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(standin), str(Path.cwd())]),
           "PARITY_VLLM_FAST_EXIT": switch}
    return subprocess.run([sys.executable, "-c", CHILD, name, steps, str(code)], env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("name", "steps"), [("EngineCore", "core"), ("EngineCore_DP0", "core"),
                                             ("VllmWorker-0", "worker")])
def test_a_clean_shutdown_leaves_without_teardown(standin: Path, name: str, steps: str) -> None:
    done = _child(standin, name, steps, 0)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["work", "done"]  # the earlier atexit handler never ran


@pytest.mark.parametrize(("name", "steps", "switch", "code"), [
    ("EngineCore", "dead,core", "1", 1),   # reported a failure: its exit code and teardown stay
    ("EngineCore", "none", "1", 0),        # never shut down (killed or crashed first)
    ("EngineCore", "core", "0", 0),        # the user switched it off
    ("MainProcess", "core", "1", 0),       # not vLLM's process: the user's or a host's interpreter
])
def test_every_other_exit_keeps_its_teardown(standin: Path, name: str, steps: str, switch: str,
                                              code: int) -> None:
    done = _child(standin, name, steps, code, switch)
    assert done.returncode == code, done.stderr
    assert "teardown ran" in done.stdout
