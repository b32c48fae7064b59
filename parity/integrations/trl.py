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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from parity.core.errors import ConfigError, InputError
from parity.integrations.batches import StepBatch, bool_mask, get_entry, log_step, optional_entry, sampling_of
from parity.monitor.arrays import host_array

if TYPE_CHECKING:
    from parity.monitor import Monitor

#: TRL's output key of each array parity reads.
KEYS: dict[str, str] = {"rollout": "sampling_per_token_logps", "trainer": "old_per_token_logps",
                        "mask": "completion_mask", "tool_mask": "tool_mask", "responses": "completion_ids",
                        "prompts": "prompt_ids", "prompt_mask": "prompt_mask"}
#: GRPOConfig's importance-sampling settings, stored with every step.
IS_SETTINGS = ("use_vllm", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
               "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max", "num_iterations",
               "steps_per_generation", "gradient_accumulation_steps", "loss_type")
_WRAPPED = "_parity_monitor"
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
    extra = dict(meta or {})

    def generate_and_log(*a: Any, **kw: Any) -> Any:
        output = method(*a, **kw)
        model = getattr(trainer, "model", None)
        if model is not None and getattr(model, "training", True):
            step = trainer.state.global_step
            batch, nan = read_output(output, sampling=sampling)
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
        prompts = [ids[r][keep[r]] for r in range(ids.shape[0])]
    responses = optional_entry(output, KEYS["responses"])
    batch = StepBatch(rollout=np.where(nan, 0.0, rollout).astype(rollout.dtype), trainer=trainer, mask=mask,
                      lengths=completion.sum(axis=1), prompts=prompts,
                      responses=None if responses is None else host_array(responses, KEYS["responses"]),
                      sampling=sampling_of({}, sampling))
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
