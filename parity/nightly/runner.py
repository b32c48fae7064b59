"""The nightly matrix runner: cases x backends x dtypes (x router-replay variants, or prefix cache
on/off for trajectory cases on backends that have one), one row each.

An executor runs the rows (`parity.nightly.execute`) and hands each back as it finishes: "local"
runs them one after another in this process, "ray" on the actors of a Ray cluster
(`parity.nightly.ray_executor`). This process alone judges a row against its baseline and
commits it to the history, one transaction per row as it arrives, so a killed run keeps its
finished work and `resume` (under either executor) runs only what is missing (error rows are
retried). Each executing process runs its rows grouped by engine (backend, model, dtype,
options; `parity.nightly.engines`): the engine starts once through `shared_backend`, serves its
rows, and is closed right after the last of them, so a process holds one engine at a time and
the Ray executor starts one only when it fits in memory (`parity.nightly.memory`). An engine that
dies in a row is closed with that row (an error row) and started again for the next; one that
cannot start for want of memory is an error row saying what it needed and what was free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import itertools
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from parity.backends import (
    BACKENDS,
    available_backends,
    lora_backends,
    prefix_cache_backends,
    route_recording_backends,
)
from parity.backends.borrowed import resolve_device
from parity.core.errors import ConfigError, ParityError
from parity.core.outputs import output_dir, output_file
from parity.core.schema import (
    BASELINE_RECOMMENDATION_KEY,
    DISTRIBUTION_SUMMARY_KEYS,
    DTYPES,
    KERNEL_MODES,
    RECOMMENDATION_KEY,
)
from parity.models.lora import check_adapter
from parity.nightly.engines import engine_order
from parity.nightly.environment import collect_environment
from parity.nightly.execute import PREFIX_CACHE as _PREFIX_CACHE
from parity.nightly.execute import execute_row, prefix_cache_variant
from parity.nightly.history import History, RunInfo
from parity.nightly.lock import RunLock
from parity.nightly.noise import AUDIT, backend_noise
from parity.nightly.publish import publish
from parity.nightly.regression import RegressionPolicy, compare_drift, distribution_verdict, judge_with_noise
from parity.nightly.rows import RowKey, RowResult, check_run_id, exit_code, row_status
from parity.workload.cases import Case, load_cases

AUTO = "auto"
EXECUTORS = ("local", "ray")
DEVICES = (AUTO, "cpu", "cuda")


@dataclass(frozen=True)
class NightlyConfig:
    """What one nightly run does.

    cases: a `load_cases` spec (directory, file, or comma-separated files and names).
    backends: backend names, or ("auto",) for every backend usable here.
    dtypes: dtypes to run every case in; empty = each case's own `dtypes`.
    out: report directory; each run writes `<out>/<run_id>/`.
    history: SQLite history file; None = `<out>/history.sqlite`.
    run_id: None = a new id from the UTC time (a "-2", "-3", ... suffix when that id is taken).
    baseline: compare every row with this run's row of the same key; None = the last passing
        run of each row.
    reference: training-forward kernels, "invariant" or "native" (see `parity.compare`).
    device: where the reference and hf engines and the training forward run, "cpu" or "cuda"
        (a row on "cuda" asks its executor for one GPU); "auto" (default): cuda when one of the
        backends runs there (vLLM or SGLang on a CUDA host, `parity.backends.borrowed`), else cpu.
    executor: "local" (rows one after another in this process) or "ray" (rows on Ray actors).
    ray_address: the Ray cluster to run on ("auto", "ray://host:10001", "host:6379"); None = start
        a local one on 127.0.0.1 for this run and stop it after.
    ray_cpus: CPUs of that local cluster; None = this machine's count.
    engine_memory_gib: most host memory the Ray actors' engines may hold at once, GiB (estimates,
        `parity.nightly.memory`); None = what is available when the run starts. The local
        executor holds one engine at a time.
    gold: run the gold forward in every compare row (True), in none (False), or where it costs
        under a second or at most 20% of the row's time (None; `parity.compare`'s `gold`).
    lora: a LoRA adapter every case runs with (`with_lora`); None = each case's own `lora`.
    """

    cases: str
    backends: tuple[str, ...] = (AUTO,)
    dtypes: tuple[str, ...] = ()
    out: Path = Path("reports")
    history: Path | None = None
    run_id: str | None = None
    baseline: str | None = None
    policy: RegressionPolicy = field(default_factory=RegressionPolicy)
    reference: str = "invariant"
    device: str = AUTO
    executor: str = "local"
    ray_address: str | None = None
    ray_cpus: int | None = None
    engine_memory_gib: float | None = None
    gold: bool | None = None
    lora: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.cases, str):
            raise ConfigError("--cases must be a string (a directory, a file, or comma-separated "
                              f"files/names), got {self.cases!r}")
        for option, value in (("--backends", self.backends), ("--dtypes", self.dtypes)):
            if isinstance(value, str) or not isinstance(value, (tuple, list)) \
                    or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{option} must be a list of names, got {value!r}")
        for option, value in (("--out", self.out), ("--history", self.history)):
            if not isinstance(value, (str, os.PathLike)) and not (option == "--history" and value is None):
                raise ConfigError(f"{option} must be a path, got {value!r}")
        for option, value in (("--run-id", self.run_id), ("--baseline", self.baseline),
                              ("--reference", self.reference), ("--ray-address", self.ray_address),
                              ("--lora", self.lora)):
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"{option} must be a string, got {value!r}")
        if not isinstance(self.policy, RegressionPolicy):
            raise ConfigError(f"policy must be a parity RegressionPolicy, got {type(self.policy).__name__}")
        object.__setattr__(self, "out", Path(self.out))
        if self.history is not None:
            object.__setattr__(self, "history", Path(self.history))
        object.__setattr__(self, "backends", tuple(self.backends))
        object.__setattr__(self, "dtypes", tuple(self.dtypes))
        if not self.backends:
            raise ConfigError(f"--backends is empty; give '{AUTO}' or names from {list(BACKENDS)}")
        if self.backends != (AUTO,):
            bad = [b for b in self.backends if b not in BACKENDS]
            if bad:
                raise ConfigError(f"--backends: unknown {bad}; allowed: '{AUTO}' or names from "
                                  f"{list(BACKENDS)}")
        bad = [d for d in self.dtypes if d not in DTYPES]
        if bad:
            raise ConfigError(f"--dtypes: unknown {bad}; allowed: {list(DTYPES)}")
        if self.reference not in KERNEL_MODES:
            raise ConfigError(f"--reference {self.reference!r}; allowed: {list(KERNEL_MODES)}")
        if self.gold is not None and not isinstance(self.gold, bool):
            raise ConfigError(f"gold must be True, False or None (--gold / --no-gold), got {self.gold!r}")
        for option, value, allowed in (("--device", self.device, DEVICES),
                                       ("--executor", self.executor, EXECUTORS)):
            if value not in allowed:
                raise ConfigError(f"{option} {value!r}; allowed: {list(allowed)}")
        if self.device == AUTO:
            object.__setattr__(self, "device", resolve_device(AUTO, resolve_backends(self.backends)))
        if self.executor != "ray" and (self.ray_address is not None or self.ray_cpus is not None
                                       or self.engine_memory_gib is not None):
            raise ConfigError("--ray-address, --ray-cpus and --engine-memory need --executor ray")
        memory = self.engine_memory_gib
        if memory is not None and (isinstance(memory, bool) or not isinstance(memory, (int, float))
                                   or not 0 < memory < float("inf")):
            raise ConfigError(f"--engine-memory must be a number of GiB above 0, got {memory!r}")
        if self.ray_cpus is not None and (isinstance(self.ray_cpus, bool)
                                          or not isinstance(self.ray_cpus, int) or self.ray_cpus < 1):
            raise ConfigError(f"--ray-cpus must be a whole number >= 1, got {self.ray_cpus!r}")
        if self.ray_address is not None and self.ray_cpus is not None:
            raise ConfigError("--ray-cpus sizes a local cluster; an existing one (--ray-address) has its own")
        for option, value in (("--run-id", self.run_id), ("--baseline", self.baseline)):
            if value is not None:
                check_run_id(value, option=option)

    @property
    def history_path(self) -> Path:
        return self.history if self.history is not None else self.out / "history.sqlite"

    def to_record(self) -> dict[str, Any]:
        """The options that define the matrix and the verdicts, stored with the run for `--resume`."""
        return {"cases": self.cases, "backends": list(self.backends), "dtypes": list(self.dtypes),
                "baseline": self.baseline, "reference": self.reference, "device": self.device,
                "gold": self.gold, "lora": self.lora, **asdict(self.policy)}

    @classmethod
    def from_record(cls, record: dict[str, Any], *, out: Path, history: Path | None, run_id: str,
                    executor: str = "local", ray_address: str | None = None,
                    ray_cpus: int | None = None, engine_memory_gib: float | None = None) -> NightlyConfig:
        """The stored run's matrix; where it runs (the executor) is this invocation's choice."""
        return cls(cases=record["cases"], backends=tuple(record["backends"]), dtypes=tuple(record["dtypes"]),
                   out=out, history=history, run_id=run_id, baseline=record["baseline"],
                   reference=record["reference"], device=record.get("device", "cpu"), gold=record.get("gold"),
                   lora=record.get("lora"),
                   policy=RegressionPolicy(alpha=record["alpha"], min_effect=record["min_effect"]),
                   executor=executor, ray_address=ray_address, ray_cpus=ray_cpus,
                   engine_memory_gib=engine_memory_gib)


@dataclass(frozen=True)
class NightlyRun:
    """A finished run: its rows in matrix order, where the report went and the exit code."""

    run: RunInfo
    rows: list[RowResult]
    report_dir: Path
    exit_code: int


def resolve_backends(backends: tuple[str, ...]) -> tuple[str, ...]:
    """("auto",) -> every backend whose package is installed here, in registry order."""
    if backends == (AUTO,):
        return tuple(name for name, reason in available_backends().items() if reason is None)
    return backends


def plan(cases: list[Case], backends: tuple[str, ...],
         dtypes: tuple[str, ...] = ()) -> list[tuple[RowKey, Case]]:
    """The matrix in run order: case, router-replay variant, backend, dtype. A case that lists
    its backends runs only on those; R3 runs only on backends that can record routes (a backend
    without a `route_option` cannot feed R3, so its cell is left out rather than recorded as an
    error no setting could fix), and a case with a LoRA adapter only on backends that apply one
    (`lora_backends`), for the same reason; `dtypes` overrides every case's own dtypes."""
    recording, switchable, adapting = route_recording_backends(), prefix_cache_backends(), lora_backends()
    cells = []
    for case in sorted(cases, key=lambda c: c.kind != AUDIT):  # audits first: their noise judges the rest
        for variant in case.router_replay or [prefix_cache_variant(v) for v in case.prefix_caching] or ("",):
            for backend in backends:
                if (case.backends and backend not in case.backends) or \
                        (variant == "R3" and backend not in recording) or \
                        (case.lora is not None and backend not in adapting):
                    continue
                if variant.startswith(_PREFIX_CACHE) and backend not in switchable:
                    # no prefix cache to switch: one row, under the first setting's variant only
                    if variant != prefix_cache_variant(case.prefix_caching[0]):
                        continue
                    variant_here = ""
                else:
                    variant_here = variant
                for dtype in dtypes or case.dtypes:
                    cells.append((RowKey(case.name, backend, dtype, variant_here), case))
    return cells


def with_lora(cases: list[Case], lora: str | None) -> list[Case]:
    """`cases`, each running LoRA adapter `lora` (checked against its model before any row runs);
    a case that names another adapter is a ConfigError. None leaves each case's own."""
    if lora is None:
        return cases
    out = []
    for case in cases:
        if case.lora is not None and case.lora != lora:
            raise ConfigError(f"--lora {lora!r}: case {case.name!r} names its own adapter {case.lora!r}; "
                              "drop --lora or the case's lora")
        try:
            check_adapter(lora, case.model)
        except ParityError as exc:
            raise type(exc)(f"--lora: case {case.name!r}: {exc}") from exc
        out.append(dataclasses.replace(case, lora=lora))
    return out


def new_run_id() -> str:
    """The time-based part of a new run id: UTC, to the second."""
    return _dt.datetime.now(_dt.UTC).strftime("%Y%m%d-%H%M%S")


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run: the rows that finished are stored; `--resume run_id` does the rest."""

    def __init__(self, run_id: str, finished_rows: int) -> None:
        super().__init__(run_id)
        self.run_id = run_id
        self.finished_rows = finished_rows


def executor_rows(run_id: str, todo: list[tuple[RowKey, Case]], config: NightlyConfig) -> Iterator[RowResult]:
    """The rows of `todo` as they finish, unjudged, from the configured executor."""
    if config.executor == "ray":
        # Ray is an optional dependency, loaded only for a run on it
        from parity.nightly.ray_executor import RayCluster, ray_rows

        with RayCluster(address=config.ray_address, num_cpus=config.ray_cpus) as cluster:
            yield from ray_rows(cluster, run_id, todo, reference=config.reference, device=config.device,
                                engine_memory_gib=config.engine_memory_gib, gold=config.gold)
    else:
        yield from local_rows(run_id, todo, config)


def run_nightly(config: NightlyConfig, *, progress: bool = True) -> NightlyRun:
    """Run (or finish) the matrix, store every row, write the report; see the module docstring.

    The outputs are checked before any row runs, and the run is claimed (`claim_run`) for as
    long as it runs. Ctrl-C raises `RunInterrupted` naming the run.
    """
    cases = with_lora(load_cases(config.cases), config.lora)
    backends = resolve_backends(config.backends)
    cells = plan(cases, backends, config.dtypes)
    if config.baseline is not None and not config.history_path.is_file():
        raise ConfigError(f"--baseline {config.baseline!r}: no history at {config.history_path} to take it "
                          "from; point --out or --history at the history that holds it")
    output_dir(config.out, "--out")
    output_file(config.history_path, "--history")
    with History(config.history_path) as history:
        if config.baseline is not None:
            history.require_run(config.baseline, option="--baseline")
        record = {**config.to_record(), "backends": list(backends)}
        with claim_run(history, config.run_id, record, collect_environment()) as run_id:
            done = {str(r.key) for r in history.rows(run_id) if r.status != "error"}
            todo = [(key, case) for key, case in cells if str(key) not in done]
            cases_by_key = {key: case for key, case in todo}
            try:
                with tqdm(total=len(todo), desc=f"nightly {run_id}", unit="row", disable=not progress,
                          dynamic_ncols=True) as bar:
                    for row in executor_rows(run_id, todo, config):
                        history.add_row(judge_row(row, cases_by_key[row.key], config, history))
                        bar.set_postfix_str(row.key.label)
                        bar.update()
            except KeyboardInterrupt as exc:
                finished = sum(r.status != "error" for r in history.rows(run_id))
                raise RunInterrupted(run_id, finished) from exc
            history.finish_run(run_id)
            run = history.require_run(run_id, option="--run-id")
            stored = {str(r.key): r for r in history.rows(run_id, with_report=True)}
            order = [str(key) for key, _ in cells]
            rows = [stored[k] for k in order if k in stored] + \
                [r for k, r in stored.items() if k not in order]
            trend = history.trend([r.key for r in rows], up_to_run=run_id)
            report_dir = publish(config.out, run, rows, trend)
    return NightlyRun(run=run, rows=rows, report_dir=report_dir, exit_code=exit_code(rows))


@contextlib.contextmanager
def claim_run(history: History, run_id: str | None, config: dict[str, Any],
              environment: dict[str, Any]) -> Iterator[str]:
    """Own a run while the block runs; yields its id.

    run_id None: a new run, "<UTC second>" or, when taken, "<UTC second>-2", "-3", ...; each
    candidate is locked and then created with one INSERT, so two nightlies started in the same
    second get two runs. A given run_id: continued if it exists, created if not, and refused
    (ConfigError) while another live process runs it.
    """
    if run_id is not None:
        lock = RunLock(history.path, run_id)
        if not lock.acquire():
            raise ConfigError(f"--run-id {run_id!r} is being run by another process ({lock.owner()}); wait "
                              "for it to finish, or give this run another --run-id")
        history.start_run(run_id, config, environment)
    else:
        base = new_run_id()
        for n in itertools.count(1):
            run_id = base if n == 1 else f"{base}-{n}"
            lock = RunLock(history.path, run_id)
            if lock.acquire():
                if history.create_run(run_id, config, environment):
                    break
                lock.release()
    try:
        yield run_id
    finally:
        lock.release()


def judge_row(row: RowResult, case: Case, config: NightlyConfig, history: History) -> RowResult:
    """A row as it comes back from an executor, tested against its baseline row in the history
    (`--baseline`, else the last passing run of its key) and, where an audit of its backend ran in
    this run, against the backend's own noise (`noise.backend_noise`); error, lifecycle and audit
    rows are as they are."""
    if row.status == "error" or case.kind in ("lifecycle", AUDIT):
        return row
    noise = backend_noise(history.rows(row.run_id), row)
    if noise is not None:  # the row shows its noise, with or without a baseline
        row = dataclasses.replace(row, summary={**row.summary, **noise.summary()})
    reports = DISTRIBUTION_SUMMARY_KEYS[0] in row.summary  # the KL verdict reads the baseline's section
    baseline = history.row(config.baseline, row.key, with_report=reports) if config.baseline is not None \
        else history.last_passing(row.key, before_run=row.run_id, with_report=reports)
    if baseline is None or baseline.status == "error":
        return row
    verdict = compare_drift(row.abs_diff, baseline.abs_diff, baseline_run=baseline.run_id,
                            policy=config.policy)
    if noise is not None:
        verdict = judge_with_noise(verdict, noise, row.abs_diff, baseline.abs_diff)
    summary = {**row.summary, **distribution_verdict(row.report_json, baseline.report_json,
                                                     baseline_run=baseline.run_id, policy=config.policy)}
    if RECOMMENDATION_KEY in baseline.summary:  # the page flags a changed recommendation
        summary[BASELINE_RECOMMENDATION_KEY] = baseline.summary[RECOMMENDATION_KEY]
    return dataclasses.replace(row, verdict=verdict, status=row_status(row.violations, verdict),
                               summary=summary)


def local_rows(run_id: str, todo: list[tuple[RowKey, Case]], config: NightlyConfig) -> Iterator[RowResult]:
    """The local executor: the rows one after another in this process, one engine after another
    (`engine_order`), each engine closed after its last row."""
    for row in engine_order(todo, config.device):
        yield execute_row(run_id, row.key, row.case, reference=config.reference, device=config.device,
                          gold=config.gold, close_engine=row.last)
