"""Drift across training steps: a built-in on-policy RL loop (GRPO) over parity's backends
(`parity.loop("tiny-llama", ["reference", "vllm"], steps=20)`).

Every step samples on every backend, measures each against the training forward at that step's
weights, trains on one backend's rollouts, then pushes and verifies the new weights everywhere
(`parity.loop.run`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parity.backends import Backend
from parity.backends.borrowed import resolve_device
from parity.core.errors import ConfigError
from parity.core.outputs import output_file
from parity.core.schema import LORA_MOE_TARGETS, LORA_TARGETS
from parity.loop.config import LoopConfig
from parity.loop.record import LoopRecord
from parity.models import resolve_model
from parity.models.lora import checkpoint_linear_shapes, is_moe_checkpoint
from parity.workload.cases import Case, resolve_case
from parity.workload.resolve import check_case_model

if TYPE_CHECKING:
    from parity.loop.task import Reward, Task

__all__ = ["LoopConfig", "LoopRecord", "loop"]


def loop(model: str, backends: Sequence[str | Backend] = ("reference",), *, steps: int = 20,
         case: Case | str | Path | None = None, reward: Reward | None = None, train_on: str = "reference",
         lr: float = 1e-3, correction: str = "none", seed: int = 0, n: int = 4, max_tokens: int = 16,
         temperature: float = 1.0, prompts: int = 8, dtype: str = "float32", device: str = "auto",
         micro_batch_size: int | None = None, weight_decay: float = 0.0, grad_clip: float | None = 1.0,
         backend_dtypes: Mapping[str, str] | None = None,
         backend_options: Mapping[str, Mapping[str, Any]] | None = None, lora_rank: int | None = None,
         json: str | Path | None = None, html: str | Path | None = None,
         progress: Any = None) -> LoopRecord:
    """Run the on-policy GRPO loop on `model` for `steps` steps; returns its `LoopRecord`.

    backends: names or running `Backend`s (borrowed: given back the starting weights, not closed),
    each able to push and verify weights. case/reward: prompts from `case` rewarded by
    `reward(rollout) -> float`; else the built-in arithmetic task. device "auto": cuda when a backend
    runs there. json/html: rewritten every step. lora_rank: train and push only a LoRA adapter.
    Other settings are `LoopConfig`'s. A ParityError before any engine starts on bad settings;
    DivergedError naming the step on NaN or infinite loss or weights.
    """
    if isinstance(backends, str) or not isinstance(backends, Sequence):
        raise ConfigError(f"backends must be a list of backend names or Backends, got {backends!r}")
    names = [b.name if isinstance(b, Backend) else b for b in backends]
    engines = {b.name: b for b in backends if isinstance(b, Backend)}
    dtypes = dict(backend_dtypes or {})
    for name, engine in engines.items():  # a borrowed engine's dtype is what the record must say
        if dtypes.setdefault(name, engine.dtype) != engine.dtype:
            raise ConfigError(f"backend_dtypes[{name!r}] is {dtypes[name]!r}, but the running {name!r} "
                              f"backend given runs {engine.dtype}; drop that entry or pass a backend started "
                              f"with dtype={dtypes[name]!r}")
    device = resolve_device(device, backends, backend_options)
    config = LoopConfig(model=model, backends=tuple(names), train_on=train_on, steps=steps, lr=lr,
                        weight_decay=weight_decay, grad_clip=grad_clip, correction=correction, seed=seed, n=n,
                        max_tokens=max_tokens, temperature=temperature, prompts=prompts, dtype=dtype,
                        device=device, micro_batch_size=micro_batch_size,
                        backend_dtypes=dtypes,
                        backend_options={} if backend_options is None else backend_options,
                        lora_rank=lora_rank)
    json_path = None if json is None else output_file(json, "json")
    html_path = None if html is None else output_file(html, "html")
    if lora_rank is not None:
        _check_lora_rank(model, lora_rank)
    # the case and the task's prompts are checked before the trainer and the engines load
    task = _task(config, case, reward)
    from parity.loop.run import run_loop  # torch: only when a loop runs

    return run_loop(config, task, engines=engines, json_path=json_path, html_path=html_path,
                    progress=progress)


def _check_lora_rank(model: str, rank: int) -> None:
    """ConfigError when `rank` exceeds some adapted layer's smaller dimension (extra rank only costs)."""
    path = resolve_model(model)
    targets = LORA_MOE_TARGETS if is_moe_checkpoint(path) else LORA_TARGETS
    dims = {module: min(shape) for module, shape in checkpoint_linear_shapes(path).items()
            if module.rsplit(".", 1)[-1] in targets and ".experts." not in module}
    module = min(dims, key=dims.__getitem__, default=None)
    if module is not None and rank > dims[module]:
        raise ConfigError(f"lora_rank (--lora-rank) {rank} exceeds the smaller dimension ({dims[module]}) of "
                          f"{module!r}, a layer the adapter trains on model {model!r}: its update B A cannot "
                          f"have a rank above it; give a rank <= {dims[module]} (8-64 is usual)")


def _task(config: LoopConfig, case: Case | str | Path | None, reward: Reward | None) -> Task:
    """The built-in task, or a case's prompts with `reward` (default: the arithmetic check)."""
    from parity.loop.task import arithmetic_check, arithmetic_task, custom_task  # the tokenizer loads torch

    if case is None:
        task = arithmetic_task(config.model, count=config.prompts, seed=config.seed)
        if reward is None:
            return task
        return custom_task(getattr(reward, "__name__", "reward"), task.prompts, reward)
    case = resolve_case(case, what="case (--case)")
    check_case_model(config.model, case, "the loop's model (--model)")
    prompts = list(dict.fromkeys(r.prompt_ids for r in case.requests))
    return custom_task(f"case {case.name}", prompts, reward or arithmetic_check(config.model, prompts))
