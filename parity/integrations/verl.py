"""verl: the monitor and rollout dumps straight from `RayPPOTrainer.fit`'s batch (a `DataProto`).

    log_batch(monitor, self.global_steps, batch,        # after `batch = batch.union(old_log_prob)`
              policy_version=self.global_steps, rollout_policy_version=self.global_steps)
    dump_batch(batch, f"dumps/step{self.global_steps}.parquet")   # for `parity score` later

With `Monitor(..., resume=True)` a checkpoint resume starts a new attempt. `fit` syncs weights
before generating, so both versions are `global_steps` (one-step off-policy: the rollout's is one
less). Duck-typed (`batch.batch`, `meta_info`, `non_tensor_batch`):

    parity               verl                                 shape / meaning
    rollout logprobs     batch["rollout_log_probs"]           [batch, response_len] (see below)
    trainer logprobs     batch["old_log_probs"]               [batch, response_len], old_log_prob step
    mask                 batch["response_mask"]               [batch, response_len]; 0 at padding, tool
                                                              and user tokens
    responses            batch["responses"]                   [batch, response_len] token ids
    prompts              batch["prompts"]                     [batch, prompt_len], left-padded
    padding              batch["attention_mask"]              [batch, prompt_len + response_len]
    sampling             meta_info["temperature"]             set by fit; "top_p"/"top_k" when present
    request id           non_tensor_batch["uid"]              one id per GRPO group

Rollout logprobs need `actor_rollout_ref.rollout.calculate_log_probs=True` and are vLLM's
`processed_logprobs`; verl's trainer applies temperature only, so pass top_p/top_k with
`sampling=`. In bypass mode `old_log_probs` is `rollout_log_probs`: `log_batch` refuses it; a copy
of it (the same value at every counted token, as bypass mode leaves after the batch was copied, or
a bitwise-aligned rollout) is marked in the step's meta (`verl_old_log_probs_equal_rollout`). Log
before `compute_rollout_correction_and_add_to_batch`: its rejection (rollout_rs) zeroes
`response_mask` at the rejected tokens, those of largest drift. The response tokens that
`response_mask` leaves out (tool and user tokens, rejected ones) are counted in the step's meta
(`verl_masked_response_tokens`, when any; with `attention_mask`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from parity.core.errors import InputError
from parity.integrations.batches import (
    StepBatch,
    bool_mask,
    check_lengths,
    dump_step,
    get_entry,
    log_step,
    mask_lengths,
    optional_entry,
    right_padded,
    sampling_of,
)
from parity.monitor.arrays import host_array

if TYPE_CHECKING:
    from parity.monitor import Monitor

#: verl's batch key of each array parity reads.
KEYS: dict[str, str] = {"rollout": "rollout_log_probs", "trainer": "old_log_probs", "mask": "response_mask",
                        "responses": "responses", "prompts": "prompts", "attention": "attention_mask"}
#: the meta keys of a step's notes: response tokens response_mask leaves out; old == rollout everywhere.
MASKED, EQUAL = "verl_masked_response_tokens", "verl_old_log_probs_equal_rollout"


def read_batch(batch: Any, *, sampling: Mapping[str, Any] | None = None) -> StepBatch:
    """A verl `DataProto` (or any object with `.batch`, `.meta_info`) as a `StepBatch`; `sampling`
    adds what verl's batch does not hold (top_p, top_k)."""
    tensors = getattr(batch, "batch", None)
    if tensors is None:
        raise InputError(f"a verl DataProto has .batch (its tensors); got {type(batch).__name__}")
    where = "batch.batch"
    rollout = get_entry(tensors, KEYS["rollout"], where,
                        "set actor_rollout_ref.rollout.calculate_log_probs=True")
    trainer = get_entry(tensors, KEYS["trainer"], where,
                        "log after the old_log_prob step of RayPPOTrainer.fit")
    if rollout is trainer or _same_storage(rollout, trainer):
        raise InputError("old_log_probs is rollout_log_probs (verl's bypass mode): there is nothing to "
                         "compare; compute the trainer's logprobs (actor_rollout_wg.compute_log_prob) to "
                         "monitor this run")
    mask = bool_mask(get_entry(tensors, KEYS["mask"], where, "verl's fit adds it with compute_response_mask"),
                     KEYS["mask"])
    if mask.ndim != 2:
        raise InputError(f"response_mask must be [batch, response_len], got shape {list(mask.shape)}")
    responses, prompts, attention = (optional_entry(tensors, KEYS[k])
                                     for k in ("responses", "prompts", "attention"))
    lengths = mask_lengths(mask)
    prompt_rows = None
    notes: dict[str, Any] = {}
    if attention is not None:
        attention = bool_mask(attention, KEYS["attention"])
        width = mask.shape[1]
        if attention.ndim != 2 or attention.shape[0] != mask.shape[0] or attention.shape[1] < width:
            raise InputError(f"attention_mask {list(attention.shape)} must be [batch, prompt_len + "
                             f"response_len] for response_mask {list(mask.shape)}")
        _check_padding(attention[:, -width:], "response", "right")
        lengths = attention[:, -width:].sum(axis=1)
        check_lengths(mask, lengths, KEYS["mask"], "attention_mask's response part")
        masked = int((attention[:, -width:] & ~mask).sum())
        if masked:
            notes[MASKED] = masked
        if prompts is not None:
            ids = host_array(prompts, KEYS["prompts"])
            if ids.ndim != 2 or ids.shape[0] != mask.shape[0] or ids.shape[1] + width != attention.shape[1]:
                raise InputError(f"prompts {list(ids.shape)} and responses [{mask.shape[0]}, {width}] "
                                 f"must together span attention_mask {list(attention.shape)} ([batch, "
                                 "prompt_len + response_len])")
            _check_padding(attention[:, :ids.shape[1]], "prompt", "left")
            pad = ids.shape[1] - attention[:, :ids.shape[1]].sum(axis=1)
            prompt_rows = [ids[r, int(pad[r]):] for r in range(ids.shape[0])]
    meta = getattr(batch, "meta_info", None) or {}
    found = {k: meta.get(k) for k in ("temperature", "top_p", "top_k")}
    uid = (getattr(batch, "non_tensor_batch", None) or {}).get("uid")
    rollout, trainer = host_array(rollout, KEYS["rollout"]), host_array(trainer, KEYS["trainer"])
    if rollout.shape == trainer.shape == mask.shape and mask.any() and \
            np.array_equal(rollout[mask], trainer[mask]):
        notes[EQUAL] = True
    return StepBatch(
        rollout=rollout, trainer=trainer, mask=mask, lengths=np.asarray(lengths),
        responses=None if responses is None else host_array(responses, KEYS["responses"]),
        prompts=prompt_rows, request_ids=None if uid is None else [str(u) for u in uid],
        sampling=sampling_of(found, sampling), notes=notes or None)


def log_batch(monitor: Monitor, step: int, batch: Any, *, sampling: Mapping[str, Any] | None = None,
              meta: Mapping[str, Any] | None = None, policy_version: int | None = None,
              rollout_policy_version: int | None = None) -> dict[str, Any]:
    """Log one verl step's batch (`read_batch`, `non_tensor_batch["uid"]` as the rows' uids) into
    `monitor`; returns the stored record. policy_version, rollout_policy_version: the trainer's and
    the rollout's weight versions (module doc)."""
    return log_step(monitor, step, read_batch(batch, sampling=sampling), meta=meta,
                    policy_version=policy_version, rollout_policy_version=rollout_policy_version)


def dump_batch(batch: Any, path: str | Path, *, sampling: Mapping[str, Any] | None = None,
               logprobs_mode: str = "processed") -> Path:
    """Write one verl step's batch as a parity rollout dump (Parquet for a `.parquet` path, else JSONL)
    that `parity score` reads, its sampling from `meta_info` (and `sampling`); needs `prompts`,
    `responses` and `attention_mask` in the batch."""
    step = read_batch(batch, sampling=sampling)
    if step.prompts is None:
        raise InputError("a dump needs batch['prompts'] and batch['attention_mask'] (which strips the "
                         "prompts' left padding)")
    return dump_step(step, path, logprobs_mode=logprobs_mode)


def _check_padding(attention: np.ndarray, part: str, side: str) -> None:
    """InputError unless each row of attention_mask's `part` is padded on `side` only (verl left-pads
    prompts and right-pads responses): any other layout would cut the wrong tokens."""
    bad = ~right_padded(attention, left=side == "left")
    if bad.any():
        r = int(np.argmax(bad))
        raise InputError(f"row {r}: attention_mask's {part} part is not {side}-padded (its 1s are not one "
                         f"run at the {'end' if side == 'left' else 'start'}; verl {side}-pads its {part}s), "
                         "so its real tokens cannot be told from padding")


def _same_storage(a: Any, b: Any) -> bool:
    """Whether two tensors view the same memory (bypass mode may hand over a view, not the object)."""
    ptr_a, ptr_b = getattr(a, "data_ptr", None), getattr(b, "data_ptr", None)
    if not (callable(ptr_a) and callable(ptr_b)):
        return False
    return ptr_a() == ptr_b() and tuple(getattr(a, "shape", ())) == tuple(getattr(b, "shape", ()))
