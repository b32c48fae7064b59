"""The nightly matrix runner: cases x backends x dtypes (x router-replay or prefix-cache variants),
one row each.

An executor ("local" or "ray") runs rows and hands each back; this process alone judges it and
commits it in its own transaction, so `resume` runs only what is missing (errors retried). Rows
run grouped by engine, one engine alive per process; a dying engine is an error row and restarts.
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
from parity.nightly.execute import execute_row, prefix_cache_variant, recorded_options
from parity.nightly.history import History, RunInfo
from parity.nightly.lock import RunLock
from parity.nightly.noise import AUDIT, ENGINE_OPTIONS, backend_noise
from parity.nightly.publish import point_latest, publish
from parity.nightly.regression import RegressionPolicy, compare_drift, distribution_verdict, judge_with_noise
from parity.nightly.rows import BASELINE_SKIPPED, RowKey, RowResult, check_run_id, exit_code, row_status
from parity.workload.cases import Case, load_cases

AUTO = "auto"
EXECUTORS = ("local", "ray")
DEVICES = (AUTO, "cpu", "cuda")


@dataclass(frozen=True)
class NightlyConfig:
    """What one nightly run does.

    cases: a `load_cases` spec. backends: or ("auto",). dtypes: empty = each case's. out: writes
    `<out>/<run_id>/`; history: None = `<out>/history.sqlite`. run_id: None = new from UTC time.
    baseline: None = each row's last passing run. reference: "invariant" or "native". device: "auto"
    is cuda when a backend runs there. executor: "local" or "ray"; ray_address: None starts a local
    one; ray_cpus. engine_memory_gib: cap on the Ray actors' engines. gold: True, False or None
    (where cheap). lora: an adapter for every case (None: each case's own).
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
        for option, values in (("--backends", self.backends), ("--dtypes", self.dtypes)):
            twice = next((v for i, v in enumerate(values) if v in values[:i]), None)
            if twice is not None:  # one row run twice, counted twice on the page; stored once
                raise ConfigError(f"{option} has {twice!r} twice; give each value once")
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
    """The matrix in run order (case, router-replay variant, backend, dtype), leaving out cells no
    setting could fix: a case's unlisted backends, R3 without route capture, LoRA without adapters.
    """
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
    """Ctrl-C during a run: the rows that finished are stored; `--resume run_id` does the rest.
    held_rows: rows that finished but waited for their backend's audit (whose noise judges them), not
    stored: the resumed run runs them again."""

    def __init__(self, run_id: str, finished_rows: int, held_rows: int = 0) -> None:
        super().__init__(run_id)
        self.run_id = run_id
        self.finished_rows = finished_rows
        self.held_rows = held_rows


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
    """Run (or finish) the matrix, store every row, write the report; outputs checked and the run
    claimed first. Ctrl-C raises `RunInterrupted` naming the run.
    """
    cases = with_lora(load_cases(config.cases), config.lora)
    backends = resolve_backends(config.backends)
    cells = plan(cases, backends, config.dtypes)
    if not cells:  # a run of no row would pass (exit 0) having checked nothing
        own = {c.name: list(c.backends) for c in cases if c.backends}
        raise ConfigError(f"--cases {config.cases!r} with --backends {list(backends)}: no row to run"
                          f"{f' (cases limited to backends: {own})' if own else ''}; give a backend the "
                          "cases run on (a route-capture one for R3, a LoRA one for an adapter)")
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
            stored_rows = [r for r in history.rows(run_id) if r.status != "error"]
            check_cases_unchanged(run_id, stored_rows, cells)
            done = {str(r.key) for r in stored_rows}
            todo = [(key, case) for key, case in cells if str(key) not in done]
            cases_by_key = {key: case for key, case in todo}
            # an executor may hand a row back before the audit whose noise judges it (Ray's actors run
            # in parallel): such a row waits, so its verdict does not depend on which finished first
            audits = {key: case for key, case in todo if case.kind == AUDIT}
            held: list[RowResult] = []
            try:
                with tqdm(total=len(todo), desc=f"nightly {run_id}", unit="row", disable=not progress,
                          dynamic_ncols=True) as bar:
                    for row in executor_rows(run_id, todo, config):
                        audits.pop(row.key, None)
                        if waits_for_audit(row, cases_by_key, audits, config.device):
                            held.append(row)
                        else:  # an audit row is stored before the rows it judges
                            history.add_row(judge_row(row, cases_by_key[row.key], config, history))
                        for ready in [r for r in held
                                      if not waits_for_audit(r, cases_by_key, audits, config.device)]:
                            held.remove(ready)
                            history.add_row(judge_row(ready, cases_by_key[ready.key], config, history))
                        bar.set_postfix_str(row.key.label)
                        bar.update()
                    for row in held:  # none left in practice: every audit row comes back, errors too
                        history.add_row(judge_row(row, cases_by_key[row.key], config, history))
            except KeyboardInterrupt as exc:
                finished = sum(r.status != "error" for r in history.rows(run_id))
                # a held row judged now would lack the noise it waits for, and stored it is never judged
                # again: it is left for the resumed run, and the interrupt says so
                raise RunInterrupted(run_id, finished, len(held)) from exc
            history.finish_run(run_id)
            run = history.require_run(run_id, option="--run-id")
            stored = {str(r.key): r for r in history.rows(run_id, with_report=True)}
            order = [str(key) for key, _ in cells]
            rows = [stored[k] for k in order if k in stored] + \
                [r for k, r in stored.items() if k not in order]
            trend = history.trend([r.key for r in rows], up_to_run=run_id,  # one line per workload
                                  same_series=lambda new, old: not config_change(new, old, WORKLOAD))
            report_dir = publish(config.out, run, rows, trend)
            # an older run finished after a newer one (--resume) must not become `latest`
            newer = [r for r in history.runs() if r.seq > run.seq and r.finished_at is not None
                     and (config.out / r.run_id).is_dir()]
            if newer:
                point_latest(config.out, newer[-1].run_id)
    return NightlyRun(run=run, rows=rows, report_dir=report_dir, exit_code=exit_code(rows))


@contextlib.contextmanager
def claim_run(history: History, run_id: str | None, config: dict[str, Any],
              environment: dict[str, Any]) -> Iterator[str]:
    """Own a run while the block runs; yields its id: a new "<UTC second>[-2, -3, ...]" (locked, then
    one INSERT), or the given one continued or created; ConfigError while another process runs it.
    """
    if run_id is not None:
        lock = RunLock(history.path, run_id)
        if not lock.acquire():
            raise ConfigError(f"--run-id {run_id!r} is being run by another process ({lock.owner()}); wait "
                              "for it to finish, or give this run another --run-id")
        try:
            if (stored := history.run(run_id)) is not None:
                check_continuation(stored, config, environment)
            history.start_run(run_id, config, environment)
        except BaseException:
            lock.release()
            raise
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


def check_continuation(run: RunInfo, config: dict[str, Any], environment: dict[str, Any]) -> None:
    """A stored run continued (`--resume`, or `--run-id` of a stored run) runs with the matrix options
    and the package versions it started with, else ConfigError: one run id must not hold rows of two
    matrices (its stored options would describe only some of them) or of two installs (an upgrade
    between its rows)."""
    changed = [f"{k} {run.config[k]!r} → {config[k]!r}" for k in sorted(set(run.config) & set(config))
               if run.config[k] != config[k]]
    if changed:
        raise ConfigError(f"--run-id {run.run_id!r}: the stored run has other options "
                          f"({', '.join(changed)}); finish it with --resume {run.run_id}, or give this run "
                          "another --run-id")
    before, now = run.environment.get("versions"), environment.get("versions")
    if isinstance(before, dict) and isinstance(now, dict):
        moved = [f"{name} {before[name]} → {now[name]}" for name in sorted(set(before) & set(now))
                 if before[name] != now[name]]
        if moved:
            raise ConfigError(f"run {run.run_id!r} started with other package versions ({', '.join(moved)}); "
                              "its rows would mix both installs: reinstall those versions to finish it, or "
                              "start a new run (without --resume / --run-id)")


def check_cases_unchanged(run_id: str, finished: list[RowResult], cells: list[tuple[RowKey, Case]]) -> None:
    """ConfigError when a finished row of a continued run ran another version of its case than the
    case files hold now (its `case_hash`): the run would hold rows of two workloads under one name."""
    hashes = {key: case.hash for key, case in cells}
    for row in finished:
        before, now = row.provenance.get("case_hash"), hashes.get(row.key)
        if before is not None and now is not None and before != now:
            raise ConfigError(f"run {run_id!r}: case {row.key.case!r} changed since its row {row.key.label} "
                              f"ran (case_hash {before} → {now}); restore the case file to finish the run, "
                              "or start a new run (without --resume / --run-id)")


def waits_for_audit(row: RowResult, cases: dict[RowKey, Case], audits: dict[RowKey, Case],
                    device: str = "cpu") -> bool:
    """Whether `row` must wait for one of the `audits` still running: one whose repeat noise would
    judge it (`backend_noise`: same backend, dtype, variant, model and engine options)."""
    if row.status == "error" or cases[row.key].kind == AUDIT:
        return False
    return any((a.backend, a.dtype, a.router_replay, case.model)
               == (row.key.backend, row.key.dtype, row.key.router_replay, cases[row.key].model)
               and recorded_options(a, case, device) == row.provenance.get(ENGINE_OPTIONS)
               for a, case in audits.items())



def judge_row(row: RowResult, case: Case, config: NightlyConfig, history: History) -> RowResult:
    """A row from an executor judged against its baseline and, where an audit ran, the backend's noise;
    error, lifecycle and audit rows as they are.
    """
    if row.status == "error" or case.kind in ("lifecycle", AUDIT, "loop") or not row.abs_diff.size:
        return row  # no per-token drift to test (a loop row's figures are per step)
    noise = backend_noise(history.rows(row.run_id), row)
    if noise is not None:  # the row shows its noise, with or without a baseline
        row = dataclasses.replace(row, summary={**row.summary, **noise.summary()})
    reports = DISTRIBUTION_SUMMARY_KEYS[0] in row.summary  # the KL verdict reads the baseline's section
    if config.baseline is not None:
        baseline = history.row(config.baseline, row.key, with_report=reports)
    else:  # the newest passing row of the same workload (a case edited under its name is another one)
        baseline = history.last_passing(row.key, before_run=row.run_id, with_report=reports,
                                        accept=lambda old: not config_change(row, old, WORKLOAD))
    if baseline is None or baseline.status == "error" or not baseline.abs_diff.size:
        if config.baseline is None:
            return row  # no earlier passing row: this one may become the baseline
        why = f"it has no row {row.key.label}" if baseline is None else \
            "its row is an error" if baseline.status == "error" else "its row has no per-token drift"
        note = f"not compared with {config.baseline}: {why}"  # not "no baseline yet": one was named
        return dataclasses.replace(row, provenance={**row.provenance, BASELINE_SKIPPED: note})
    if changed := config_change(row, baseline, WORKLOAD):
        note = f"not compared with {baseline.run_id}: another workload ({changed})"
        return dataclasses.replace(row, provenance={**row.provenance, BASELINE_SKIPPED: note})
    verdict = compare_drift(row.abs_diff, baseline.abs_diff, baseline_run=baseline.run_id,
                            policy=config.policy)
    verdict = dataclasses.replace(verdict, settings_changed=config_change(row, baseline, SETTINGS))
    if noise is not None:
        verdict = judge_with_noise(verdict, noise, row.abs_diff, baseline.abs_diff)
    summary = {**row.summary, **distribution_verdict(row.report_json, baseline.report_json,
                                                     baseline_run=baseline.run_id, policy=config.policy)}
    if RECOMMENDATION_KEY in baseline.summary:  # the page flags a changed recommendation
        summary[BASELINE_RECOMMENDATION_KEY] = baseline.summary[RECOMMENDATION_KEY]
    return dataclasses.replace(row, verdict=verdict, status=row_status(row.violations, verdict),
                               summary=summary)


#: provenance entries that must agree for two rows of one key to be compared at all: the case's
#: contents (model name, prompts, sampling, logprobs mode, tensor-parallel size, adapter name), the
#: model's and the adapter's weights.
WORKLOAD = ("case_hash", "model_hash", "lora.hash")
#: provenance entries a verdict names when they differ from its baseline's (changing them is what a
#: regression run may test, e.g. `--reference native` against `--baseline`): the training side's
#: kernels, the device, and every package version both rows record ("versions.*").
SETTINGS = ("reference_kernels", "device", "versions.*")


def config_change(row: RowResult, baseline: RowResult, names: tuple[str, ...]) -> str:
    """Which of `names` (dotted provenance entries; "a.*": every entry of a) differ between two rows,
    e.g. "case_hash 1a → 2b" ("" when none known does; an entry one of them lacks is not known)."""
    changes = []
    for name in names:
        if name.endswith(".*"):
            parent = name[:-2]
            now, before = (_entry(r.provenance, parent) for r in (row, baseline))
            both = set(now) & set(before) if isinstance(now, dict) and isinstance(before, dict) else set()
            entries = [f"{parent}.{k}" for k in sorted(both)]
        else:
            entries = [name]
        for entry in entries:
            now, before = (_entry(r.provenance, entry) for r in (row, baseline))
            if now is not None and before is not None and now != before:
                changes.append(f"{entry} {before} → {now}")
    return ", ".join(changes)


def _entry(provenance: dict[str, Any], dotted: str) -> Any:
    value: Any = provenance
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def local_rows(run_id: str, todo: list[tuple[RowKey, Case]], config: NightlyConfig) -> Iterator[RowResult]:
    """The local executor: the rows one after another in this process, one engine after another
    (`engine_order`), each engine closed after its last row."""
    for row in engine_order(todo, config.device):
        yield execute_row(run_id, row.key, row.case, reference=config.reference, device=config.device,
                          gold=config.gold, close_engine=row.last)
