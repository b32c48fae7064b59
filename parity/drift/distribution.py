"""Full-distribution drift per response position: the engine's top-k against the trainer's full row.

`trainer_view` reduces each trainer row `[N, V]` to what the metrics need, so `position_drift`
runs in O(N k) over millions of positions; formulas and bound directions are in
docs/DISTRIBUTION.md. NumPy only. Per position: S the engine's top-k ids, q_i / p_i the engine /
trainer probabilities, tail masses q_T = max(0, 1 - sum_S q_i) and p_T alike, computed the same
way so identical inputs give exactly 0 drift.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from parity.core.errors import ConfigError
from parity.core.schema import DISTRIBUTION_PREFIX

#: a tail mass at or below this (a float32 sum of k probabilities rounds at ~k * 6e-8) is not
#: resolved: the KL bounds then merge the tail into the engine's most likely bucket (still a lower
#: bound, a coarser partition) instead of dividing by a rounding residue; the engine's entropy is
#: computable only then (its top-k holds all its mass).
TAIL_EPS = 1e-6

#: the smallest normal float64.
_TINY = float(np.finfo(np.float64).tiny)

#: rows per block of `position_drift`: a block's [rows, 20] float64 temporaries (640 KiB) stay in the
#: core's L2; measured on 1M positions, 768 and 8192 rows ran 10-15% slower than 2048-4096.
BLOCK_ROWS = 4096

#: `position_drift`'s precision choices.
PRECISIONS = ("auto", "float32", "float64")
#: the largest relative error of NumPy's float32 `exp` against the float64 one, over every float32
#: in [-104, 0] whose exp is a normal float32 (2.13e-7 measured exhaustively, numpy 2.3.5 on AVX2,
#: ~3.6 half-ulps). Per-position error bounds that follow from it: docs/DISTRIBUTION.md, "Arithmetic".
EXP32_REL_ERROR = 2.2e-7
#: a block with a finite logprob below this takes float64 exps: exp(-87) = 1.6e-38 is still a
#: normal float32, further down float32 loses relative precision and then underflows to 0 (a finite
#: KL would become inf).
EXP32_FLOOR = -87.0


@dataclass(frozen=True)
class TrainerView:
    """The trainer's full distribution at each position, reduced for the metrics.

    at_engine: float64 `[N, k]` logprobs at the engine's top-k ids. top_ids, top_logprobs: its own
    `[N, min(k, V)]`, descending (lower id first on ties). entropy: float64 `[N]` nats.
    sampled_rank: int64 `[N]` tokens with a strictly higher logprob than the sampled one.
    sampled_ids: int64 `[N]` the sampled ids the view was made at, so that a view compared with
    other positions (micro-batch views out of batch order) is refused rather than misread.
    """

    at_engine: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    entropy: np.ndarray
    sampled_rank: np.ndarray
    sampled_ids: np.ndarray


@dataclass(frozen=True)
class PositionDrift:
    """Per-position distribution drift, all `[N]`.

    kl_train_engine, kl_engine_train: lower bounds on KL(train || engine) and KL(engine || train),
    nats (inf where the trainer has mass where the engine reports -inf). tv: lower bound on total
    variation. overlap: the engine's finite top-k entries in the trainer's top-k (ties count as in),
    of engine_entries. argmax_agrees: the engine's first entry is the trainer's top.
    entropy_train; entropy_engine: NaN where its tail mass exceeds `TAIL_EPS`. sampled_rank.
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
                       sampled_rank=(rows > chosen[:, None]).sum(axis=1), sampled_ids=sampled)


def position_drift(engine_logprobs: np.ndarray, view: TrainerView, *,
                   precision: str = "auto") -> PositionDrift:
    """Per-position drift of the engine's top-k logprobs `[N, k]` (descending) against `view`.

    precision: "float32" takes probabilities as a float32 `exp` (~4x faster without AVX-512; error
    bounds in docs/DISTRIBUTION.md, "Arithmetic"); "auto" picks it when both inputs are float32;
    every other step is float64. Identical inputs give exactly 0 KL and TV on either path.
    """
    a_all = np.asarray(engine_logprobs)
    fast = _fast_exp(precision, a_all, np.asarray(view.at_engine))
    n = a_all.shape[0]
    out = {name: np.empty(n) for name in ("kl_pq", "kl_qp", "tv", "h_q")}
    overlap = np.empty(n, dtype=np.int64)
    entries = np.empty(n, dtype=np.int64)
    agrees = np.empty(n, dtype=bool)
    # one set of block arrays reused block to block: a fresh [4096, k] float64 array is above glibc's
    # mmap threshold, and faulting its pages in again for every block cost more than the arithmetic
    work = _Work(min(n, BLOCK_ROWS), a_all.shape[1] if a_all.ndim == 2 else 0)
    for start in range(0, n, BLOCK_ROWS):
        part = slice(start, min(n, start + BLOCK_ROWS))
        a, b, q, p = work.load(a_all[part], view.at_engine[part], fast)
        top = view.top_logprobs[part]
        # the argmax here, while the block's rows are in cache (a pass of its own re-read both arrays)
        np.equal(view.at_engine[part, 0], top[:, 0], out=agrees[part])
        kth = np.asarray(top[:, -1:], dtype=np.float64)
        kl_pq, kl_qp, tv, h_q, over, count = _block(a, b, q, p, kth, work)
        out["kl_pq"][part], out["kl_qp"][part], out["tv"][part], out["h_q"][part] = kl_pq, kl_qp, tv, h_q
        overlap[part], entries[part] = over, count
    return PositionDrift(kl_train_engine=out["kl_pq"], kl_engine_train=out["kl_qp"], tv=out["tv"],
                         overlap=overlap, engine_entries=entries,
                         argmax_agrees=agrees,
                         entropy_train=view.entropy, entropy_engine=out["h_q"],
                         sampled_rank=view.sampled_rank)


class _Work:
    """`position_drift`'s block arrays `[rows, k]`: logprobs a, b and probabilities q, p (float64),
    a scratch array and a float32 one for the fast exp, a bool mask."""

    def __init__(self, rows: int, k: int) -> None:
        self.a, self.b, self.q, self.p, self.scratch = (np.empty((rows, k)) for _ in range(5))
        self.exp32 = np.empty((rows, k), dtype=np.float32)
        self.mask = np.empty((rows, k), dtype=bool)

    def load(self, a_in: np.ndarray, b_in: np.ndarray, fast: bool) -> tuple[np.ndarray, ...]:
        """(a, b, q, p) of one block, views of the arrays (`position_drift`'s `precision`)."""
        m = a_in.shape[0]
        a, b, q, p = self.a[:m], self.b[:m], self.q[:m], self.p[:m]
        np.copyto(a, a_in)
        np.copyto(b, b_in)
        fast = fast and not (_below_floor(a) or _below_floor(b))
        for logprobs, widened, probs in ((a_in, a, q), (b_in, b, p)):
            if fast:
                # float32 exp of the float32 values, widened: within EXP32_REL_ERROR of exp(a)
                np.exp(logprobs, out=self.exp32[:m])
                np.copyto(probs, self.exp32[:m])
            else:
                np.exp(widened, out=probs)
        return a, b, q, p


def _below_floor(x: np.ndarray) -> bool:
    """Whether a finite value of `x` is below `EXP32_FLOOR` (its float32 exp would leave the normal range)."""
    low = x.min(initial=0.0)
    if low >= EXP32_FLOOR:
        return False
    if low > -np.inf:
        return True
    return bool(((x < EXP32_FLOOR) & (x > -np.inf)).any())


def _fast_exp(precision: str, engine: np.ndarray, train: np.ndarray) -> bool:
    """Whether `position_drift` takes its probabilities as float32 exps (see its `precision`)."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "auto":
        return engine.dtype == np.float32 and train.dtype == np.float32
    return precision == "float32"


def _block(a: np.ndarray, b: np.ndarray, q: np.ndarray, p: np.ndarray, kth: np.ndarray, work: _Work
           ) -> tuple[np.ndarray, ...]:
    """(KL(p||q), KL(q||p), TV, engine entropy, overlap, engine entries), each `[n]`, of one block of
    logprobs a, b `[n, k]` at the engine's ids (kth: the trainer's k-th largest `[n, 1]`).
    """
    ones = np.ones(a.shape[1])
    scratch, mask = work.scratch[:a.shape[0]], work.mask[:a.shape[0]]
    q_tail = np.maximum(1.0 - q @ ones, 0.0)
    p_tail = np.maximum(1.0 - p @ ones, 0.0)
    np.subtract(p, q, out=scratch)
    tv = 0.5 * (np.abs(scratch, out=scratch) @ ones + np.abs(p_tail - q_tail))
    separate = (q_tail > TAIL_EPS) & (p_tail > TAIL_EPS)
    with np.errstate(invalid="ignore"):
        # log p0 - log q0 from the logprobs where bucket 0 is one token (exact for a tiny drift)
        d0 = b[:, 0] - a[:, 0]
    if separate.all() and (p[:, 0] > 0).all() and (q[:, 0] > 0).all():
        # the common block: every tail resolved, bucket 0 one token of mass on both sides
        with np.errstate(divide="ignore"):
            log_tails = np.log(p_tail / q_tail)
        first_pq, first_qp = p[:, 0] * d0, -q[:, 0] * d0
        tail_pq, tail_qp = p_tail * log_tails, -q_tail * log_tails
    else:
        first_pq, first_qp, tail_pq, tail_qp = _first_and_tail(q, p, q_tail, p_tail, separate, a[:, 0],
                                                                b[:, 0])
    computable = q_tail <= TAIL_EPS
    h_q = np.full(a.shape[0], np.nan)
    if a[:, -1].min(initial=0.0) > -np.inf and b.min(initial=0.0) > -np.inf:
        # every entry finite (the common block): no 0 log 0 conventions, one pass per sum
        d = np.subtract(b, a, out=scratch)
        pq = np.einsum("ij,ij->i", p[:, 1:], d[:, 1:])
        qp = -np.einsum("ij,ij->i", q[:, 1:], d[:, 1:])
        if computable.any():  # the engine's entropy only where its top-k holds its mass (often no row)
            h_q[computable] = -np.einsum("ij,ij->i", q[computable], a[computable])
        # a row sum by BLAS over the mask as 0.0/1.0: half the time of count_nonzero(axis=1)
        np.copyto(scratch, np.greater_equal(b, kth, out=mask))
        member = (scratch @ ones).astype(np.int64)
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


def _first_and_tail(q: np.ndarray, p: np.ndarray, q_tail: np.ndarray, p_tail: np.ndarray,
                    separate: np.ndarray, a0: np.ndarray, b0: np.ndarray) -> tuple[np.ndarray, ...]:
    """Bucket 0's and the tail bucket's terms of both KL sums `[n]` (a0, b0: the engine's and the
    trainer's logprob of s_1): an unresolved tail merged into bucket 0, zero masses by the 0 log 0
    conventions. A side has mass at s_1 where its logprob is finite: exp(-800) underflows to 0, yet
    it is no -inf (an infinite bound, out of the KL means) but a finite log ratio of ~800.
    """
    # an unresolved tail joins bucket 0 (the engine's first entry)
    q0 = np.where(separate, q[:, 0], q[:, 0] + q_tail)
    p0 = np.where(separate, p[:, 0], p[:, 0] + p_tail)
    mass_q0, mass_p0 = a0 > -np.inf, b0 > -np.inf
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        d0 = b0 - a0
        both = p[:, 0] >= _TINY  # a subnormal p_0 holds a few bits: p_tail / p_0 would be noise
        merged = d0 + np.log1p(p_tail / np.where(both, p[:, 0], 1.0)) - np.log1p(q_tail / q[:, 0])
        # the merged masses' log ratio in log space, where p_0 underflows (or p_tail / p_0 overflows)
        logs = np.logaddexp(b0, np.log(p_tail)) - np.logaddexp(a0, np.log(q_tail))
        ratio = np.where(both & np.isfinite(merged), merged, logs)
        ratio = np.where(separate & mass_p0 & mass_q0, d0, ratio)
        tail_pq = np.where(separate, p_tail * (np.log(p_tail) - np.log(q_tail)), 0.0)
        tail_qp = np.where(separate, q_tail * (np.log(q_tail) - np.log(p_tail)), 0.0)
        first_pq = np.where(p0 > 0, p0 * ratio, 0.0)
        first_qp = np.where(q0 > 0, -q0 * ratio, 0.0)
    # s_1 with mass on one side only is infinite whatever the tail (the partition with s_1 alone is one
    # too): a tail merged into its bucket would otherwise give it the other side's residue as mass
    first_pq = np.where(mass_p0 & ~mass_q0, np.inf, first_pq)
    first_qp = np.where(mass_q0 & ~mass_p0, np.inf, first_qp)
    return first_pq, first_qp, tail_pq, tail_qp


def summarize_distribution(drift: PositionDrift, top_k: int) -> dict[str, Any]:
    """The `distribution/` summary keys of a batch: KL and TV mean and max (a position with either KL
    bound infinite counted apart and kept out of both KL means), mean overlap fraction, and mean
    entropy difference (engine - trainer) where computable. With no position every measured key is
    NaN (`num_positions` 0), and `top_k` is NaN where `top_k` <= 0 (no k known).
    """
    n = int(drift.tv.size)
    key = DISTRIBUTION_PREFIX
    infinite = ~np.isfinite(drift.kl_train_engine) | ~np.isfinite(drift.kl_engine_train)
    # no k known (no position carried a row) reads as unmeasured, not as a k of 0
    summary: dict[str, Any] = {f"{key}top_k": int(top_k) if top_k > 0 else float("nan"),
                               f"{key}num_positions": n,
                               f"{key}num_positions_infinite_kl": int(infinite.sum())}
    # a position infinite in one direction is out of both KL means (docs/DISTRIBUTION.md): its other
    # bound may be a vacuous 0 (the two sides' mass on different tokens) that would read as agreement
    for name, values in (("kl_train_engine", drift.kl_train_engine[~infinite]),
                         ("kl_engine_train", drift.kl_engine_train[~infinite]), ("tv", drift.tv)):
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
    # no position measured: NaN like the other keys, not a rank of 0 that reads as full agreement
    summary[f"{key}sampled_rank_max"] = int(drift.sampled_rank.max()) if n else float("nan")
    summary[f"{key}frac_sampled_outside_train_top_k"] = (float((drift.sampled_rank >= top_k).mean())
                                                         if n else float("nan"))
    return summary


def concat_views(views: list[TrainerView]) -> TrainerView:
    """One `TrainerView` of several of one k (per-rollout views, in rollout order)."""
    return TrainerView(*(np.concatenate([getattr(v, f.name) for v in views]) for f in fields(TrainerView)))
