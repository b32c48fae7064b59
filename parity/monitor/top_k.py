"""Full-distribution drift of one monitored step: the rollout engine's top-k at every counted
response position against the trainer's distribution there. The trainer's rows are reduced where
they live (`train_top_k`), so `[tokens, V]` never reaches the monitor. NumPy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from parity.core.errors import InputError
from parity.core.logprobs import MAX_LOGPROB
from parity.core.top_k import SAME_PROCESSING_SLACK, TOP_K_MASS_SLACK, check_same_processing, check_top_k
from parity.drift.distribution import TrainerView, concat_views, position_drift, summarize_distribution
from parity.monitor.arrays import host_array

#: worst positions a step keeps (largest KL(train || rollout) bound), and entries shown per side.
WORST_POSITIONS = 10
SHOWN_ENTRIES = 5


def step_distribution(rollout_top_k: Any, train_view: TrainerView | Sequence[TrainerView] | None,
                      rollout_log_probs: np.ndarray, responses: np.ndarray | None, mask: np.ndarray,
                      uids: list[str] | None, tokenizer: Any, train_log_probs: np.ndarray | None = None
                      ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(`distribution/` summary keys, stored section with the worst positions' top-5) of the rollout's
    top-k `[batch, response_len, k]` against `train_view`(s); `InputError` / `TopKError` otherwise.
    train_log_probs `[batch, response_len]` (the step's old_log_probs) checks the view's processing.
    """
    if rollout_top_k is None or train_view is None:
        raise InputError("rollout_top_k and train_top_k come together (the rollout's top-k and the trainer's "
                         "distribution at its ids, parity.monitor.train_top_k); give both or neither")
    if not isinstance(rollout_top_k, (tuple, list)) or len(rollout_top_k) != 2:
        raise InputError("rollout_top_k must be a pair (ids, logprobs), each [batch, response_len, k]")
    if responses is None:
        raise InputError("rollout_top_k needs responses= (the sampled ids the top-k is checked against)")
    counted = mask.astype(bool)
    ids = token_ids(rollout_top_k[0], "rollout_top_k ids", counted.shape, top_k=True)
    logprobs = host_array(rollout_top_k[1], "rollout_top_k logprobs")
    if logprobs.ndim != 3 or logprobs.shape != ids.shape:
        raise InputError(f"rollout_top_k logprobs must be {list(ids.shape)} like its ids, got "
                         f"{list(logprobs.shape)}")
    dense = bool(counted.all())  # every slot counts: views, not copies of the [N, k] arrays
    trainer_lp = rollout_log_probs if train_log_probs is None else train_log_probs
    ids, logprobs, sampled, sampled_lp, trainer_lp = (
        (x.reshape(-1, *x.shape[2:]) if dense else x[counted])
        for x in (ids, logprobs, responses, rollout_log_probs, trainer_lp))
    k = ids.shape[1]
    check_top_k(ids, logprobs, "rollout_top_k")
    check_same_processing(ids, logprobs, sampled, sampled_lp, "rollout_top_k")
    view = train_view if isinstance(train_view, TrainerView) else concat_views(list(train_view))
    if view.at_engine.shape != ids.shape:
        raise InputError(f"train_top_k holds {view.at_engine.shape} values for {ids.shape} counted top-k "
                         "entries; make it with parity.monitor.train_top_k from the same ids and mask")
    _check_positions(view.sampled_ids, sampled, counted)
    _check_view(view, counted)
    if train_log_probs is not None:
        _check_train_processing(ids, view, sampled, trainer_lp, counted)
    drift = position_drift(logprobs, view)
    rows, positions = np.nonzero(counted)
    shown = min(SHOWN_ENTRIES, k)

    def side(token_ids: np.ndarray, values: np.ndarray) -> dict[str, Any]:
        out: dict[str, Any] = {"ids": token_ids[:shown].tolist(),
                               "logprobs": values[:shown].astype(float).tolist()}
        if tokenizer is not None:
            out["text"] = [str(tokenizer.decode([t])) for t in out["ids"]]
        return out

    worst = []
    for j in _largest(drift.kl_train_engine, WORST_POSITIONS):
        entry = {"row": int(rows[j]), "position": int(positions[j]),
                 "token_id": int(responses[rows[j], positions[j]]),
                 "kl_train_engine": float(drift.kl_train_engine[j]),
                 "kl_engine_train": float(drift.kl_engine_train[j]),
                 "tv": float(drift.tv[j]), "sampled_rank": int(drift.sampled_rank[j]),
                 "rollout": side(ids[j], logprobs[j]), "train": side(view.top_ids[j], view.top_logprobs[j])}
        if uids is not None:
            entry["uid"] = uids[entry["row"]]
        worst.append(entry)
    return summarize_distribution(drift, k), {"top_k": k, "worst": worst}


def _check_positions(view_sampled: np.ndarray, sampled: np.ndarray, counted: np.ndarray) -> None:
    """InputError unless the view was made at these positions (its sampled ids are theirs): views of
    micro-batches concatenated out of batch order have the right count and the wrong rows."""
    differ = view_sampled != sampled
    if differ.any():
        j = int(np.argmax(differ))
        row, position = (int(x[j]) for x in np.nonzero(counted))
        raise InputError(f"train_top_k does not line up with the rollout: at counted token {j} (row {row}, "
                         f"position {position}) the rollout sampled id {int(sampled[j])}, the view was made "
                         f"at id {int(view_sampled[j])}; pass the micro-batches' views in batch order "
                         "(verl's use_dynamic_bsz reorders micro-batches: restore their order first)")


def _check_view(view: TrainerView, counted: np.ndarray) -> None:
    """InputError unless the view's values are log_softmax values: no NaN (torch's top-k lists a NaN of
    the row first), none above 0, its top-k's mass at most 1 (to `TOP_K_MASS_SLACK`, as the rollout's)."""
    top = np.asarray(view.top_logprobs, dtype=np.float64)
    at = np.asarray(view.at_engine, dtype=np.float64)
    with np.errstate(under="ignore"):
        mass = np.exp(top).sum(axis=1) if top.size else np.zeros(top.shape[0])
    for bad, what in ((np.isnan(top).any(axis=1) | np.isnan(at).any(axis=1), "holds NaN"),
                      ((top > MAX_LOGPROB).any(axis=1) | (at > MAX_LOGPROB).any(axis=1),
                       f"holds a logprob above {MAX_LOGPROB:g}"),
                      (mass > 1.0 + TOP_K_MASS_SLACK, f"has top-k probabilities summing above 1 (by more "
                       f"than {TOP_K_MASS_SLACK:g})")):
        if bad.any():
            j = int(np.argmax(bad))
            row, position = (int(x[j]) for x in np.nonzero(counted))
            raise InputError(f"train_top_k {what} at counted token {j} (row {row}, position {position}): "
                             "not the trainer's log_softmax rows; give train_top_k finite log_softmax "
                             "values (not logits, not rows with an overflow)")


def _check_train_processing(ids: np.ndarray, view: TrainerView, sampled: np.ndarray,
                            train_lp: np.ndarray, counted: np.ndarray) -> None:
    """InputError unless the view's rows have the processing of the trainer's sampled logprobs: its value
    at the sampled id (in the rollout's or its own top-k) is the step's old_log_probs there, to
    `SAME_PROCESSING_SLACK` on average over the positions holding it. Raw (temperature 1) rows beside
    logprobs of the rollout's temperature/top-p differ there by ~0.1 nats a token; bfloat16 rounding
    (|lp| 2^-9) and a second forward pass's nondeterminism stay far below the slack on average."""
    values = np.full(sampled.shape, np.nan)
    for top_ids, top_values in ((view.top_ids, view.top_logprobs), (ids, view.at_engine)):
        hit = top_ids == sampled[:, None]
        held = hit.any(axis=1)
        values[held] = np.take_along_axis(top_values, hit.argmax(axis=1)[:, None], axis=1)[held, 0]
    with np.errstate(invalid="ignore"):
        off = np.abs(values - np.asarray(train_lp, dtype=np.float64))
    off = np.where(np.isfinite(off), off, np.nan)  # unheld or -inf on a side: not judged here
    if not np.isfinite(off).any() or np.nanmean(off) <= SAME_PROCESSING_SLACK:
        return
    j = int(np.nanargmax(off))
    row, position = (int(x[j]) for x in np.nonzero(counted))
    raise InputError(f"train_top_k was not computed under the processing of old_log_probs: the trainer's "
                     f"logprobs of the sampled tokens differ from it by {np.nanmean(off):.3g} nats "
                     "on average "
                     f"(above {SAME_PROCESSING_SLACK:g}; worst at counted token {j}, row {row}, position "
                     f"{position}: {values[j]:.4g} in the view, {float(train_lp[j]):.4g} in old_log_probs); "
                     "compute the trainer's rows for train_top_k with the same temperature/top-k/top-p as "
                     "old_log_probs and the rollout's logprobs (log_softmax(logits / temperature))")


def _largest(values: np.ndarray, k: int) -> list[int]:
    """Indices of the k largest `values` (inf first, NaN never), largest first, ties by index."""
    keyed = np.where(np.isnan(values), -np.inf, values)
    if keyed.size > k:
        cut = np.partition(keyed, keyed.size - k)[keyed.size - k]
        candidates = np.flatnonzero(keyed >= cut)
    else:
        candidates = np.arange(keyed.size)
    return candidates[np.argsort(-keyed[candidates], kind="stable")][:k].tolist()


def token_ids(value: Any, name: str, shape: tuple[int, int], *, top_k: bool = False) -> np.ndarray:
    """Token ids `[*shape]` (or `[*shape, k]` with `top_k`) as an int64 NumPy array."""
    ids = host_array(value, name)
    if ids.shape[:2] != shape or ids.ndim != 2 + top_k:
        raise InputError(f"{name} must be [{shape[0]}, {shape[1]}{', k' if top_k else ''}], got shape "
                         f"{list(ids.shape)}")
    if ids.size and ids.dtype.kind not in "iu":
        raise InputError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    return ids.astype(np.int64, copy=False)
