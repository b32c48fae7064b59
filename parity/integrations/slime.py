"""slime: the monitor and rollout dumps from the trainer's `rollout_data` (per-sample lists), read
once `rollout_data["log_probs"]` is computed: `log_batch(monitor, rollout_id, rollout_data, ...)`.

    parity               slime                            shape / meaning
    rollout logprobs     "rollout_log_probs"              one [response_len_i] tensor per sample (SGLang's)
    trainer logprobs     "log_probs"                      one [response_len_i] tensor per sample
    mask                 "loss_masks"                     one [response_len_i] 0/1 tensor per sample
    tokens               "tokens"                         prompt + response ids (response: the last ids)
    sampling             not in the batch                 pass sampling={"temperature": ...} (top_p, top_k)

SGLang's logprobs at slime's defaults (no top-p/top-k) are parity's "processed"; under top-p or
top-k they are temperature-scaled but not truncated, which a processed dump cannot describe
(`dump_batch` refuses it). Samples whose loss_masks are all 0 (slime's `remove_sample`, off-policy
partial rollouts) are not measured: counted in the step's meta (`slime_masked_samples`, when any).
Each data-parallel rank holds its share: log on one rank, or a monitor directory per rank.
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
    dump_step,
    get_entry,
    log_step,
    optional_entry,
    padded_rows,
    sampling_of,
)
from parity.monitor.arrays import host_array
from parity.monitor.core import checked_sampling

if TYPE_CHECKING:
    from parity.monitor import Monitor

#: slime's `rollout_data` key of each list parity reads.
KEYS: dict[str, str] = {"rollout": "rollout_log_probs", "trainer": "log_probs", "mask": "loss_masks",
                        "tokens": "tokens"}
#: the meta key of the samples (with a response) whose loss_masks are all 0: not measured.
MASKED = "slime_masked_samples"


def read_batch(data: Mapping[str, Any], *, sampling: Mapping[str, Any] | None = None) -> StepBatch:
    """slime's `rollout_data` as a `StepBatch` (see the module doc)."""
    where = "rollout_data"
    rollout = get_entry(data, KEYS["rollout"], where, "SGLang's logprobs: sampled with return_logprob=True")
    trainer = get_entry(data, KEYS["trainer"], where, "the actor's log_probs of the rollout")
    masks = get_entry(data, KEYS["mask"], where, "one loss mask per sample")
    if not (len(rollout) == len(trainer) == len(masks)):
        raise InputError(f"rollout_data has {len(rollout)} rollout_log_probs, {len(trainer)} log_probs and "
                         f"{len(masks)} loss_masks; give one of each per sample")
    rollout, rollout_lengths = padded_rows(rollout, KEYS["rollout"], 0.0)
    trainer, trainer_lengths = padded_rows(trainer, KEYS["trainer"], 0.0)
    mask, lengths = padded_rows(masks, KEYS["mask"], 0)
    for name, sizes in (("rollout_log_probs", rollout_lengths), ("log_probs", trainer_lengths)):
        wrong = np.flatnonzero(sizes != lengths)
        if wrong.size:
            i = int(wrong[0])
            raise InputError(f"sample {i}: {name} has {sizes[i]} entries but loss_masks {lengths[i]}; each "
                             "holds one entry per response token")
    tokens = optional_entry(data, KEYS["tokens"])
    responses = prompts = None
    if tokens is not None:
        rows = [host_array(t, f"tokens[{i}]").reshape(-1) for i, t in enumerate(tokens)]
        if len(rows) != len(lengths) or any(row.size < n for row, n in zip(rows, lengths)):
            raise InputError("rollout_data tokens must hold each sample's prompt and response ids, one list "
                             "per sample")
        prompts = [row[:row.size - n] for row, n in zip(rows, lengths)]
        responses, _ = padded_rows([row[row.size - n:] for row, n in zip(rows, lengths)], KEYS["tokens"], 0)
    mask = bool_mask(mask, KEYS["mask"])
    masked = int(((lengths > 0) & ~mask.any(axis=1)).sum())
    return StepBatch(rollout=rollout, trainer=trainer, mask=mask, lengths=lengths,
                     responses=responses, prompts=prompts, sampling=sampling_of({}, sampling),
                     notes={MASKED: masked} if masked else None)


def log_batch(monitor: Monitor, step: int, data: Mapping[str, Any], *,
              sampling: Mapping[str, Any] | None = None,
              meta: Mapping[str, Any] | None = None, policy_version: int | None = None,
              rollout_policy_version: int | None = None) -> dict[str, Any]:
    """Log one slime rollout's `rollout_data` into `monitor`; returns the stored record.
    policy_version, rollout_policy_version: the trainer's and the rollout's weight versions
    (`Monitor.log`), where the loop knows them."""
    return log_step(monitor, step, read_batch(data, sampling=sampling), meta=meta,
                    policy_version=policy_version, rollout_policy_version=rollout_policy_version)


def dump_batch(data: Mapping[str, Any], path: str | Path, *, sampling: Mapping[str, Any] | None = None,
               logprobs_mode: str = "processed") -> Path:
    """Write one slime rollout's `rollout_data` as a parity rollout dump that `parity score` reads
    (give the temperature in `sampling`: slime's batch does not hold it). `InputError` for processed
    logprobs under top-p or top-k: SGLang's are not truncated (see the module doc)."""
    step = read_batch(data, sampling=sampling)
    given = checked_sampling(step.sampling) or {}
    top_p, top_k = given.get("top_p", 1.0), given.get("top_k", 0)
    if logprobs_mode == "processed" and given.get("temperature") != 0 and (top_p < 1.0 or top_k > 0):
        raise InputError(f"sampling top_p={top_p}, top_k={top_k}: SGLang's logprobs are temperature-scaled "
                         "but not truncated, so they are not the processed logprobs of that distribution "
                         "and parity score would call the difference drift; dump a rollout sampled with "
                         "top_p=1 and top_k=-1, or pass logprobs_mode='raw' when SGLang ran with "
                         "SGLANG_RETURN_ORIGINAL_LOGPROB=1")
    return dump_step(step, path, logprobs_mode=logprobs_mode)
