"""Full-distribution drift per response position: the engine's top-k against the trainer's full row.

The engine reports its k most likely tokens (ids `[N, k]`, logprobs `[N, k]`, descending); the
training forward has the whole distribution `[N, V]` under the same processing. `trainer_view`
reduces each trainer row to what the metrics need (its logprobs at the engine's ids, its own top-k,
its entropy, the sampled token's rank), so `position_drift` runs in O(N k) without the `[N, V]` rows:
that split lets the training forward reduce on its device and the metrics run over millions of
positions. Every formula, with the direction of each bound, is in docs/DISTRIBUTION.md. NumPy only
(no torch): a stored report is scored and rendered without it.

Notation per position: S the engine's top-k ids, q_i = exp(engine logprob), p_i = exp(trainer
logprob), tail masses q_T = max(0, 1 - sum_S q_i) and p_T = max(0, 1 - sum_S p_i), both computed
the same way so identical inputs give exactly 0 drift.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from parity.core.schema import DISTRIBUTION_PREFIX

#: a tail mass at or below this (a float32 sum of k probabilities rounds at ~k * 6e-8) is not
#: resolved: the KL bounds then merge the tail into the engine's most likely bucket (still a lower
#: bound, a coarser partition) instead of dividing by a rounding residue; the engine's entropy is
#: computable only then (its top-k holds all its mass).
TAIL_EPS = 1e-6

#: rows per block of `position_drift`: a block's [rows, 20] float64 temporaries (640 KiB) stay in the
#: core's L2; measured on 1M positions, 768 and 8192 rows ran 10-15% slower than 2048-4096.
BLOCK_ROWS = 4096


@dataclass(frozen=True)
class TrainerView:
    """The trainer's full distribution at each position, reduced for the metrics.

    at_engine: float64 `[N, k]` the trainer's logprobs at the engine's top-k ids.
    top_ids, top_logprobs: the trainer's own `min(k, V)` most likely tokens `[N, min(k, V)]`, descending
        (ties in any order; `trainer_view` puts the lower id first).
    entropy: float64 `[N]` the trainer's entropy in nats.
    sampled_rank: int64 `[N]` how many tokens the trainer gives a strictly higher logprob than the
        sampled token (0: the trainer's argmax, ties share the best rank).
    """

    at_engine: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    entropy: np.ndarray
    sampled_rank: np.ndarray


@dataclass(frozen=True)
class PositionDrift:
    """Per-position distribution drift, all `[N]`.

    kl_train_engine: lower bound on KL(train || engine) = sum p log(p/q), nats (inf where the trainer
        puts mass where the engine reports -inf).
    kl_engine_train: lower bound on KL(engine || train), nats.
    tv: lower bound on the total-variation distance, in [0, 1].
    overlap: how many of the engine's finite top-k entries are in the trainer's top-k (ties at the
        k-th place count as in); engine_entries: how many finite entries the engine reported.
    argmax_agrees: the engine's first entry has the trainer's highest logprob.
    entropy_train: the trainer's entropy; entropy_engine: the engine's, NaN where its tail mass is
        above `TAIL_EPS` (not computable from a top-k).
    sampled_rank: `TrainerView.sampled_rank`.
    """

    kl_train_engine: np.ndarray
    kl_engine_train: np.ndarray
    tv: np.ndarray
    overlap: np.ndarray
    engine_entries: np.ndarray
    argmax_agrees: np.ndarray
    entropy_train: np.ndarray
    entropy_engine: np.ndarray
    sampled_rank: np.ndarray


def trainer_view(rows: np.ndarray, engine_ids: np.ndarray, sampled: np.ndarray) -> TrainerView:
    """`TrainerView` of full trainer logprob rows `[N, V]` (log_softmax under the rollout's processing;
    -inf outside the support), the engine's top-k ids `[N, k]` and the sampled token ids `[N]`."""
    rows = np.asarray(rows, dtype=np.float64)
    engine_ids = np.asarray(engine_ids, dtype=np.int64)
    sampled = np.asarray(sampled, dtype=np.int64)
    n, vocab = rows.shape
    k = min(engine_ids.shape[1], vocab)
    order = np.argsort(-rows, axis=1, kind="stable")[:, :k]
    probs = np.exp(rows)
    with np.errstate(invalid="ignore"):
        entropy = -np.where(probs > 0, probs * rows, 0.0).sum(axis=1)
    chosen = rows[np.arange(n), sampled]
    return TrainerView(at_engine=np.take_along_axis(rows, engine_ids, axis=1), top_ids=order,
                       top_logprobs=np.take_along_axis(rows, order, axis=1), entropy=entropy,
                       sampled_rank=(rows > chosen[:, None]).sum(axis=1))


def position_drift(engine_logprobs: np.ndarray, view: TrainerView) -> PositionDrift:
    """Per-position drift of the engine's top-k logprobs `[N, k]` (descending) against `view`.

    Float64 arithmetic, a block of rows at a time (float32 inputs are converted per block).
    Identical inputs give exactly 0 KL and TV."""
    a_all = np.asarray(engine_logprobs)
    n = a_all.shape[0]
    out = {name: np.empty(n) for name in ("kl_pq", "kl_qp", "tv", "h_q")}
    overlap = np.empty(n, dtype=np.int64)
    entries = np.empty(n, dtype=np.int64)
    for start in range(0, n, BLOCK_ROWS):
        part = slice(start, min(n, start + BLOCK_ROWS))
        kl_pq, kl_qp, tv, h_q, over, count = _block(*(np.asarray(x[part], dtype=np.float64) for x in (
            a_all, view.at_engine, view.top_logprobs[:, -1:])))
        out["kl_pq"][part], out["kl_qp"][part], out["tv"][part], out["h_q"][part] = kl_pq, kl_qp, tv, h_q
        overlap[part], entries[part] = over, count
    return PositionDrift(kl_train_engine=out["kl_pq"], kl_engine_train=out["kl_qp"], tv=out["tv"],
                         overlap=overlap, engine_entries=entries,
                         argmax_agrees=view.at_engine[:, 0] == view.top_logprobs[:, 0],
                         entropy_train=view.entropy, entropy_engine=out["h_q"],
                         sampled_rank=view.sampled_rank)


def _block(a: np.ndarray, b: np.ndarray, kth: np.ndarray) -> tuple[np.ndarray, ...]:
    """The metrics of one block: a engine and b trainer logprobs at the engine's ids `[n, k]` (float64),
    kth the trainer's k-th largest logprob `[n, 1]`: (KL(p||q), KL(q||p), TV, engine entropy,
    overlap, engine entries), each `[n]`."""
    ones = np.ones(a.shape[1])
    q, p = np.exp(a), np.exp(b)
    q_tail = np.maximum(1.0 - q @ ones, 0.0)
    p_tail = np.maximum(1.0 - p @ ones, 0.0)
    tv = 0.5 * (np.abs(p - q) @ ones + np.abs(p_tail - q_tail))
    separate = (q_tail > TAIL_EPS) & (p_tail > TAIL_EPS)
    # an unresolved tail joins bucket 0 (the engine's first entry)
    q0 = np.where(separate, q[:, 0], q[:, 0] + q_tail)
    p0 = np.where(separate, p[:, 0], p[:, 0] + p_tail)
    with np.errstate(invalid="ignore", divide="ignore"):
        # log p0 - log q0 from the logprobs where bucket 0 is one token (exact for a tiny drift)
        d0 = b[:, 0] - a[:, 0]
        both = p[:, 0] > 0
        merged = d0 + np.log1p(p_tail / np.where(both, p[:, 0], 1.0)) - np.log1p(q_tail / q[:, 0])
        ratio = np.where(both, merged, np.log(p0) - np.log(q0))
        ratio = np.where(separate & both, d0, ratio)
        tail_pq = np.where(separate, p_tail * (np.log(p_tail) - np.log(q_tail)), 0.0)
        tail_qp = np.where(separate, q_tail * (np.log(q_tail) - np.log(p_tail)), 0.0)
        first_pq = np.where(p0 > 0, p0 * ratio, 0.0)
        first_qp = np.where(q0 > 0, -q0 * ratio, 0.0)
    computable = q_tail <= TAIL_EPS
    if a[:, -1].min(initial=0.0) > -np.inf and not np.isneginf(b).any():
        # every entry finite (the common block): no 0 log 0 conventions, one pass per sum
        d = b - a
        pq = np.einsum("ij,ij->i", p[:, 1:], d[:, 1:])
        qp = -np.einsum("ij,ij->i", q[:, 1:], d[:, 1:])
        h_q = np.where(computable, -np.einsum("ij,ij->i", q, a), np.nan)
        member = np.count_nonzero(b >= kth, axis=1)
        count = np.full(a.shape[0], a.shape[1])
    else:
        with np.errstate(invalid="ignore"):
            # bucket i in S: p_i (log p_i - log q_i), 0 where p_i = 0 (0 log 0 = 0), inf where only q_i = 0
            d = b[:, 1:] - a[:, 1:]
            pq = np.where(p[:, 1:] > 0, p[:, 1:] * d, 0.0).sum(axis=1)
            qp = np.where(q[:, 1:] > 0, -q[:, 1:] * d, 0.0).sum(axis=1)
            h_q = np.where(computable, -np.where(q > 0, q * a, 0.0).sum(axis=1), np.nan)
        finite = a > -np.inf
        member = np.count_nonzero(finite & (b >= kth) & (b > -np.inf), axis=1)
        count = np.count_nonzero(finite, axis=1)
    return (np.maximum(pq + first_pq + tail_pq, 0.0), np.maximum(qp + first_qp + tail_qp, 0.0), tv,
            h_q, member, count)


def summarize_distribution(drift: PositionDrift, top_k: int) -> dict[str, Any]:
    """The `distribution/` summary keys (`parity.core.schema.DISTRIBUTION_SUMMARY_KEYS`) of a batch.

    KL and TV: mean and max over positions with a finite value; positions with an infinite KL bound
    are counted apart. Overlap is the mean fraction of the engine's finite entries in the trainer's
    top-k; the entropy difference (engine - trainer) averages the positions where it is computable.
    """
    n = int(drift.tv.size)
    key = DISTRIBUTION_PREFIX
    infinite = ~np.isfinite(drift.kl_train_engine) | ~np.isfinite(drift.kl_engine_train)
    summary: dict[str, Any] = {f"{key}top_k": int(top_k), f"{key}num_positions": n,
                               f"{key}num_positions_infinite_kl": int(infinite.sum())}
    for name, values in (("kl_train_engine", drift.kl_train_engine),
                         ("kl_engine_train", drift.kl_engine_train), ("tv", drift.tv)):
        finite = values[np.isfinite(values)]
        summary[f"{key}{name}_mean"] = float(finite.mean()) if finite.size else float("nan")
        summary[f"{key}{name}_max"] = float(finite.max()) if finite.size else float("nan")
    summary[f"{key}top_k_overlap"] = (float((drift.overlap / np.maximum(drift.engine_entries, 1)).mean())
                                      if n else float("nan"))
    summary[f"{key}argmax_agreement"] = float(drift.argmax_agrees.mean()) if n else float("nan")
    computable = np.isfinite(drift.entropy_engine)
    diff = drift.entropy_engine[computable] - drift.entropy_train[computable]
    summary[f"{key}entropy_train_mean"] = float(drift.entropy_train.mean()) if n else float("nan")
    summary[f"{key}entropy_diff_mean"] = float(diff.mean()) if diff.size else float("nan")
    summary[f"{key}frac_positions_entropy_computable"] = float(computable.mean()) if n else float("nan")
    summary[f"{key}sampled_rank_mean"] = float(drift.sampled_rank.mean()) if n else float("nan")
    summary[f"{key}sampled_rank_max"] = int(drift.sampled_rank.max()) if n else 0
    summary[f"{key}frac_sampled_outside_train_top_k"] = (float((drift.sampled_rank >= top_k).mean())
                                                         if n else float("nan"))
    return summary


def concat_views(views: list[TrainerView]) -> TrainerView:
    """One `TrainerView` of several of one k (per-rollout views, in rollout order)."""
    return TrainerView(*(np.concatenate([getattr(v, name) for v in views])
                         for name in ("at_engine", "top_ids", "top_logprobs", "entropy", "sampled_rank")))
