"""The Ray executor: nightly rows on the actors of a Ray cluster, streamed back as they finish.

Rows are grouped by engine and by resource ask (`row_resources`); engine groups go whole to
actors (`assign`), each starting an engine once and closing it after its last row. Each actor
gets its next row when the last returns, and an engine row only when it fits the
`MemoryBudget`. Dead actors restart and retry once; twice is an error row. Actors are killed
and a cluster we started is shut down when the run ends.
"""

from __future__ import annotations

import importlib
import math
import os
import socket
from collections import deque
from collections.abc import Iterator
from typing import Any

from parity.core.errors import ConfigError
from parity.nightly.engines import EngineKey, PlannedRow, by_engine, engine_order
from parity.nightly.execute import error_row, execute_row, tensor_parallel
from parity.nightly.memory import GIB, EngineNeed, MemoryBudget
from parity.nightly.rows import RowKey, RowResult
from parity.workload.cases import Case

#: `module:function` that every worker calls with a row's key (`str(RowKey)`) before running the
#: row: the fault-injection point of the worker-death tests. Unset in normal runs.
ROW_HOOK_ENV = "PARITY_NIGHTLY_ROW_HOOK"
LOOPBACK = "127.0.0.1"
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
#: the driver's environment variables with this prefix are set in every row worker (the run's Ray
#: runtime_env): a cluster started elsewhere (--ray-address) has its own environment, where a
#: local cluster's workers inherit the driver's
FORWARDED_PREFIX = "PARITY_"


def worker_env() -> dict[str, str]:
    """The variables the row workers get from this process: every PARITY_* one (the cache, the row
    hook, the engine-log switch)."""
    return {name: value for name, value in os.environ.items() if name.startswith(FORWARDED_PREFIX)}


def row_resources(device: str, tensor_parallel: int | None = None) -> dict[str, float]:
    """What one row asks Ray for: a CPU, and on "cuda" a GPU, per process of its engine: one,
    or a tensor-parallel reference engine's ranks (each rank a process on its own GPU; Ray gives
    the actor those GPUs as its `CUDA_VISIBLE_DEVICES`)."""
    processes = float(tensor_parallel or 1)
    return {"num_cpus": processes, "num_gpus": processes if device == "cuda" else 0.0}


class RayCluster:
    """A Ray cluster for one run: address None starts a local 127.0.0.1 cluster shut down with the block
    (also on errors and Ctrl-C); an address connects and leaves it running. Either way the run's
    workers get this process's PARITY_* variables (`worker_env`).
    """

    def __init__(self, *, address: str | None = None, num_cpus: int | None = None) -> None:
        self.address = address
        self.num_cpus = num_cpus

    def __enter__(self) -> RayCluster:
        if self.address is None:
            # Ray puts a local node on loopback only where it does not support clusters (macOS,
            # Windows); this switch gives that here, so the GCS, raylet and workers listen on
            # 127.0.0.1. Ray reads it once, at import; the check after `init` proves it held.
            os.environ[LOCAL_ONLY_ENV] = "0"
        try:
            import ray  # the optional Ray extra: the local executor never loads it
        except ImportError as exc:
            raise ConfigError("--executor ray needs Ray: pip install 'parity-harness[ray]' (or pick "
                              "--executor local)") from exc
        if ray.is_initialized():
            raise ConfigError("--executor ray: this process is already connected to Ray; parity connects "
                              "by itself (give the cluster as --ray-address)")
        common: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                  "logging_level": "WARNING", "namespace": "parity-nightly",
                                  "runtime_env": {"env_vars": worker_env()}}
        try:
            if self.address is None:
                # Ray starts workers at niceness 15 to keep its own daemons responsive; here the
                # workers are the run, and niced they starve behind any other load on the host.
                ray.init(num_cpus=self.num_cpus or os.cpu_count() or 1, _system_config={"worker_niceness": 0},
                         **common)
            else:
                ray.init(address=self.address, **common)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            ray.shutdown()
            raise ConfigError(f"--ray-address {self.address!r}: cannot connect ({exc}); start the head "
                              "with `ray start --head` and give its address") from exc
        if self.address is None and {n["NodeManagerAddress"] for n in ray.nodes()} != {LOOPBACK}:
            ray.shutdown()
            raise ConfigError(f"--executor ray: the local Ray cluster would listen beyond {LOOPBACK} "
                              f"because Ray was imported before parity set {LOCAL_ONLY_ENV}=0; set it in "
                              "the environment, or start a cluster yourself and give --ray-address")
        return self

    def __exit__(self, *exc: object) -> None:
        import ray  # the optional Ray extra: the local executor never loads it

        ray.shutdown()  # a cluster ray.init started goes with it; an existing one is only left

    def slots(self, resources: dict[str, float]) -> int:
        """How many rows asking for `resources` the cluster holds at once (0: none fits)."""
        import ray  # the optional Ray extra: the local executor never loads it

        total = ray.cluster_resources()
        return min(math.floor(total.get(name, 0.0) / amount) for name, amount in
                   (("CPU", resources["num_cpus"]), ("GPU", resources["num_gpus"])) if amount > 0)


class RowWorker:
    """A Ray actor that runs rows; each engine it starts lives until its last row there."""

    def run(self, run_id: str, key: RowKey, case: Case, reference: str, device: str,
            close_engine: bool = False, gold: bool | None = None) -> RowResult:
        """One row, as `execute_row` runs it, with this node, process and GPUs as its placement;
        `close_engine`: it is its engine's last row on this actor."""
        import ray  # the optional Ray extra: the local executor never loads it

        hook = os.environ.get(ROW_HOOK_ENV)
        if hook:
            module, _, function = hook.partition(":")
            getattr(importlib.import_module(module), function)(str(key))
        context = ray.get_runtime_context()
        placement = {"executor": "ray", "host": socket.gethostname(), "node_id": context.get_node_id(),
                     "actor_id": context.get_actor_id(),
                     "pid": os.getpid(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                     "resources": context.get_assigned_resources()}
        return execute_row(run_id, key, case, reference=reference, device=device, gold=gold,
                           placement=placement, close_engine=close_engine)


def assign(todo: list[tuple[RowKey, Case]], device: str, slots: int) -> list[deque[PlannedRow]]:
    """Rows split into at most `slots` actor queues, one engine's rows together with its last marked:
    engines go whole to the shortest queue, or with fewer engines than slots, round robin.
    """
    groups = list(by_engine(todo, device).values())
    if len(groups) < slots:
        queues = []
        for rows in groups:
            n = min(len(rows), slots // len(groups))
            queues += [rows[i::n] for i in range(n)]
    else:
        queues = [[] for _ in range(slots)]
        for rows in groups:
            min(queues, key=len).extend(rows)
    return [deque(engine_order(queue, device)) for queue in queues]


def memory_budget(cluster: RayCluster, engine_memory_gib: float | None) -> MemoryBudget | None:
    """The budget the actors' engines share (see the module doc); None: unbounded."""
    limit = None if engine_memory_gib is None else int(engine_memory_gib * GIB)
    if cluster.address is None:
        return MemoryBudget(limit)
    return None if limit is None else MemoryBudget(limit, available=lambda: limit)


def ray_rows(cluster: RayCluster, run_id: str, todo: list[tuple[RowKey, Case]], *, reference: str,
             device: str, engine_memory_gib: float | None = None,
             gold: bool | None = None) -> Iterator[RowResult]:
    """Run `todo` on the cluster; yields each row (unjudged) as it finishes. Closing the
    generator (the run ended, failed or was interrupted) kills every actor, which cancels the
    rows still running or waiting."""
    import ray  # the optional Ray extra: the local executor never loads it

    if not todo:
        return
    by_degree: dict[int | None, list[tuple[RowKey, Case]]] = {}
    for key, case in todo:
        by_degree.setdefault(tensor_parallel(key, case), []).append((key, case))
    plans = []
    for degree, rows in by_degree.items():
        resources = row_resources(device, degree)
        slots = cluster.slots(resources)
        if slots < 1:
            raise ConfigError(f"--executor ray: no node of the cluster has {resources} for row "
                              f"{rows[0][0].label!r}; add one, lower the case's "
                              "reference_tensor_parallel_size, or run on --device cpu")
        actor_class = ray.remote(RowWorker).options(**resources, max_restarts=-1, max_task_retries=1)
        plans += [(actor_class, queue) for queue in assign(rows, device, slots)]
    needs: dict[EngineKey, EngineNeed] = {row.engine: row.engine.need()
                                          for _, queue in plans for row in queue}
    budget = memory_budget(cluster, engine_memory_gib)
    holds: dict[int, EngineKey] = {}  # actor index -> the engine it holds, reserved in the budget
    waiting: deque[int] = deque()  # actors whose next row waits for its turn or for memory
    inflight: dict[Any, tuple[int, PlannedRow]] = {}
    actors: dict[int, Any] = {}  # started when their first row is sent
    queues = [queue for _, queue in plans]
    node_ips: dict[str, str] = {}

    def submit(i: int) -> None:
        row = queues[i][0]
        if holds.get(i) != row.engine:
            if budget is not None:
                if not budget.fits(needs[row.engine]):
                    waiting.append(i)
                    return
                budget.reserve(i, needs[row.engine])
            holds[i] = row.engine
        queues[i].popleft()
        if i not in actors:
            actors[i] = plans[i][0].remote()
        ref = actors[i].run.remote(run_id, row.key, row.case, reference, device, row.last, gold)
        inflight[ref] = (i, row)

    try:
        for i in range(len(plans)):
            submit(i)
        while inflight:
            [ref], _ = ray.wait(list(inflight), num_returns=1)
            i, planned = inflight.pop(ref)
            key, case = planned.key, planned.case
            try:
                row = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                row = error_row(run_id, key, "the Ray worker running this row died, and again when the row "
                                f"was retried: {type(exc).__name__}: {str(exc)[:500]}",
                                {"case": case.name, "case_hash": case.hash, "model": case.model,
                                 "ran_on": {"executor": "ray"}})
            except ray.exceptions.RayError as exc:
                row = error_row(run_id, key, f"the Ray task failed: {type(exc).__name__}: {str(exc)[:500]}",
                                {"case": case.name, "case_hash": case.hash, "model": case.model,
                                 "ran_on": {"executor": "ray"}})
            ran_on = row.provenance.get("ran_on", {})
            if "node_id" in ran_on:  # the address Ray knows the node by (a worker sees only its host)
                if ran_on["node_id"] not in node_ips:
                    node_ips.update({n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()})
                ran_on["node_ip"] = node_ips.get(ran_on["node_id"], "")
            if planned.last:  # the actor closed the engine after this row
                holds.pop(i, None)
                if budget is not None:
                    budget.release(i)
            if queues[i]:
                waiting.append(i)  # behind the actors already waiting for memory
            else:
                ray.kill(actors[i])  # its process and what is left in it go now
            for _ in range(len(waiting)):
                submit(waiting.popleft())
            yield row
    finally:
        for actor in actors.values():
            ray.kill(actor)
