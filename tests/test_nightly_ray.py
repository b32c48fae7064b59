"""`parity nightly --executor ray` on a real Ray cluster (127.0.0.1, 2 CPUs): its rows equal the local
executor's bit for bit, a worker killed mid-row is retried once and then recorded as an error row,
Ctrl-C leaves a run that `--resume` finishes without duplicates, and no Ray process outlives its
run. The runs share the module's cluster (`ray_address`, given as `--ray-address`), which also
proves that parity hands its PARITY_* variables (the tests' row hook and its faults) to the workers
of a cluster it did not start; the Ctrl-C run starts and stops its own, the cluster's life being its
point. Every run is its own process, so Ray's state never leaks into the test session; workers
inject faults through `ray_faults`."""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
from procs import alive, cmdline, descendants, listening_addresses, process_name
from ray_faults import FAULTS_ENV, kills
from recording_backend import LOG_ENV as ENGINE_LOG_ENV
from recording_backend import START_ENV, events

from parity.backends import available_backends
from parity.core.errors import ConfigError
from parity.nightly.execute import engine_options, tensor_parallel
from parity.nightly.ray_executor import (
    LOCAL_ONLY_ENV,
    LOOPBACK,
    ROW_HOOK_ENV,
    assign,
    row_resources,
    worker_env,
)
from parity.nightly.runner import NightlyConfig, plan
from parity.runtime.guard import terminate, track
from parity.workload.cases import load_cases

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
NO_RAY = importlib.util.find_spec("ray") is None
needs_ray = pytest.mark.skipif(NO_RAY, reason="ray is not installed (pip install 'parity-harness[ray]')")
RAY_PROCESSES = ("raylet", "gcs_server")
TINY_CASE = """
    model = "tiny-llama"
    [prompts]
    token_ids = [[72, 101, 108, 108, 111], [3, 4, 5, 6, 7, 8]]
    [sampling]
    temperature = 0.8
    max_tokens = 6
    seed = {seed}
"""
#: the tiny Llama (4 query / 2 KV heads) with its reference rows on a two-rank engine
TP_CASE = textwrap.dedent(TINY_CASE.format(seed=7)).replace(
    'model = "tiny-llama"', 'model = "tiny-llama"\nreference_tensor_parallel_size = 2')


#: where the workers import the tests' row hooks and this tree's parity from
TEST_PATH = os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")])
#: what the module's cluster and every run share: Ray rewrites a 127.0.0.1 address to the host's IP
#: unless LOCAL_ONLY_ENV=0, and `ray start` turns token auth on wherever ~/.ray/auth_token exists,
#: so the cluster and its drivers hold a token of the module's own
RAY_ENV = {LOCAL_ONLY_ENV: "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
#: vLLM's engine core and model in the process that starts the engine (its uni executor), in the Ray
#: actors (the module's cluster has it) and in the local run alike: a start of ~2 s instead of ~15 s of
#: two spawned interpreters; the executors, not vLLM's process layout, are what these tests compare
IN_PROCESS_VLLM = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def nightly(out: Path, *args: str, faults: dict | None = None, engine_log: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.Popen:
    """`parity nightly ... --out OUT --no-progress` in its own process and session (a signal to
    it reaches no one else); its workers call `ray_faults.before_row` with `faults`, or with
    `engine_log` record their engines' starts and closes there (`recording_backend.before_row`)."""
    hook = "ray_faults:before_row" if engine_log is None else "recording_backend:before_row"
    env = {**os.environ, **RAY_ENV, "PYTHONPATH": TEST_PATH, ROW_HOOK_ENV: hook,
           FAULTS_ENV: json.dumps(faults or {}),
           **({} if engine_log is None else {ENGINE_LOG_ENV: str(engine_log), START_ENV: "2"}), **(env or {})}
    code = "import sys; from parity.nightly import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.Popen([sys.executable, "-c", code, *args, "--out", str(out), "--no-progress"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out + err


def rows(out: Path, run_id: str) -> dict[str, dict]:
    """The stored rows of a run by key, with the report JSON decoded."""
    with sqlite3.connect(out / "history.sqlite") as db:
        found = db.execute("SELECT row_key, status, error, provenance, abs_diff, report FROM rows "
                           "WHERE run_id = ?", (run_id,)).fetchall()
    return {key: {"status": status, "error": error, "provenance": json.loads(provenance),
                  "abs_diff": zlib.decompress(abs_diff),
                  "report": json.loads(zlib.decompress(report)) if report else None}
            for key, status, error, provenance, abs_diff, report in found}


def row_count(out: Path) -> int:
    with sqlite3.connect(out / "history.sqlite") as db:
        return db.execute("SELECT COUNT(*) FROM rows").fetchone()[0]


def ray_processes(proc: subprocess.Popen) -> list[psutil.Process]:
    """The Ray cluster a nightly process started: its raylet, GCS and workers."""
    return [p for p in descendants(proc.pid)
            if any(name in cmdline(p) for name in (*RAY_PROCESSES, "ray::", "default_worker"))]


def assert_gone(processes: list[psutil.Process]) -> None:
    deadline = time.monotonic() + 30  # Ray's shutdown reaps its processes asynchronously
    while (running := [p for p in processes if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not running, [(p.pid, process_name(p)) for p in running]


def wait_for_rows(out: Path, n: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, finish(proc)
        if (out / "history.sqlite").is_file():
            try:
                if row_count(out) >= n:
                    return
            except sqlite3.OperationalError:  # the tables are being created
                pass
        time.sleep(0.5)
    pytest.fail(f"fewer than {n} rows after {timeout} s")


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """The module's Ray cluster, `ray start --head` on 127.0.0.1 with 2 CPUs, for the runs'
    `--ray-address`: one start (~9 s) instead of one per run. Its workers find the row hooks on
    `TEST_PATH`; it starts without any PARITY_* variable, so the hooks' (and the cache's) reach the
    workers only as each run forwards them (`worker_env`). Stopped at the module's end (failure and
    Ctrl-C included), and by parity's guard should this process die first."""
    sockets = [socket.socket() for _ in range(3)]
    for s in sockets:
        s.bind((LOOPBACK, 0))
    port, client_port, dashboard_port = (s.getsockname()[1] for s in sockets)
    for s in sockets:
        s.close()
    temp = Path(tempfile.mkdtemp(prefix="ray"))  # short: Ray's socket paths must fit 107 bytes
    log = temp / "head.log"
    with log.open("w") as out:
        head = subprocess.Popen(
            [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
             "--node-ip-address", LOOPBACK, "--port", str(port), "--num-cpus", "2",
             "--include-dashboard=false", "--disable-usage-stats", "--temp-dir", str(temp),
             "--ray-client-server-port", str(client_port), "--dashboard-port", str(dashboard_port),
             "--system-config", json.dumps({"worker_niceness": 0})],  # as parity's own local cluster
            env={**{k: v for k, v in os.environ.items() if not k.startswith("PARITY_")}, **RAY_ENV,
                 **IN_PROCESS_VLLM, "PYTHONPATH": TEST_PATH}, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)
    track(head.pid)
    try:
        deadline = time.monotonic() + 180
        while "Ray runtime started" not in log.read_text():
            assert head.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        yield f"{LOOPBACK}:{port}"
    finally:
        cluster = descendants(head.pid)
        if head.poll() is None:
            cluster.insert(0, psutil.Process(head.pid))
        terminate(cluster)
        assert_gone(cluster)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def tiny_cases(tmp_path: Path) -> Path:
    """Three one-engine cases (reference, tiny-llama, bfloat16): a, b, c."""
    cases = tmp_path / "cases"
    cases.mkdir()
    for seed, name in enumerate("abc"):
        (cases / f"{name}.toml").write_text(textwrap.dedent(TINY_CASE.format(seed=seed)))
    return cases


# -- without a cluster -----------------------------------------------------------------------

def test_rows_are_split_per_engine_over_the_slots_in_matrix_order():
    todo = plan(load_cases(f"{ROOT / 'cases' / 'smoke.toml'},{ROOT / 'cases' / 'moe.toml'}"),
                ("reference", "hf"))
    # five engines (smoke x 2 backends, moe x 2 backends, moe R3 on reference), two slots: each
    # engine's rows whole on the shorter queue, in matrix order
    queues = [[(str(r.key), r.last) for r in q] for q in assign(todo, "cpu", slots=2)]
    # each engine's last row on its actor is marked: the actor closes the engine after it
    assert queues == [
        [("smoke|reference|bfloat16|", True), ("moe|reference|bfloat16|none", True),
         ("moe|reference|bfloat16|R3", True)],
        [("smoke|hf|bfloat16|", True), ("moe|hf|bfloat16|none", True)]], queues
    one_engine = [(k, c) for k, c in todo if k.backend == "reference" and k.case == "smoke"] * 5
    # one engine split over both actors: each closes its copy after its own last row
    assert [[r.last for r in q] for q in assign(one_engine, "cpu", slots=2)] == [[False, False, True],
                                                                                  [False, True]]
    assert len(assign(todo, "cpu", slots=64)) == 5  # no more actors than rows
    assert row_resources("cpu") == {"num_cpus": 1.0, "num_gpus": 0.0}
    assert row_resources("cuda") == {"num_cpus": 1.0, "num_gpus": 1.0}
    # a tensor-parallel reference engine asks for a CPU and (on CUDA) a GPU per rank
    assert row_resources("cpu", 2) == {"num_cpus": 2.0, "num_gpus": 0.0}
    assert row_resources("cuda", 4) == {"num_cpus": 4.0, "num_gpus": 4.0}


def test_a_tensor_parallel_case_is_its_own_engine_on_reference_rows_only(tiny_cases):
    tp = tiny_cases / "tp.toml"
    tp.write_text(TP_CASE)
    todo = plan(load_cases(f"{tiny_cases / 'a.toml'},{tp}"), ("reference", "hf"))
    options = {str(k): engine_options(k, c, "cuda") for k, c in todo}
    assert options["tp|reference|bfloat16|"] == {"device": "cuda", "tensor_parallel_size": 2}
    assert options["tp|hf|bfloat16|"] == options["a|hf|bfloat16|"] == {"device": "cuda"}
    assert options["a|reference|bfloat16|"] == {"device": "cuda"}
    assert [tensor_parallel(k, c) for k, c in todo] == [None, None, 2, None]
    # the TP engine is a group of its own: three engines over three slots, one each
    assert sorted(len(q) for q in assign(todo, "cpu", slots=3)) == [1, 1, 2]


@pytest.mark.parametrize(("options", "match"), [
    ({"executor": "dask"}, "--executor 'dask'"),
    ({"ray_address": "auto"}, "need --executor ray"),
    ({"executor": "ray", "ray_cpus": 0}, "--ray-cpus must be a whole number"),
    ({"executor": "ray", "ray_cpus": 2, "ray_address": "auto"}, "sizes a local cluster"),
    ({"device": "tpu"}, "--device 'tpu'"),
    ({"engine_memory_gib": 4.0}, "need --executor ray"),
    ({"executor": "ray", "engine_memory_gib": 0}, "--engine-memory must be a number of GiB above 0"),
    ({"executor": "ray", "engine_memory_gib": float("nan")}, "--engine-memory must be"),
])
def test_executor_options_are_checked(options, match):
    with pytest.raises(ConfigError, match=match):
        NightlyConfig(cases="cases/smoke.toml", **options)


def test_the_row_workers_get_the_drivers_parity_variables(monkeypatch):
    """What a run hands its workers through Ray's runtime_env: every PARITY_* variable, nothing else
    (the hooks of the runs below reach the module's cluster this way)."""
    monkeypatch.setenv("PARITY_TEST_SOMETHING", "1")
    monkeypatch.setenv("NOT_PARITY_TEST", "2")
    env = worker_env()
    assert env["PARITY_TEST_SOMETHING"] == "1" and "NOT_PARITY_TEST" not in env
    assert env == {k: v for k, v in os.environ.items() if k.startswith("PARITY_")}


# -- on a Ray cluster (the module's, or for Ctrl-C its own) ------------------------------------

@pytest.fixture(scope="module")
def ray_and_local(tmp_path_factory: pytest.TempPathFactory, ray_address: str) -> tuple[dict, dict]:
    """One matrix run under each executor, for the two tests that compare them: the acceptance
    cases (smoke and moe) cut to one vLLM engine per run (each start is 30-130 s on two cores):
    smoke on reference and hf, moe with R3 routing replay on reference and vLLM (so every backend,
    and routes, cross Ray); and the tiny Llama's reference rows on a two-rank engine (`TP_CASE`),
    which on the 2-CPU cluster waits for both CPUs. Returns the Ray run's and the local run's rows.
    (The two tests ran a pair of nightlies each: one pair saves two drivers and an actor start.)"""
    missing = {b: why for b, why in available_backends().items() if b in ("hf", "vllm") and why is not None}
    if missing:
        pytest.skip(f"backends not usable here: {missing}")
    tmp = tmp_path_factory.mktemp("ray_and_local")
    cases = tmp / "cases"
    cases.mkdir()
    smoke, moe = (ROOT / "cases" / f"{name}.toml" for name in ("smoke", "moe"))
    (cases / "smoke.toml").write_text('backends = ["reference", "hf"]\n' + smoke.read_text())
    moe_r3 = moe.read_text().replace('router_replay = ["none", "R3"]', 'router_replay = ["R3"]')
    assert moe_r3 != moe.read_text()
    (cases / "moe.toml").write_text('backends = ["reference", "vllm"]\n' + moe_r3)
    (cases / "tp.toml").write_text('backends = ["reference"]\n' + TP_CASE)
    args = ("--cases", str(cases), "--backends", "reference,hf,vllm", "--run-id", "r")
    ray_code, ray_log = finish(nightly(tmp / "ray", *args, "--executor", "ray", "--ray-address", ray_address))
    local_code, local_log = finish(nightly(tmp / "local", *args, env=IN_PROCESS_VLLM))
    assert ray_code == local_code == 0, (ray_log, local_log)
    return rows(tmp / "ray", "r"), rows(tmp / "local", "r")


@needs_ray
@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.own_engines
def test_ray_rows_equal_local_rows_bit_for_bit(ray_and_local):
    """Every row of the matrix (`ray_and_local`) under both executors: same rows and statuses, the
    same token ids and logprobs to the bit."""
    on_ray, local = ray_and_local
    assert sorted(on_ray) == sorted(local) and len(local) == 2 + 2 + 1, (sorted(on_ray), sorted(local))
    assert {key.split("|")[1] for key in local} == {"reference", "hf", "vllm"}, sorted(local)
    for key, row in local.items():
        other = on_ray[key]
        ran_on = other["provenance"]["ran_on"]
        assert ran_on["executor"] == "ray" and ran_on["node_ip"] == "127.0.0.1", (key, ran_on)
        assert row["provenance"]["ran_on"]["executor"] == "local", key
        assert other["status"] == row["status"] == "pass", key
        for name in ("token_ids", "rollout_logprobs", "train_logprobs", "mask"):
            a, b = (np.asarray(r["report"]["arrays"][name]["data"]) for r in (other, row))
            assert a.dtype == b.dtype and np.array_equal(a, b), (key, name)
        assert other["abs_diff"] == row["abs_diff"] and other["report"]["summary"] == row["report"]["summary"]
    # the comparison has teeth: the backends' own rollouts differ from each other
    logprobs = {k.split("|")[1]: np.asarray(r["report"]["arrays"]["rollout_logprobs"]["data"])
                for k, r in local.items() if k.startswith("smoke|")}
    assert not np.array_equal(logprobs["reference"], logprobs["hf"])


@needs_ray
@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.own_engines
def test_a_tensor_parallel_reference_row_takes_two_cpus_and_equals_the_local_row(ray_and_local):
    """The reference row with reference_tensor_parallel_size = 2 in the matrix (`ray_and_local`) on
    the 2-CPU cluster: its actor holds both CPUs (every other row's one), its two ranks give the
    rollout the local executor gives, and both match the TP-invariant training forward exactly."""
    on_ray, local = ray_and_local
    key = "tp|reference|bfloat16|"
    assert key in on_ray and key in local, (sorted(on_ray), sorted(local))
    for stored in (on_ray[key], local[key]):
        provenance = stored["provenance"]
        assert provenance["backend_meta"]["tensor_parallel_size"] == 2, provenance["backend_meta"]
        assert provenance["train_tensor_parallel"]["tensor_parallel_size"] == 1, provenance
        assert stored["status"] == "pass" and stored["report"]["summary"]["max_abs_logprob_diff"] == 0.0
    for name in ("token_ids", "rollout_logprobs", "train_logprobs"):
        a, b = (np.asarray(r[key]["report"]["arrays"][name]["data"]) for r in (on_ray, local))
        assert np.array_equal(a, b), name
    # what each row's actor held: a CPU per engine process
    held = {k: r["provenance"]["ran_on"]["resources"] for k, r in on_ray.items()}
    assert held == {k: {"CPU": 2.0 if k == key else 1.0} for k in on_ray}, held


def engine_spans(log: Path) -> list[tuple[float, float, int, str]]:
    """(start, close, pid, engine) of each engine the workers started; close inf if never closed."""
    found, spans = {}, []
    for e in events(log):
        if e["event"] == "start":
            assert (e["pid"], e["engine"]) not in found, e
            found[e["pid"], e["engine"]] = e["t"]
        elif e["event"] == "close":
            spans.append((found.pop((e["pid"], e["engine"])), e["t"], e["pid"], e["engine"]))
    return spans + [(t, float("inf"), pid, engine) for (pid, engine), t in found.items()]


def most_open_at_once(spans: list[tuple[float, float, int, str]]) -> int:
    moments = sorted([(start, 1) for start, *_ in spans] + [(close, -1) for _, close, *_ in spans])
    running, most = 0, 0
    for _, step in moments:
        running += step
        most = max(most, running)
    return most


@needs_ray
@pytest.mark.slow
def test_ray_actors_close_each_engine_after_its_last_row_within_the_memory_bound(tmp_path, ray_address):
    """Four engines (two models on reference and hf) over two actors, two each, each start made 2 s
    longer: each actor closes each engine before it starts its next; with --engine-memory below two
    engines' estimates (0.38 GiB each) they run one at a time, and without it (the control) two
    actors hold engines at once."""
    cases = tmp_path / "cases"
    cases.mkdir()
    for seed, model in enumerate(("tiny-llama", "tiny-qwen2")):
        (cases / f"{model}.toml").write_text(textwrap.dedent(TINY_CASE.format(seed=seed)).replace(
            '"tiny-llama"', f'"{model}"'))
    args = ("--cases", str(cases), "--backends", "reference,hf", "--executor", "ray",
            "--ray-address", ray_address)
    bounded, free = tmp_path / "bounded.jsonl", tmp_path / "free.jsonl"
    code, log = finish(nightly(tmp_path / "b", *args, "--run-id", "b", "--engine-memory", "0.4",
                               engine_log=bounded))
    assert code == 0 and len(rows(tmp_path / "b", "b")) == 4, log
    code, log = finish(nightly(tmp_path / "f", *args, "--run-id", "f", engine_log=free))
    assert code == 0 and len(rows(tmp_path / "f", "f")) == 4, log
    for spans in (engine_spans(bounded), engine_spans(free)):
        assert len(spans) == 4 and all(close < float("inf") for _, close, *_ in spans), spans
        for pid in {pid for *_, pid, _ in spans}:  # one engine at a time in each actor
            assert most_open_at_once([s for s in spans if s[2] == pid]) == 1, spans
        # both actors ran rows, two engines each (so "one at a time" in an actor has teeth)
        assert sorted(Counter(pid for *_, pid, _ in spans).values()) == [2, 2], spans
    assert most_open_at_once(engine_spans(bounded)) == 1
    assert most_open_at_once(engine_spans(free)) == 2


@needs_ray
@pytest.mark.slow
@pytest.mark.own_engine(reason="kills the Ray worker that holds a row's engine")
def test_a_killed_worker_is_retried_once_then_its_row_is_an_error_and_resume_reruns_it(tmp_path, tiny_cases,
                                                                                       ray_address):
    out, a, b = tmp_path / "reports", "a|reference|bfloat16|", "b|reference|bfloat16|"
    proc = nightly(out, "--cases", str(tiny_cases), "--backends", "reference", "--run-id", "k",
                   "--executor", "ray", "--ray-address", ray_address,
                   faults={"kill": {a: 1, b: 99}, "counts": str(tmp_path)})
    code, log = finish(proc)
    stored = rows(out, "k")
    # a: killed once, retried on the restarted actor, passed; b: killed on its try and its retry
    assert code == 2 and kills(tmp_path, a) == 1 and kills(tmp_path, b) == 2, log
    statuses = {k: r["status"] for k, r in stored.items()}
    assert statuses == {a: "pass", b: "error", "c|reference|bfloat16|": "pass"}
    assert "the Ray worker running this row died" in stored[b]["error"] and row_count(out) == 3
    # a run started on Ray is finished by the local executor: only the error row runs again
    code, log = finish(nightly(out, "--resume", "k"))
    stored = rows(out, "k")
    assert code == 0 and row_count(out) == 3 and {r["status"] for r in stored.values()} == {"pass"}, log
    assert stored[b]["provenance"]["ran_on"]["executor"] == "local"
    assert stored[a]["provenance"]["ran_on"]["executor"] == "ray"


@needs_ray
@pytest.mark.slow
@pytest.mark.own_engine(reason="interrupts the nightly (SIGINT) and checks that its Ray cluster is gone")
def test_ctrl_c_cancels_the_ray_rows_stops_the_cluster_and_resume_finishes_the_run(tmp_path, tiny_cases,
                                                                                   ray_address):
    """The interrupted run starts its own cluster (that it stops it is the point); the resume runs on
    the module's."""
    out, c = tmp_path / "reports", "c|reference|bfloat16|"
    proc = nightly(out, "--cases", str(tiny_cases), "--backends", "reference", "--run-id", "s", "--executor",
                   "ray", "--ray-cpus", "2", faults={"sleep": {c: 600}})
    wait_for_rows(out, 2, proc)  # a and b are stored; c sleeps in its worker
    cluster = ray_processes(proc)
    names = {process_name(p) for p in cluster}
    assert set(RAY_PROCESSES) <= names, names
    listening = listening_addresses(cluster)
    assert listening and listening <= {"127.0.0.1", "::ffff:127.0.0.1"}, listening
    proc.send_signal(signal.SIGINT)
    code, log = finish(proc, timeout=120)
    assert code == 130 and "parity nightly --resume s" in log and "--executor ray" in log, log
    assert_gone(cluster)
    assert row_count(out) == 2
    code, log = finish(nightly(out, "--resume", "s", "--executor", "ray", "--ray-address", ray_address))
    stored = rows(out, "s")
    assert code == 0 and row_count(out) == 3, log
    assert sorted(stored) == [f"{n}|reference|bfloat16|" for n in "abc"]
    assert stored[c]["provenance"]["ran_on"]["executor"] == "ray", log


@needs_ray
@pytest.mark.gpu
@pytest.mark.skipif(not importlib.util.find_spec("torch") or not __import__("torch").cuda.device_count() >= 2,
                    reason="needs two CUDA GPUs: reference rows on --device cuda spread over both")
def test_gpu_reference_rows_spread_over_two_gpus(tmp_path, tiny_cases):
    out = tmp_path / "reports"
    code, log = finish(nightly(out, "--cases", str(tiny_cases), "--backends", "reference", "--device", "cuda",
                               "--run-id", "g", "--executor", "ray"))
    stored = rows(out, "g")
    assert code == 0 and len(stored) == 3, log
    gpus = {tuple(r["provenance"]["ran_on"]["gpu_ids"]) for r in stored.values()}
    assert len(gpus) == 2 and all(len(g) == 1 for g in gpus), gpus
    assert all(r["report"]["summary"]["max_abs_logprob_diff"] == 0.0 for r in stored.values())


