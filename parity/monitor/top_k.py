"""Full-distribution drift of one monitored step: the rollout engine's top-k at every counted
response position against the trainer's distribution there. The trainer's rows are reduced where
they live (`train_top_k`), so `[tokens, V]` never reaches the monitor. NumPy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from parity.core.errors import InputError
from parity.core.top_k import check_same_processing, check_top_k
from parity.drift.distribution import TrainerView, concat_views, position_drift, summarize_distribution
from parity.monitor.arrays import host_array

#: worst positions a step keeps (largest KL(train || rollout) bound), and entries shown per side.
WORST_POSITIONS = 10
SHOWN_ENTRIES = 5


def step_distribution(rollout_top_k: Any, train_view: TrainerView | Sequence[TrainerView] | None,
                      rollout_log_probs: np.ndarray, responses: np.ndarray | None, mask: np.ndarray,
                      uids: list[str] | None, tokenizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(`distribution/` summary keys, stored section with the worst positions' top-5) of the rollout's
    top-k `[batch, response_len, k]` against `train_view`(s); `InputError` / `TopKError` otherwise.
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
    ids, logprobs, sampled, sampled_lp = ((x.reshape(-1, *x.shape[2:]) if dense else x[counted])
                                          for x in (ids, logprobs, responses, rollout_log_probs))
    k = ids.shape[1]
    check_top_k(ids, logprobs, "rollout_top_k")
    check_same_processing(ids, logprobs, sampled, sampled_lp, "rollout_top_k")
    view = train_view if isinstance(train_view, TrainerView) else concat_views(list(train_view))
    if view.at_engine.shape != ids.shape:
        raise InputError(f"train_top_k holds {view.at_engine.shape} values for {ids.shape} counted top-k "
                         "entries; make it with parity.monitor.train_top_k from the same ids and mask")
    _check_positions(view.sampled_ids, sampled, counted)
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
