"""One step's drift record from the trainer's and the rollout's logprobs of the same tokens: no
forward runs, the trainer already holds both.

Every number comes from parity's own functions on one checked `TokenArrays` (`[batch, seq]`,
responses left-aligned and right-padded, verl's layout):

    summary        `parity.metrics.summarize`: max/mean |Δlogp|, IS-ratio stats, k1/k2/k3 KL, χ²,
                   verl's probability-space `rollout_probs_diff_*`, ... (`parity.schema.SUMMARY_KEYS`)
    rollout_corr   `parity.correction.apply_correction` under the monitor's correction: verl's
                   `rollout_corr/*` metrics, by verl's names
    by_position    `parity.metrics.drift_by_position`: drift per response-position bucket
    worst_tokens   the `WORST` valid tokens of largest |Δlogp| (row, position, token id when the
                   responses are given, both logprobs), ties broken by row then position
    recommendation `parity.advisor.advise` (its recommendation only: name, reason, config, the keys
                   to paste into verl / NeMo-RL / slime), on the steps that ask for it

Heavy: parity.metrics and parity.correction compute in torch (float64, row blocks).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from parity.advisor import advise
from parity.correction.apply import apply_correction
from parity.correction.config import CorrectionConfig
from parity.metrics import drift_by_position, summarize
from parity.token_arrays import TokenArrays, token_arrays

#: worst tokens kept per step.
WORST = 10
#: bootstrap resamples behind the recommendation's bias interval (the advisor's default).
ADVICE_BOOTSTRAP = 200


def check_arrays(old_log_probs: np.ndarray, rollout_log_probs: np.ndarray, response_mask: np.ndarray,
                 names: tuple[str, str, str]) -> TokenArrays:
    """The step's inputs checked once (shapes, dtypes, NaN/+inf, -inf at a valid token, a mask
    with no valid token): `InputError` naming the array in `names`' spelling."""
    return token_arrays(old_log_probs, rollout_log_probs, response_mask, names=names)


def step_record(tok: TokenArrays, *, correction: CorrectionConfig, responses: np.ndarray | None,
                advice: bool, seed: int = 0) -> dict[str, Any]:
    """The stored record of one step (see the module doc); `tok` from `check_arrays`."""
    tok = tok.with_blocks()  # four passes over one step's blocks: convert and mask them once
    _, _, corr = apply_correction(correction, tok, metrics_only=True)
    record: dict[str, Any] = {
        "shape": list(tok.shape),
        "summary": summarize(tok),
        "rollout_corr": corr,
        "by_position": drift_by_position(tok),
        "worst_tokens": worst_tokens(tok, responses),
    }
    if advice:
        chosen = advise(tok.train.numpy(), tok.rollout.numpy(), tok.mask.numpy(), bootstrap=ADVICE_BOOTSTRAP,
                        seed=seed)
        record["recommendation"] = chosen.to_dict()["recommendation"]
    return record


def worst_tokens(tok: TokenArrays, responses: np.ndarray | None, k: int = WORST) -> list[dict[str, Any]]:
    """The `k` valid tokens of largest |Δlogp| > 0 (identical tokens are never "worst"), largest
    first, ties by row then position: `{"row", "position", "token_id" (or None), "trainer_logprob",
    "rollout_logprob", "logprob_diff"}` (nats)."""
    seq = tok.shape[1]
    values, flat = [], []
    for b in tok.blocks():
        drift = b.log_ratio.abs().flatten()  # 0 at padding
        top, where = torch.topk(drift, min(k, drift.numel()))
        keep = top > 0
        values.append(top[keep])
        flat.append(where[keep] + b.rows.start * seq)
    value = torch.cat(values).numpy()
    index = torch.cat(flat).numpy()
    order = np.lexsort((index, -value))[:k]
    rows = []
    for i in index[order]:
        r, c = divmod(int(i), seq)
        trainer, rollout = float(tok.train[r, c]), float(tok.rollout[r, c])
        rows.append({"row": r, "position": c,
                     "token_id": None if responses is None else int(responses[r, c]),
                     "trainer_logprob": trainer, "rollout_logprob": rollout,
                     "logprob_diff": trainer - rollout})
    return rows
