"""A stand-in for a parity process that owns engine processes, for tests/test_guard.py.

argv: MODE OUT_FILE, where MODE is "guarded" (children started inside a guard spawn window, a
server-like child in its own session tracked by pid) or "unguarded" (the same tree, no guard).
Writes the pids of every process it started to OUT_FILE as JSON, then sleeps until killed.
Children: an "engine" that starts a "worker" of its own (like vLLM's EngineCore and its
workers), a "server" in its own session that starts a child in its group, and an "unrelated"
child started outside any window, which the guard must leave alone; and a "folder" (an engine's
socket folder), named to the guard for removal when guarded.
"""

import contextlib
import json
import subprocess
import sys
import tempfile
import time

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
PARENT_OF_SLEEPER = [sys.executable, "-c",
                     "import subprocess, sys, time; "
                     f"p = subprocess.Popen({SLEEPER!r}); print(p.pid, flush=True); time.sleep(600)"]


def spawn_with_child(**kw):
    proc = subprocess.Popen(PARENT_OF_SLEEPER, stdout=subprocess.PIPE, text=True, **kw)
    return proc, int(proc.stdout.readline())


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    guarded = mode == "guarded"
    if guarded:
        from parity.runtime import guard
    window = guard.spawn_window() if guarded else contextlib.nullcontext()
    with window:
        engine, worker = spawn_with_child()
    server, server_child = spawn_with_child(start_new_session=True)
    folder = tempfile.mkdtemp(prefix="fake-parity-sockets-")
    if guarded:
        guard.track(server.pid)
        guard.remove_with_owner(folder)
    unrelated = subprocess.Popen(SLEEPER)
    pids = {"engine": engine.pid, "worker": worker, "server": server.pid, "server_child": server_child,
            "unrelated": unrelated.pid, "guard": guard.guard().pid if guarded else None, "folder": folder}
    with open(out, "w") as f:
        json.dump(pids, f)
    time.sleep(600)
