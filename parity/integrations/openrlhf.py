"""OpenRLHF: the monitor and rollout dumps from a PPO/GRPO `Experience` (openrlhf 0.11), read once
`action_log_probs` is set: `log_batch(monitor, global_step, experience, sampling=...)`.

Whole right-padded sequences; per-action arrays are shifted by one (`action_mask = mask[1:]`):

    parity               OpenRLHF Experience                  shape / meaning
    rollout logprobs     rollout_log_probs                    [batch, seq-1]: vLLM's processed logprobs
                                                              (--algo.advantage.is_correction_level)
    trainer logprobs     action_log_probs                     [batch, seq-1]: the actor's before the update
    mask                 action_mask                          [batch, seq-1]: 1 on generated tokens
    tokens               sequences                            [batch, seq]
    lengths              attention_mask.sum(-1)               real tokens of each row, then padding
    sampling             not in the experience                pass sampling={"temperature": ...}

Read as NeMo-RL's (`sequence_batch`); OpenRLHF's vLLM reports "processed". Duck-typed. Rows whose
action_mask is all 0 are not measured: counted in the step's meta (`openrlhf_masked_samples`, when any).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from parity.core.errors import InputError
from parity.integrations.batches import (
    StepBatch,
    bool_mask,
    dump_step,
    log_step,
    right_padded,
    sequence_batch,
)
from parity.monitor.arrays import host_array

if TYPE_CHECKING:
    from parity.monitor import Monitor

#: the meta key of a step's notes: rows with real tokens whose action_mask is all 0 (not measured).
MASKED = "openrlhf_masked_samples"
#: the Experience field of each array parity reads.
FIELDS: dict[str, str] = {"rollout": "rollout_log_probs", "trainer": "action_log_probs",
                          "mask": "action_mask", "tokens": "sequences", "attention": "attention_mask"}
_HINTS = {"rollout": "start OpenRLHF with --algo.advantage.is_correction_level token (vLLM then "
                     "returns them)",
          "trainer": "log after the experience maker's actor forward",
          "mask": "the experience maker sets it", "tokens": "the experience maker sets it",
          "attention": "the experience maker sets it"}


def read_batch(experience: Any, *, sampling: Mapping[str, Any] | None = None) -> StepBatch:
    """An OpenRLHF `Experience` (any object with its fields) as a `StepBatch` (see the module doc)."""
    arrays = {}
    for key, name in FIELDS.items():
        value = getattr(experience, name, None)
        if value is None:
            raise InputError(f"the Experience has no {name} ({_HINTS[key]})")
        arrays[key] = value
    tokens = host_array(arrays["tokens"], FIELDS["tokens"])
    attention = bool_mask(arrays["attention"], FIELDS["attention"])
    action = bool_mask(arrays["mask"], FIELDS["mask"])
    rollout, trainer = (host_array(arrays[k], FIELDS[k]) for k in ("rollout", "trainer"))
    if tokens.ndim != 2:
        raise InputError(f"sequences must be [batch, seq], got shape {list(tokens.shape)}")
    batch, seq = tokens.shape
    for name, a in ((FIELDS["mask"], action), (FIELDS["rollout"], rollout), (FIELDS["trainer"], trainer)):
        if a.shape != (batch, seq - 1):
            raise InputError(f"{name} {list(a.shape)} must be [batch, seq-1] = {[batch, seq - 1]} for "
                             f"sequences {[batch, seq]}")
    if attention.shape != (batch, seq):
        raise InputError(f"attention_mask {list(attention.shape)} must be sequences' shape {[batch, seq]}")
    bad = ~right_padded(attention)
    if bad.any():
        r = int(np.argmax(bad))
        raise InputError(f"row {r}: attention_mask is not ones then zeros: OpenRLHF 0.11 right-pads whole "
                         "sequences (Experience.concat_experiences); a left-padded or packed batch is "
                         "another layout, whose responses would be cut")

    def unshifted(values: np.ndarray, fill: Any) -> np.ndarray:
        """Position i holds token i's value (NeMo-RL's layout); nothing precedes token 0."""
        return np.concatenate([np.full((batch, 1), fill, values.dtype), values], axis=1)

    step = sequence_batch(unshifted(rollout, 0), unshifted(trainer, 0), unshifted(action, False), tokens,
                          attention.sum(axis=1), sampling,
                          names=(FIELDS["rollout"], FIELDS["trainer"], "action_mask (shifted back by one)",
                                 FIELDS["tokens"], "attention_mask"))
    masked = int((attention.any(axis=1) & ~action.any(axis=1)).sum())
    return dataclasses.replace(step, notes={MASKED: masked}) if masked else step


def log_batch(monitor: Monitor, step: int, experience: Any, *, sampling: Mapping[str, Any] | None = None,
              meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Log one OpenRLHF experience batch into `monitor`; returns the stored record."""
    return log_step(monitor, step, read_batch(experience, sampling=sampling), meta=meta)


def dump_batch(experience: Any, path: str | Path, *, sampling: Mapping[str, Any] | None = None,
               logprobs_mode: str = "processed") -> Path:
    """Write one OpenRLHF experience batch as a parity rollout dump that `parity score` reads (give
    the temperature in `sampling`: the experience does not hold it)."""
    return dump_step(read_batch(experience, sampling=sampling), path, logprobs_mode=logprobs_mode)
