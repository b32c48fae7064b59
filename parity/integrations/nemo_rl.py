"""NeMo-RL: the monitor and rollout dumps from GRPO's `train_data` (a `BatchedDataDict`), read once
`train_data["prev_logprobs"]` is computed: `log_batch(monitor, step, train_data, sampling=...)`.

Whole sequences in one row; input token i's logprob at position i:

    parity               NeMo-RL                          shape / meaning
    rollout logprobs     "generation_logprobs"            [batch, seq]: the generation engine's
    trainer logprobs     "prev_logprobs"                  [batch, seq]: the policy's before the update
    mask                 "token_mask" * "sample_mask"     [batch, seq] 1 at generated tokens, times [batch]
    tokens               "input_ids"                      [batch, seq]
    lengths              "input_lengths"                  [batch]: real tokens of each row (then padding)
    sampling             not in the batch                 pass sampling={"temperature": ...}

Responses start at the first token_mask=1 and are left-aligned. Logprobs are in
`policy.generation.vllm_cfg.logprobs_mode` (vLLM's raw_logprobs when absent; megatron and dynamo
generation: processed): `dump_batch(..., generation_config=master_config["policy"]["generation"])`
reads it from there; without it and without `logprobs_mode` the dump says "processed" (NeMo-RL's
example configs set processed_logprobs). Read before
`compute_and_apply_seq_logprob_error_masking`, which zeroes the sample_mask of the sequences of
largest drift: the sequences it drops would leave the drift without a word, so the tokens a 0 in
sample_mask takes out are counted in the step's meta (`nemo_rl_sample_mask_dropped_tokens`, when
any). An all-zero `prev_logprobs` (`loss_fn.force_on_policy_ratio` skips computing it) is
refused.
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
    get_entry,
    log_step,
    optional_entry,
    sequence_batch,
)
from parity.monitor.arrays import host_array

if TYPE_CHECKING:
    from parity.monitor import Monitor

#: NeMo-RL's batch key of each array parity reads.
KEYS: dict[str, str] = {"rollout": "generation_logprobs", "trainer": "prev_logprobs", "mask": "token_mask",
                        "sample_mask": "sample_mask", "tokens": "input_ids", "lengths": "input_lengths"}
#: the meta key of the generated tokens sample_mask leaves out (its sequences' token_mask 1s).
DROPPED = "nemo_rl_sample_mask_dropped_tokens"
#: NeMo-RL's `vllm_cfg.logprobs_mode` values (vLLM's) as parity's modes.
VLLM_MODES: dict[str, str] = {"processed_logprobs": "processed", "raw_logprobs": "raw"}
#: generation backends whose logprobs are processed whatever vllm_cfg says (NeMo-RL sets them so).
PROCESSED_BACKENDS = ("megatron", "dynamo")


def read_batch(data: Mapping[str, Any], *, sampling: Mapping[str, Any] | None = None) -> StepBatch:
    """NeMo-RL's `train_data` as a `StepBatch` (responses left-aligned, see the module doc)."""
    where = "train_data"
    rollout = host_array(get_entry(data, KEYS["rollout"], where, "the generation's logprobs"),
                         KEYS["rollout"])
    trainer = host_array(get_entry(data, KEYS["trainer"], where, "policy.get_logprobs before training"),
                         KEYS["trainer"])
    token_mask = bool_mask(get_entry(data, KEYS["mask"], where, "the generated tokens"), KEYS["mask"])
    if token_mask.ndim != 2:
        raise InputError(f"token_mask must be [batch, seq], got shape {list(token_mask.shape)}")
    batch, seq = token_mask.shape
    tokens = optional_entry(data, KEYS["tokens"])
    tokens = None if tokens is None else host_array(tokens, KEYS["tokens"])
    lengths = optional_entry(data, KEYS["lengths"])
    lengths = np.full(batch, seq) if lengths is None else \
        host_array(lengths, KEYS["lengths"]).astype(np.int64).reshape(-1)
    sample = optional_entry(data, KEYS["sample_mask"])
    keep = np.ones(batch, bool) if sample is None else bool_mask(sample, KEYS["sample_mask"]).reshape(-1)
    if keep.shape != (batch,):
        raise InputError(f"{KEYS['sample_mask']} has {keep.size} entries for a batch of {batch}; give one "
                         "per row")
    names = (KEYS["rollout"], KEYS["trainer"], KEYS["mask"], KEYS["tokens"], KEYS["lengths"])
    step = sequence_batch(rollout, trainer, token_mask & keep[:, None], tokens, lengths, sampling,
                          names=names)
    dropped = int((token_mask & ~keep[:, None]).sum())
    if dropped:
        step = dataclasses.replace(step, notes={DROPPED: dropped})
    if not trainer.any() and (step.rollout[step.mask] != 0).any():
        raise InputError("prev_logprobs is 0 at every position (prompt tokens too): NeMo-RL's placeholder "
                         "when loss_fn.force_on_policy_ratio=True skips the prev_logprobs forward, not the "
                         "policy's logprobs; set grpo.seq_logprob_error_threshold (NeMo-RL then computes "
                         "them) or turn force_on_policy_ratio off to monitor this run")
    return step


def log_batch(monitor: Monitor, step: int, data: Mapping[str, Any], *,
              sampling: Mapping[str, Any] | None = None,
              meta: Mapping[str, Any] | None = None, policy_version: int | None = None,
              rollout_policy_version: int | None = None) -> dict[str, Any]:
    """Log one NeMo-RL step's `train_data` into `monitor`; returns the stored record.
    policy_version, rollout_policy_version: the trainer's and the rollout's weight versions
    (`Monitor.log`), where the loop knows them."""
    return log_step(monitor, step, read_batch(data, sampling=sampling), meta=meta,
                    policy_version=policy_version, rollout_policy_version=rollout_policy_version)


def dump_batch(data: Mapping[str, Any], path: str | Path, *, sampling: Mapping[str, Any] | None = None,
               logprobs_mode: str | None = None,
               generation_config: Mapping[str, Any] | None = None) -> Path:
    """Write one NeMo-RL step's `train_data` as a parity rollout dump that `parity score` reads
    (give the temperature in `sampling`: NeMo-RL's batch does not hold it). The logprobs' mode:
    `logprobs_mode`, else the one `generation_config` (NeMo-RL's `policy.generation`) runs, else
    sampling's `logprobs_mode`, else "processed"; `InputError` where two of them disagree."""
    mode = logprobs_mode
    if generation_config is not None:
        configured = generation_mode(generation_config)
        if mode is not None and mode != configured:
            raise InputError(f"logprobs_mode={mode!r} but generation_config generates {configured!r} "
                             "logprobs (policy.generation.vllm_cfg.logprobs_mode); drop one")
        mode = configured
    if mode is None:
        mode = str((sampling or {}).get("logprobs_mode", "processed"))
    return dump_step(read_batch(data, sampling=sampling), path, logprobs_mode=mode)


def generation_mode(config: Mapping[str, Any]) -> str:
    """The logprobs mode NeMo-RL's generation config (`policy.generation`) returns: vLLM's
    `vllm_cfg.logprobs_mode` (raw when absent, vLLM's default), processed for megatron and dynamo;
    `InputError` for another backend or an unknown mode."""
    if not isinstance(config, Mapping) or "backend" not in config:
        raise InputError("generation_config must be NeMo-RL's policy.generation config (a mapping with "
                         "'backend' and 'vllm_cfg'): master_config['policy']['generation']")
    backend = config["backend"]
    if backend in PROCESSED_BACKENDS:
        return "processed"
    if backend != "vllm":
        raise InputError(f"generation_config backend={backend!r}: parity does not know which logprobs it "
                         "returns; pass logprobs_mode='processed' or 'raw' to the dump")
    mode = (config.get("vllm_cfg") or {}).get("logprobs_mode")
    if mode is None:
        return "raw"  # NeMo-RL passes no logprobs_mode to vLLM: vLLM's default, raw_logprobs
    if mode not in VLLM_MODES:
        raise InputError(f"generation_config vllm_cfg.logprobs_mode={mode!r}: parity reads "
                         f"{sorted(VLLM_MODES)}; pass logprobs_mode to the dump")
    return VLLM_MODES[mode]
