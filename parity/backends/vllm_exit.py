"""A vLLM general plugin: an engine process that shut down cleanly leaves without interpreter teardown.

A vLLM-CPU engine close took 5.0 s: the engine core and its worker finish their shutdown in well under
a second, then spend seconds in the interpreter's exit (a full garbage collection of the model's
object graph, module teardown) until vLLM's 5 s process timeout kills them. Where parity started the
engine (`PARITY_VLLM_FAST_EXIT=1` in the engine's environment, set by parity's vLLM adapters), the
engine core and worker processes record that vLLM's own shutdown ran to its end and, at exit, flush
their streams and `os._exit(0)`: what vLLM would otherwise kill mid-teardown (no one reads the exit
code of a process it has asked to stop). A process that reported a failure (`_send_engine_dead`) or
never finished a shutdown exits as before, with its exit code.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import os
import sys
from typing import Any

#: the environment switch; parity's adapters set it to "1" unless the user set it.
ENV = "PARITY_VLLM_FAST_EXIT"
#: processes of vLLM's own naming where the switch acts (never the user's process or a host).
_PROCESSES = ("EngineCore", "VllmWorker")

_state = {"installed": False, "shut_down": False, "failed": False}


def enable() -> None:
    """Ask for fast exits in the engines this process starts from now on (a user's value stays)."""
    os.environ.setdefault(ENV, "1")


def install() -> None:
    """vLLM's `vllm.general_plugins` entry: in an engine core or worker process with the switch on,
    mark vLLM's clean shutdown and exit at its end (idempotent; nothing elsewhere)."""
    name = multiprocessing.current_process().name
    if os.environ.get(ENV) != "1" or _state["installed"] or not name.startswith(_PROCESSES):
        return
    # vllm only inside its own processes: this module imports without it
    from vllm.v1.engine import core
    from vllm.v1.executor import multiproc_executor

    for owner, method, flag in ((core.EngineCore, "shutdown", "shut_down"),
                                (multiproc_executor.WorkerProc, "shutdown", "shut_down"),
                                (core.EngineCoreProc, "_send_engine_dead", "failed")):
        if callable(getattr(owner, method, None)):
            setattr(owner, method, _marking(getattr(owner, method), flag))
    atexit.register(_exit_now)
    _state["installed"] = True


def _marking(method: Any, flag: str) -> Any:
    @functools.wraps(method)
    def marked(*args: Any, **kwargs: Any) -> Any:
        if flag == "failed":  # a failure counts even when reporting it raises
            _state[flag] = True
            return method(*args, **kwargs)
        result = method(*args, **kwargs)
        _state[flag] = True  # only a shutdown that returned is clean
        return result
    return marked


def _exit_now() -> None:
    if _state["shut_down"] and not _state["failed"]:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        os._exit(0)
