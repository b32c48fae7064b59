"""The loop itself: sample on every backend, measure, update, push, verify; step after step.

At W_t: every backend samples the same seeded requests; the training forward scores each (drift,
rewards); the train-on backend's rollouts make a GRPO step with the chosen correction; W_{t+1} is
pushed everywhere and verified by digests (`parity.loop.sync`). Rows are written before step t+1;
nothing is pushed after the last. The policy's KL from its start is k3 on step 0's rollouts.
Started backends are closed; borrowed ones get their starting weights (or adapter) back.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from parity.backends import Backend, get_backend, lora_backends, weight_sync_missing
from parity.backends.base import check_samples
from parity.backends.borrowed import UNCHECKED, check_borrowed
from parity.core.errors import BackendError, ConfigError, DivergedError, Terminated
from parity.core.outputs import write_atomic
from parity.core.schema import VERSION
from parity.core.types import Request, Rollout, SamplingParams
from parity.drift.metrics import summarize
from parity.loop.config import LoopConfig
from parity.loop.grpo import clip_fraction, group_advantages, padded, plan_loss
from parity.loop.record import LoopRecord
from parity.loop.sync import SyncCheck, initial_sync, push
from parity.loop.task import Task, prompt_id
from parity.loop.trainer import Trainer
from parity.render.loop import loop_page

#: sampling seeds of step t start at seed * SEED_STRIDE + t * STEP_STRIDE (or t * the prompt count, when
#: larger: no two prompts of a run share a seed); prompt i adds i.
SEED_STRIDE, STEP_STRIDE = 1_000_003, 10_007
#: called with each step's rows as they are recorded (the command prints them).
Progress = Callable[[list[dict[str, Any]]], None]


def step_requests(config: LoopConfig, task: Task, step: int) -> list[Request]:
    """The requests of step `step`: one per prompt, n samples each, seeds fixed by (seed, step, prompt)."""
    stride = max(STEP_STRIDE, len(task.prompts))
    base = (config.seed * SEED_STRIDE + step * stride) % (2**31 - 1 - len(task.prompts))
    return [Request(prompt_ids=prompt, request_id=prompt_id(i),
                    sampling=SamplingParams(n=config.n, temperature=config.temperature,
                                            max_tokens=config.max_tokens, seed=base + i))
            for i, prompt in enumerate(task.prompts)]


def check_backends(config: LoopConfig, engines: dict[str, Backend]) -> None:
    """Refuse, before anything starts, a backend without weight push and verify, and a running one that
    does not fit (`check_borrowed`: model, options, recorded dtype, device).
    """
    for name in config.backends:
        reason = type(engines[name]).weight_sync_missing() if name in engines else weight_sync_missing(name)
        if reason is not None:
            raise ConfigError(f"parity loop pushes new weights to every backend each step and verifies them; "
                              f"{reason}. Drop {name!r} from the backends")
        if name in engines:  # the trainer's model, the dtype recorded, the reference engine's device
            engine = engines[name]
            # without lora_rank the loop pushes whole weights: an engine running an adapter would sample
            # with it on top of them while the pushed weights' digests still matched
            check_borrowed(engine, model=config.model, dtype=config.dtype_of(name),
                           device=config.device if "device" in engine.option_names() else None,
                           options=config.backend_options.get(name), role="backend given to the loop",
                           lora=None if config.lora_rank is None else UNCHECKED)
        if config.lora_rank is None:
            continue
        if name not in lora_backends():
            raise ConfigError(f"lora_rank (--lora-rank) pushes a LoRA adapter to every backend each step, "
                              f"and backend {name!r} cannot apply adapters; drop {name!r} from the "
                              f"backends (the ones that can: {', '.join(lora_backends())}) or drop "
                              "--lora-rank")
        engine = engines.get(name)
        if engine is not None and ("lora" not in engine.meta or engine.shared):
            how = "shared" if engine.shared else "started without a LoRA adapter"
            raise ConfigError(f"lora_rank (--lora-rank) swaps adapters on every backend, and the running "
                              f"{name!r} backend given was {how}; pass a backend of your own started "
                              "with lora= an adapter of that rank, or its name to let the loop start one")


def run_loop(config: LoopConfig, task: Task, *, engines: dict[str, Backend] | None = None,
             json_path: Path | None = None, html_path: Path | None = None,
             progress: Progress | None = None) -> LoopRecord:
    """Run `config` on `task`; returns the record (written to `json_path` every step). `engines`:
    borrowed running backends. A DivergedError names the step; earlier steps are kept.
    """
    engines = dict(engines or {})
    check_backends(config, engines)
    record = LoopRecord(model=config.model, backends=list(config.backends), seed=config.seed,
                        train_on=config.train_on, config={**config.to_dict(), "task": task.name},
                        provenance={"parity": VERSION, "torch": torch.__version__})
    started: list[Backend] = []
    adapters = None if config.lora_rank is None else tempfile.TemporaryDirectory(prefix="parity-loop-lora-")
    step = -1
    start: dict[str, Any] = {}  # what borrowed backends get back at the end
    try:
        trainer = Trainer(config.model, dtype=config.dtype, device=config.device, lr=config.lr,
                          weight_decay=config.weight_decay, grad_clip=config.grad_clip,
                          micro_batch_size=config.micro_batch_size, lora_rank=config.lora_rank,
                          adapter_dir=None if adapters is None else Path(adapters.name), seed=config.seed)
        if adapters is not None:
            record.provenance["adapter"] = {k: v for k, v in trainer.lm.lora.to_dict().items() if k != "path"}
        start = _starting_state(trainer, engines, config)
        backends = {}
        for name in config.backends:
            if name not in engines:
                backends[name] = _start(name, config, trainer)
                started.append(backends[name])
            else:
                backends[name] = engines[name]
        record.provenance["backends"] = {name: _meta(b) for name, b in backends.items()}
        checks = {name: initial_sync(trainer.weights, b) for name, b in backends.items()}
        probe: tuple[list[Rollout], list[torch.Tensor]] | None = None
        for step in range(config.steps):
            probe, checks = _step(config, task, trainer, backends, checks, step, probe, record)
            if progress is not None:
                progress(record.steps[-len(backends):])
            if json_path is not None:
                record.write(json_path)
        record.status = "complete"
    except DivergedError as exc:
        record.status, record.error = "diverged", f"step {step}: {exc}"
        kept = f"; the record keeps the {step} step(s) before it" + (f" ({json_path})" if json_path else "")
        raise DivergedError(f"training diverged at step {step}: {exc}{kept}") from exc
    except KeyboardInterrupt as exc:
        how = "SIGTERM" if isinstance(exc, Terminated) else "Ctrl-C"
        record.status = "interrupted"
        record.error = f"interrupted ({how}) at step {step}" if step >= 0 else \
            f"interrupted ({how}) before step 0"
        raise
    except BaseException as exc:
        said = str(exc) or type(exc).__name__
        record.status, record.error = "failed", f"step {step}: {said}" if step >= 0 else said
        raise
    finally:
        if json_path is not None:
            record.write(json_path)
        if html_path is not None:
            write_atomic(html_path, loop_page(record.to_dict()))
        for backend in started:
            backend.close()
        _restore(engines, start, failed=record.status != "complete")
        if adapters is not None:
            adapters.cleanup()
    return record


def _starting_state(trainer: Trainer, engines: dict[str, Backend], config: LoopConfig) -> dict[str, Any]:
    """What borrowed backends get back: the starting weights, or each one's starting adapter path."""
    if not engines:
        return {}
    if config.lora_rank is not None:
        return {name: b.meta["lora"]["path"] for name, b in engines.items()}
    weights = [(name, t.clone()) for name, t in trainer.weights.named_tensors()]
    return {name: weights for name in engines}


def _restore(borrowed: dict[str, Backend], start: dict[str, Any], *, failed: bool) -> None:
    """Give borrowed backends their start back; after a failure a dead engine must not hide its error."""
    for name, state in start.items():
        try:
            if isinstance(state, str):
                borrowed[name].load_adapter(state)
            else:
                borrowed[name].update_weights(state)
        except Exception:
            if not failed:
                raise


def _start(name: str, config: LoopConfig, trainer: Trainer) -> Backend:
    options = dict(config.backend_options.get(name, {}))
    if name == "reference":
        options.setdefault("device", config.device)
    if config.lora_rank is not None:
        options["lora"] = str(trainer.lm.lora.path)
    return get_backend(name, config.model, dtype=config.dtype_of(name), **options)


def _meta(backend: Backend) -> dict[str, Any]:
    """The settings of a backend that a reader of the record needs (no paths, no seeds)."""
    keys = ("backend", "backend_version", "dtype", "device", "kernels", "batch_invariant",
            "attention_backend", "logprobs_mode", "enable_prefix_caching")
    return {k: backend.meta[k] for k in keys if k in backend.meta}


def _step(config: LoopConfig, task: Task, trainer: Trainer, backends: dict[str, Backend],
          checks: dict[str, SyncCheck], step: int, probe: tuple[list[Rollout], list[torch.Tensor]] | None,
          record: LoopRecord) -> tuple[tuple[list[Rollout], list[torch.Tensor]], dict[str, SyncCheck]]:
    """One step; appends its rows and update to `record`; returns the probe and the next checks."""
    requests = step_requests(config, task, step)
    rows, scored = {}, {}
    for name, backend in backends.items():
        began = time.perf_counter()
        rollouts = _grouped(requests, backend.generate(requests), name)
        train = trainer.logprobs(rollouts)
        _check_finite(train, name)
        rewards = [_reward(task, r) for r in rollouts]
        rows[name] = _row(step, name, rollouts, train, rewards, checks[name], config.train_on == name)
        rows[name]["seconds"] = time.perf_counter() - began + checks[name].seconds
        scored[name] = (rollouts, train, rewards)
    rollouts, train, rewards = scored[config.train_on]
    if probe is None:
        probe = (rollouts, train)
    kl = summarize(*_arrays(trainer.logprobs(probe[0]) if step else probe[1], probe[1]))["k3_kl"]
    began = time.perf_counter()
    advantages = group_advantages(torch.tensor(rewards, dtype=torch.float64).view(len(requests), config.n))
    plan = plan_loss(train, [torch.tensor(r.logprobs, dtype=torch.float32) for r in rollouts],
                     advantages.reshape(-1).tolist(), config.correction_config)
    try:
        stats = trainer.update(rollouts, plan)
    except RuntimeError as exc:
        if "overflow" not in str(exc):
            raise
        # AdamW's step casts lr-scaled updates to the weights' dtype: a huge lr overflows it
        raise DivergedError(f"the AdamW update overflows the weights' {config.dtype} at lr={config.lr:g} "
                            f"({exc}); lower lr (--lr; 1e-6 to 1e-3 is usual)") from exc
    update_seconds = time.perf_counter() - began
    last = step == config.steps - 1
    next_checks = checks if last else {name: push(trainer.weights, b) for name, b in backends.items()}
    for row in rows.values():
        row["policy_kl_from_start"] = kl
        record.steps.append(row)
    record.updates.append({"step": step, "loss": stats.loss, "grad_norm": stats.grad_norm,
                           "forward_bitwise": stats.forward_bitwise, "kept_tokens": plan.kept_tokens,
                           "seconds": update_seconds, **trainer.weights.describe()})
    return probe, next_checks


def _grouped(requests: Sequence[Request], rollouts: Sequence[Rollout], backend: str) -> list[Rollout]:
    """`rollouts` in request order, then sample index: the GRPO groups are read off that order (a
    backend that returned them in another order, e.g. sample by sample, would have each prompt's
    advantages taken over other prompts' responses). BackendError unless there is exactly one sample
    per (request, sample index < n) (`check_samples`), answering its request's prompt."""
    check_samples(requests, rollouts, backend)
    position = {r.request_id: (k, r.prompt_ids) for k, r in enumerate(requests)}
    for ro in rollouts:
        if tuple(ro.prompt_ids) != tuple(position[ro.request_id][1]):
            raise BackendError(f"backend {backend!r} answered request {ro.request_id!r} (sample "
                               f"{ro.sample_index}) for a prompt that is not the request's")
    return sorted(rollouts, key=lambda ro: (position[ro.request_id][0], ro.sample_index))


def _reward(task: Task, rollout: Rollout) -> float:
    """The task's reward as a float; ConfigError naming reward and rollout unless finite."""
    where = f"reward {task.name!r} on rollout {rollout.request_id!r}/{rollout.sample_index}"
    try:
        value = task.reward(rollout)
    except Exception as exc:
        raise ConfigError(f"{where} raised {type(exc).__name__}: {exc}; fix the reward function (it gets a "
                          "parity Rollout: prompt_ids, token_ids, request_id)") from exc
    try:
        number = float(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where} returned {value!r}; a reward must be a finite number") from exc
    if not np.isfinite(number):
        raise ConfigError(f"{where} returned {number}; a reward must be a finite number")
    return number


def _arrays(train: Sequence[torch.Tensor], rollout: Sequence[torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence vectors -> `[batch, max_len]` train, rollout and mask."""
    train_b, mask = padded(list(train))
    rollout_b, _ = padded(list(rollout))
    return train_b, rollout_b, mask


def _check_finite(train: Sequence[torch.Tensor], backend: str) -> None:
    """A non-finite training logprob means diverged weights (with top-p and top-k off all are finite)."""
    for i, lp in enumerate(train):
        if not torch.isfinite(lp).all():
            raise DivergedError(f"the training forward gives a non-finite logprob on {backend}'s rollout "
                                f"{i}: the weights are no longer finite")


def _row(step: int, name: str, rollouts: list[Rollout], train: list[torch.Tensor], rewards: list[float],
         check: SyncCheck, trained_on: bool) -> dict[str, Any]:
    """The row of one backend at one step (`parity.loop.record.STEP_KEYS` and extras)."""
    rollout_lp = [torch.tensor(r.logprobs, dtype=torch.float32) for r in rollouts]
    train_b, rollout_b, mask = _arrays(train, rollout_lp)
    summary = summarize(train_b, rollout_b, mask)
    return {
        "step": step, "backend": name,
        "max_abs_logprob_diff": summary["max_abs_logprob_diff"],
        "mean_abs_logprob_diff": summary["mean_abs_logprob_diff"],
        "k3_kl": summary["k3_kl"], "is_ratio_mean": summary["is_ratio_mean"],
        "reward_mean": float(np.mean(rewards)), "policy_kl_from_start": 0.0,
        "weights_in_sync": check.in_sync, "seconds": 0.0,
        "is_ratio_min": summary["is_ratio_min"], "is_ratio_max": summary["is_ratio_max"],
        "clip_fraction": clip_fraction(train_b, rollout_b, mask),
        "frac_tokens_ratio_gt_2": summary["frac_tokens_ratio_gt_2"],
        "bitwise": all(torch.equal(t, r) for t, r in zip(train, rollout_lp)),
        "num_tokens": summary["num_tokens"], "trained_on": trained_on,
        "sync_hidden": check.hidden, "sync_detail": None if check.in_sync else check.describe(),
    }
