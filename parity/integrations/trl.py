"""TRL: the monitor inside a `trl.GRPOTrainer`, one line before `trainer.train()`:
`attach(trainer, parity.Monitor("runs/grpo/parity"))`.

Callbacks never see the generation batch, so `attach` wraps `_generate_and_score_completions` on
this one trainer object and logs each training batch at `state.global_step`:

    parity               TRL's generation output                  shape / meaning
    rollout logprobs     "sampling_per_token_logps"               [batch, completion_len]: vLLM's
                                                                  processed logprobs, or a rollout_func's
    trainer logprobs     "old_per_token_logps"                    [batch, completion_len], before the update
    mask                 "completion_mask" (x "tool_mask")        0 at padding and tool-result tokens
    responses            "completion_ids"                         [batch, completion_len]
    prompts              "prompt_ids" with "prompt_mask"          [batch, prompt_len], left-padded
    sampling             args.temperature, top_p, top_k           top_p < 1 and top_k > 0 only; as
                                                                  args.generation_kwargs overrides them
    TRL's IS settings    args.vllm_importance_sampling_*          stored in each step's meta

Refused: a trainer without both sides (TRL computes `old_per_token_logps` only with vLLM IS
correction or reused generations), generating more than once per optimizer step, or sampling that
parity cannot describe (min_p, repetition_penalty, vllm_structured_outputs_regex, and the other
`DISTRIBUTION_KWARGS` set away from off, in GRPOConfig or `generation_kwargs`): the rollout's
processed logprobs are of that distribution, and the record would call the difference drift. NaN rollout
logprobs are left out and counted (`trl_nan_rollout_logprobs`); evaluation batches are not
logged; attach one Monitor per rank. Duck-typed.

Marked in the step's meta: completions `mask_truncated_completions` took out whole (their
completion_mask all 0: not measured; `trl_masked_truncated_completions`, when any; a generation
with no counted token is not logged, with a warning, and training goes on); a generation by
a `rollout_func` (`trl_rollout_func`: the sampling recorded is GRPOConfig's, which parity cannot see
the function use; it must sample at it and return processed logprobs); GRPOConfig's temperature
where `generation_kwargs` samples at another (`trl_trainer_temperature`: TRL's old_per_token_logps
are at it, so the difference is in the drift).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from parity.core.errors import ConfigError, InputError
from parity.integrations.batches import StepBatch, bool_mask, get_entry, log_step, optional_entry, sampling_of
from parity.monitor.arrays import host_array

if TYPE_CHECKING:
    from parity.monitor import Monitor

log = logging.getLogger("parity.monitor")

#: TRL's output key of each array parity reads.
KEYS: dict[str, str] = {"rollout": "sampling_per_token_logps", "trainer": "old_per_token_logps",
                        "mask": "completion_mask", "tool_mask": "tool_mask", "responses": "completion_ids",
                        "prompts": "prompt_ids", "prompt_mask": "prompt_mask"}
#: GRPOConfig's importance-sampling settings, stored with every step.
IS_SETTINGS = ("use_vllm", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
               "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max", "num_iterations",
               "steps_per_generation", "gradient_accumulation_steps", "loss_type")
_WRAPPED = "_parity_monitor"
#: the meta keys of a step's notes: completions completion_mask leaves out whole (TRL's
#: mask_truncated_completions); a rollout_func made the generation (its sampling is GRPOConfig's).
MASKED, ROLLOUT_FUNC = "trl_masked_truncated_completions", "trl_rollout_func"
#: the meta key of GRPOConfig's temperature, where generation_kwargs samples at another: TRL's
#: old_per_token_logps divide the logits by GRPOConfig's.
TRAINER_TEMPERATURE = "trl_trainer_temperature"
#: vLLM sampling settings that change the distribution sampled from, each with its "off" value(s):
#: parity's sampling (temperature, top_p, top_k) cannot describe them.
DISTRIBUTION_KWARGS: dict[str, tuple[Any, ...]] = {
    "min_p": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "min_tokens": (None, 0), "logit_bias": (None,),
    "allowed_token_ids": (None,), "bad_words": (None,), "logits_processors": (None,),
    "structured_outputs": (None,), "guided_decoding": (None,), "vllm_structured_outputs_regex": (None,)}


def attach(trainer: Any, monitor: Monitor, *, meta: Mapping[str, Any] | None = None) -> None:
    """Log every training generation of `trainer` (a `trl.GRPOTrainer`) into `monitor`, with TRL's
    importance-sampling settings and `meta` in each step's meta. `ConfigError` for a trainer whose
    settings leave out a side, or one already attached."""
    args = getattr(trainer, "args", None)
    method = getattr(trainer, "_generate_and_score_completions", None)
    if args is None or method is None:
        raise ConfigError(f"attach needs a trl.GRPOTrainer, got {type(trainer).__name__}")
    if getattr(trainer, _WRAPPED, None) is not None:
        raise ConfigError("this trainer already logs into a parity Monitor; attach once")
    settings = {k: getattr(args, k, None) for k in IS_SETTINGS}
    _check_settings(settings, has_rollout_func=getattr(trainer, "rollout_func", None) is not None)
    sampling = _trl_sampling(args)
    marks: dict[str, Any] = {}
    if getattr(trainer, "rollout_func", None) is not None:
        marks[ROLLOUT_FUNC] = True
    trained_at = getattr(args, "temperature", None)
    if trained_at is not None and float(trained_at) != sampling["temperature"]:
        marks[TRAINER_TEMPERATURE] = float(trained_at)
    extra = {**marks, **(meta or {})}

    def generate_and_log(*a: Any, **kw: Any) -> Any:
        output = method(*a, **kw)
        model = getattr(trainer, "model", None)
        if model is not None and getattr(model, "training", True):
            step = trainer.state.global_step
            batch, nan = read_output(output, sampling=sampling)
            if not batch.mask.any():  # a valid generation, but one `Monitor.log` has nothing to measure in
                log.warning("parity: TRL step %d not logged: no completion token counts (%d completions "
                            "masked whole by mask_truncated_completions, %d NaN rollout logprobs)", step,
                            (batch.notes or {}).get(MASKED, 0), nan)
                return output
            log_step(monitor, step, batch, meta={**settings, "trl_nan_rollout_logprobs": nan, **extra})
        return output

    trainer._generate_and_score_completions = generate_and_log
    setattr(trainer, _WRAPPED, monitor)


def read_output(output: Mapping[str, Any], *, sampling: Mapping[str, Any] | None = None
                ) -> tuple[StepBatch, int]:
    """One GRPOTrainer generation output as a `StepBatch`, and the count of counted tokens left out
    for a NaN rollout logprob (see the module doc)."""
    where = "the GRPOTrainer's generation output"
    rollout = host_array(get_entry(output, KEYS["rollout"], where,
                                   "use vLLM (use_vllm=True) or a rollout_func that returns logprobs"),
                         KEYS["rollout"])
    trainer = host_array(get_entry(output, KEYS["trainer"], where,
                                   "TRL computes it with vllm_importance_sampling_correction=True or "
                                   "num_iterations > 1"), KEYS["trainer"])
    completion = bool_mask(get_entry(output, KEYS["mask"], where, "TRL always sets it"), KEYS["mask"])
    if completion.ndim != 2:
        raise InputError(f"{KEYS['mask']} must be [batch, completion_len], got shape "
                         f"{list(completion.shape)}")
    tool = optional_entry(output, KEYS["tool_mask"])
    tool = None if tool is None else bool_mask(tool, KEYS["tool_mask"])
    for name, values in ((KEYS["rollout"], rollout), (KEYS["trainer"], trainer), (KEYS["tool_mask"], tool)):
        if values is not None and values.shape != completion.shape:
            raise InputError(f"{name} {list(values.shape)} and {KEYS['mask']} {list(completion.shape)} "
                             "differ in shape; each holds one entry per completion position")
    mask = completion if tool is None else completion & tool
    nan = np.isnan(rollout) & mask
    mask = mask & ~nan
    prompts = None
    ids, prompt_mask = optional_entry(output, KEYS["prompts"]), optional_entry(output, KEYS["prompt_mask"])
    if ids is not None and prompt_mask is not None:
        ids, keep = host_array(ids, KEYS["prompts"]), bool_mask(prompt_mask, KEYS["prompt_mask"])
        if ids.ndim != 2 or keep.shape != ids.shape or ids.shape[0] != completion.shape[0]:
            raise InputError(f"{KEYS['prompt_mask']} {list(keep.shape)} and {KEYS['prompts']} "
                             f"{list(ids.shape)} must share one [batch, prompt_len] shape, with the "
                             f"{completion.shape[0]} rows of {KEYS['mask']}")
        prompts = [ids[r][keep[r]] for r in range(ids.shape[0])]
    responses = optional_entry(output, KEYS["responses"])
    # TRL sets every completion_mask row to 1 over its completion (>= 1 token); an all-0 row is one
    # that mask_truncated_completions took out: its tokens are not measured, so the step says so.
    truncated = int((~completion.any(axis=1)).sum())
    batch = StepBatch(rollout=np.where(nan, 0.0, rollout).astype(rollout.dtype), trainer=trainer, mask=mask,
                      lengths=completion.sum(axis=1), prompts=prompts,
                      responses=None if responses is None else host_array(responses, KEYS["responses"]),
                      sampling=sampling_of({}, sampling), notes={MASKED: truncated} if truncated else None)
    return batch, int(nan.sum())


def _check_settings(settings: Mapping[str, Any], *, has_rollout_func: bool) -> None:
    """ConfigError when the trainer will not hold both sides of a generation (see the module doc)."""
    use_vllm, correction = settings["use_vllm"], settings["vllm_importance_sampling_correction"]
    accumulation, per_generation = settings["gradient_accumulation_steps"], settings["steps_per_generation"]
    iterations = settings["num_iterations"] or 1
    if not (use_vllm or has_rollout_func):
        raise ConfigError("this GRPOTrainer generates with transformers, which gives no rollout logprobs; "
                          "set use_vllm=True (or pass a rollout_func that returns logprobs) to monitor it")
    if per_generation is not None and accumulation is not None and per_generation < accumulation:
        raise ConfigError(f"steps_per_generation={per_generation} < gradient_accumulation_steps="
                          f"{accumulation}: several generations per optimizer step would share one monitor "
                          "step; set steps_per_generation >= gradient_accumulation_steps")
    reused = accumulation is not None and per_generation is not None and \
        accumulation % (per_generation * iterations) != 0
    if not ((use_vllm and correction) or reused):
        raise ConfigError("with these settings TRL never computes the trainer's logprobs of a rollout "
                          "(old_per_token_logps); set use_vllm=True with vllm_importance_sampling_correction="
                          "True, or num_iterations > 1")


def _trl_sampling(args: Any) -> dict[str, Any]:
    """The rollout's sampling as parity's fields: GRPOConfig's, overridden as TRL overrides them by
    `generation_kwargs` (TRL's top_k <= 0 and top_p=1 mean off)."""
    override = getattr(args, "generation_kwargs", None) or {}
    for key, off in DISTRIBUTION_KWARGS.items():
        where = "generation_kwargs" if key in override else "GRPOConfig"
        value = override.get(key, getattr(args, key, None))
        if not _is_off(value, off):
            raise ConfigError(f"{where} {key}={value!r} changes the distribution vLLM samples from (and so "
                              "its processed logprobs), which parity's sampling (temperature, top_p, top_k) "
                              f"cannot describe: the record would call it drift; set {key} to {off[-1]!r} to "
                              "monitor this run")
    settings = {k: override.get(k, getattr(args, k, None)) for k in ("temperature", "top_p", "top_k")}
    out: dict[str, Any] = {"temperature": float(settings["temperature"])}
    top_p, top_k = settings["top_p"], settings["top_k"]
    if top_p is not None and top_p < 1.0:
        out["top_p"] = float(top_p)
    if top_k is not None and top_k > 0:
        out["top_k"] = int(top_k)
    return out


def _is_off(value: Any, off: tuple[Any, ...]) -> bool:
    """Whether a sampling setting is at one of its "off" values (an empty list or dict is off too)."""
    if isinstance(value, (list, tuple, dict, set)) and not value:
        return True
    return not isinstance(value, bool) and any(value is o or (o is not None and value == o) for o in off)
