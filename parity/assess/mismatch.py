"""A recorded sampling that looks wrong: the rollout logprobs match the training forward under
another temperature, top-p/top-k or logprobs mode far better than under the one recorded.

Such a mismatch is a data bug no correction fixes, invisible in the two arrays alone. It runs
only when the mean |Δlogp| is at least `MIN_DRIFT` nats, scoring up to `PROBE_SEQUENCES`
rollouts per alternative (`alternatives`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np

from parity.advisor.diagnose import BETTER, MIN_DRIFT
from parity.core.types import Rollout, SamplingParams

#: rollouts the probe scores under each alternative (the first ones that record their sampling).
PROBE_SEQUENCES = 32
#: temperatures the probe tries besides the recorded one.
TEMPERATURES = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.5)


def alternatives(s: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """(what changed, the sampling) of each setting the probe tries instead of `s`: the other
    temperatures, the other logprobs mode, and no truncation (raw logprobs ignore temperature and
    truncation, so a raw record is tried as processed at each temperature)."""
    if s.logprobs_mode == "raw":
        processed = s.replace(logprobs_mode="processed")
        return [(f"processed logprobs at temperature={t}", processed.replace(temperature=t))
                for t in dict.fromkeys((s.temperature, *TEMPERATURES)) if t > 0]
    out = [(f"temperature={t}", s.replace(temperature=t)) for t in TEMPERATURES if t != s.temperature]
    out.append(("raw logprobs (log_softmax of the unmodified logits)", s.replace(logprobs_mode="raw")))
    if s.top_p < 1.0 or s.top_k:
        out.append(("top_p=1.0, top_k=0 (no truncation)", s.replace(top_p=1.0, top_k=0)))
    return out


def _definition(s: SamplingParams) -> tuple[float, int, float, str]:
    """What a rollout's logprobs depend on: (temperature, top_k, top_p, logprobs mode)."""
    return (s.temperature, s.top_k, s.top_p, s.logprobs_mode)


def sampling_findings(model: str | os.PathLike[str], rollouts: Sequence[Rollout],
                      train_logprobs: Sequence[np.ndarray], *, dtype: str, device: str, kernels: str,
                      tensor_parallel_size: int | None = None,
                      reduction_groups: int | None = None, router_replay: str | None = None,
                      lora: str | os.PathLike[str] | None = None) -> list[str]:
    """One sentence when another setting matches far better (`BETTER`) than the recorded one; []
    otherwise. Only rollouts of one recorded setting are probed (a sweep's blocks differ on purpose).
    router_replay, lora: as `train_logprobs` were scored, so each alternative differs from them in its
    sampling alone (without them a LoRA given for rollouts recording none was probed on the base model).
    """
    chosen = [i for i, r in enumerate(rollouts) if r.sampling is not None and r.response_mask is None]
    if not chosen:
        return []
    recorded = rollouts[chosen[0]].sampling
    chosen = [i for i in chosen if _definition(rollouts[i].sampling) == _definition(recorded)]
    chosen = chosen[:PROBE_SEQUENCES]
    sample = [rollouts[i] for i in chosen]
    rollout_lp = np.concatenate([np.asarray(r.logprobs, np.float64) for r in sample])
    aligned = _error(np.concatenate([np.asarray(train_logprobs[i], np.float64) for i in chosen]), rollout_lp)
    if aligned is None or aligned < MIN_DRIFT:
        return []
    from parity.engine import train_forward  # torch: the report's light modules never reach this

    best: tuple[float, str] | None = None
    for what, alt in alternatives(recorded):
        moved = [dataclasses.replace(r, sampling=alt, logprobs_mode=alt.logprobs_mode) for r in sample]
        scored = train_forward(model, moved, dtype=dtype, device=device, kernels=kernels,
                               tensor_parallel_size=tensor_parallel_size, reduction_groups=reduction_groups,
                               router_replay=router_replay, lora=lora).logprobs
        error = _error(np.concatenate([lp.detach().cpu().double().numpy() for lp in scored]), rollout_lp)
        if error is not None and (best is None or error < best[0]):
            best = (error, what)
    if best is None or best[0] >= BETTER * aligned:
        return []
    return [f"the rollout logprobs match the training forward with {best[1]} (mean |Δlogp| {best[0]:.3g} "
            f"nats over {len(sample)} sequences) far better than with the recorded temperature="
            f"{recorded.temperature}, top_p={recorded.top_p}, top_k={recorded.top_k}, "
            f"{recorded.logprobs_mode} logprobs ({aligned:.3g}); the sampling recorded for these rollouts "
            "looks wrong: check what the rollout engine was given"]


def _error(train: np.ndarray, rollout: np.ndarray) -> float | None:
    """Mean |train - rollout| over tokens finite on both sides, or None when there are none."""
    finite = np.isfinite(train) & np.isfinite(rollout)
    return float(np.mean(np.abs(train[finite] - rollout[finite]))) if finite.any() else None
