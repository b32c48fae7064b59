"""The engine hosts' zygote: one process per session, environment and backend kind that imports what a
host imports (vLLM's `LLM` and parity's adapter: ~9 CPU-s of a fresh vLLM host's start) once, then
forks each engine host (tests/engine_host.py) from that state.

A forked host is the process a fresh interpreter running `engine_host.run` would be: its zygote
started with that same environment (another environment gets a zygote of its own), and the host gets a
session of its own, /dev/null as stdin and its log as stdout and stderr. The zygote exits when the
session's owner is gone, or on SIGTERM: its pid file is a `host-*.pid`, so `close_session` stops it
with the hosts. docs/PERF.md, "Test suite time, round 11", has the numbers.

Run as a script, this file is the zygote (`python tests/host_zygote.py DIRECTORY TAG KIND`), or on a
CUDA host a fresh host (`python tests/host_zygote.py --host DIRECTORY KEY`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import engine_host

from parity.core.errors import BackendError

#: what a host imports before its engine starts, by kind: a vLLM host, or any other ("parity")
PRELOAD = {"vllm": ("vllm", "vllm.entrypoints.llm", "parity.backends", "parity.backends.vllm"),
           "parity": ("torch", "parity.backends", "parity.backends.reference")}
#: the first argument of a fresh host's command line: `python tests/host_zygote.py --host DIRECTORY KEY`
FRESH = "--host"
#: seconds a zygote may take to import its preload (vLLM's takes ~9 s on an idle core)
START_TIMEOUT_S = 300.0


def _tag(env: dict[str, str], kind: str) -> str:
    return hashlib.sha256(repr((kind, sorted(env.items()))).encode()).hexdigest()[:12]


def _exchange(address: str, request: object) -> object:
    """One request to a zygote and its answer (each a pickle, ended by closing the write side)."""
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(address)
        conn.sendall(pickle.dumps(request))
        conn.shutdown(socket.SHUT_WR)
        return pickle.loads(_read_all(conn))


def _read_all(conn: socket.socket) -> bytes:
    chunks = []
    while chunk := conn.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def start_host(directory: Path, key: str, backend: str, env: dict[str, str], log_path: Path) -> int:
    """The pid of the host of `key`, forked by the session's zygote for `env` and `backend` (started
    under its lock on first use). The host writes its ready or error file as a fresh one does. On a
    CUDA host each host is a fresh interpreter instead, as CUDA rank processes are (parity.parallel):
    a fork carries whatever CUDA state the zygote's imports made."""
    import torch  # loaded already in a test process

    if torch.cuda.is_available():
        with open(log_path, "ab") as log:
            argv = [sys.executable, str(Path(__file__).resolve()), FRESH, str(directory), key]
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True).pid
    kind = backend if backend in PRELOAD else "parity"
    tag = _tag(env, kind)
    ready = directory / f"zygote-{tag}.json"
    with open(directory / f"zygote-{tag}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = json.loads(ready.read_text()) if ready.exists() else None
        if found is None or not engine_host._is_alive(found["zygote"]):
            ready.unlink(missing_ok=True)
            found = _start(directory, tag, kind, env)
    return int(_exchange(found["address"], (key, str(log_path))))  # type: ignore[arg-type]


def _start(directory: Path, tag: str, kind: str, env: dict[str, str]) -> dict:
    log_path = directory / f"zygote-{tag}.log"
    with open(log_path, "ab") as log:
        argv = [sys.executable, str(Path(__file__).resolve()), str(directory), tag, kind]
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 env=env, start_new_session=True)
    (directory / f"host-zygote-{child.pid}.pid").write_text(json.dumps(engine_host._identity(child.pid)))
    ready, deadline = directory / f"zygote-{tag}.json", time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if ready.exists():
            return json.loads(ready.read_text())
        if child.poll() is not None:
            raise BackendError(f"the engine hosts' zygote exited ({child.returncode}) before it was ready; "
                               f"its log: {log_path}")
        time.sleep(0.1)
    child.kill()
    raise BackendError(f"the engine hosts' zygote did not start in {START_TIMEOUT_S:.0f} s; "
                       f"its log: {log_path}")


def _host(server: socket.socket, conn: socket.socket, directory: Path, key: str, log_path: str) -> None:
    """The forked child: a session, stdio and signals of its own, then the host's main, as a fresh one."""
    code = 1
    try:
        server.close()
        conn.close()
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as a fresh interpreter starts
        signal.signal(signal.SIGINT, signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        for fd, target in ((null, 0), (log, 1), (log, 2)):
            os.dup2(fd, target)
        os.close(null)
        os.close(log)
        code = engine_host.run(directory, key)
    except BaseException:
        traceback.print_exc()
    _exit(code)


def _exit(code: int) -> None:
    """End a host without the interpreter's teardown: its engine is closed, and the garbage collection
    of the engine's objects takes seconds no one waits for (parity.backends.vllm_exit skips it too)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def main(directory: Path, tag: str, kind: str) -> int:
    """The zygote: preload, then fork a host per request until the session's owner is gone."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # its hosts have sessions of their own
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the owner stops it (a Ctrl-C reaches the whole group)
    for module in PRELOAD[kind]:
        importlib.import_module(module)
    owner = engine_host._session(directory)["owner"]
    address = str(directory / f"zygote-{tag}.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(address)  # the session directory is 0700: only this user reaches it
    server.listen()
    server.settimeout(engine_host.WATCH_S)
    ready = directory / f"zygote-{tag}.json"
    ready.with_suffix(".tmp").write_text(json.dumps({"address": address,
                                                     "zygote": engine_host._identity(os.getpid())}))
    ready.with_suffix(".tmp").replace(ready)
    while engine_host._is_alive(owner):
        with contextlib.suppress(ChildProcessError):  # reap the hosts that ended
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        with conn:
            conn.settimeout(None)
            key, log_path = pickle.loads(_read_all(conn))
            pid = os.fork()
            if pid == 0:
                _host(server, conn, directory, key, log_path)
            conn.sendall(pickle.dumps(pid))
    return 0


if __name__ == "__main__":
    if sys.argv[1] != FRESH:
        sys.exit(main(Path(sys.argv[1]), sys.argv[2], sys.argv[3]))
    _exit(engine_host.run(Path(sys.argv[2]), sys.argv[3]))
