"""Every candidate correction's figures from one pass over the per-token arrays, in NumPy.

Token-level families are `[thresholds, tokens]` matrices chunked by whole sequences and reduced
to `[sequences, candidates]` sums; sequence-level ones are `[sequences, thresholds]` from the
start. Formulas are `parity.drift.ratio_rules`; each figure is defined in docs/ADVISOR.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parity.advisor.grid import Candidate
from parity.core.errors import InputError
from parity.core.logprobs import check_logprob_array
from parity.correction.config import RejectionRule
from parity.drift.bootstrap import bootstrap_ratio
from parity.drift.ratio_rules import (
    ESTIMATORS,
    band_weights,
    clamp_log_ratio,
    in_band,
    ratio,
    sequence_log_ratio,
    token_statistic,
    truncate,
)

#: tokens per chunk of the `[thresholds, tokens]` matrices (whole sequences; 64 KiB a row, so a
#: family's temporaries stay in cache).
CHUNK_TOKENS = 1 << 13
#: row of each estimator in `_SeqStats.k_rows`.
ESTIMATOR_ROWS = {e: i for i, e in enumerate(ESTIMATORS)}
#: the figures of each candidate, in table order.
FIGURES: tuple[str, ...] = (
    "frac_tokens_truncated", "frac_seqs_truncated", "frac_tokens_removed", "frac_seqs_removed",
    "ess", "max_weight", "weight_var", "mass_removed", "drift_removed", "bias", "bias_low", "bias_high",
)


@dataclass(frozen=True)
class Tokens:
    """The valid tokens of a batch, row-major, float64: log_ratio Δ `[N]` (nats), train `[N]`, lengths
    `[S]` (non-empty sequences). After a rejection (`subset`), seq_log_ratio and seq_tokens `[S]`:
    each sequence's Σ Δ and token count before it, which a sequence-level IS weight is still taken
    over (verl weighs on the original mask); None: these tokens' own.
    """

    log_ratio: np.ndarray
    train: np.ndarray
    lengths: np.ndarray
    seq_log_ratio: np.ndarray | None = None
    seq_tokens: np.ndarray | None = None

    def __post_init__(self) -> None:
        # per-sequence sums are np.add.reduceat over the lengths: an empty sequence would get its
        # next token's value, and lengths that do not add up to the tokens would shift every sum
        lengths, n = np.asarray(self.lengths), np.size(self.log_ratio)
        total, least = int(lengths.sum()), int(lengths.min()) if lengths.size else None
        if lengths.ndim != 1 or (least is not None and least < 1) or total != n \
                or np.shape(self.train) != np.shape(self.log_ratio):
            raise InputError(f"advise: Tokens.lengths must be the positive token counts of the sequences, "
                             f"summing to the {n} tokens of log_ratio and train (got lengths summing to "
                             f"{total}, least {least}; train {np.shape(self.train)})")

    @classmethod
    def from_arrays(cls, train_logprobs: Any, rollout_logprobs: Any, mask: Any) -> Tokens:
        """From `[batch, seq]` arrays (NumPy, or anything `np.asarray` reads) and a 0/1 mask.
        Logprobs must be finite and <= `MAX_LOGPROB` where `mask` is set; empty rows are dropped."""
        train, rollout, given = np.asarray(train_logprobs), np.asarray(rollout_logprobs), np.asarray(mask)
        if train.ndim != 2 or train.shape != rollout.shape or train.shape != given.shape:
            raise InputError(f"advise: train_logprobs {train.shape}, rollout_logprobs {rollout.shape} and "
                             f"mask {given.shape} must be 2-D [batch, seq] arrays of one shape")
        # as everywhere else in parity: a NaN, 2, -1 or 0.5 (a loss weight) is not "counts", and
        # astype(bool) read each as a valid token
        if given.dtype != bool and not np.isin(given, (0, 1)).all():
            raise InputError("advise: mask must be bool or hold only 0 and 1 (1 = token counts)")
        valid = given.astype(bool)
        t, r = train[valid].astype(np.float64), rollout[valid].astype(np.float64)
        if not (np.isfinite(t).all() and np.isfinite(r).all()):
            raise InputError("advise: logprobs must be finite wherever mask is set (leave tokens outside "
                             "either side's support out of the mask)")
        check_logprob_array(train, valid, "advise: train_logprobs")
        check_logprob_array(rollout, valid, "advise: rollout_logprobs")
        lengths = valid.sum(axis=1)
        return cls(t - r, t, lengths[lengths > 0].astype(np.int64))

    @property
    def starts(self) -> np.ndarray:
        """Index of each sequence's first token `[S]`."""
        return np.concatenate(([0], np.cumsum(self.lengths)[:-1])).astype(np.int64)

    def subset(self, keep: np.ndarray) -> Tokens:
        """The tokens where `keep` `[N]` is set; sequences left empty are dropped. Each kept sequence
        keeps its whole Σ Δ and token count for sequence-level IS weights."""
        seq = np.repeat(np.arange(self.lengths.size), self.lengths)
        lengths = np.bincount(seq[keep], minlength=self.lengths.size)
        full_sum = np.add.reduceat(self.log_ratio, self.starts) if self.seq_log_ratio is None \
            else self.seq_log_ratio
        full_n = self.lengths if self.seq_tokens is None else self.seq_tokens
        kept = lengths > 0
        return Tokens(self.log_ratio[keep], self.train[keep], lengths[kept].astype(np.int64),
                      full_sum[kept], full_n[kept])


@dataclass(frozen=True)
class Drift:
    """The batch's drift before any correction: max |Δ| (nats), the variance of the untruncated
    token ratios r_t = exp(Δ_t), mean k3 KL per token and the token and sequence counts."""

    max_abs_log_ratio: float
    ratio_var: float
    k3_mean: float
    tokens: int
    sequences: int


@dataclass
class _Sums:
    """Per-sequence sums `[S, columns]` of one family and each column's largest weight."""

    w: np.ndarray
    w2: np.ndarray
    wl: np.ndarray
    removed_mass: np.ndarray
    truncated: np.ndarray
    removed: np.ndarray
    kept_k3: np.ndarray
    ref: np.ndarray
    ref_l: np.ndarray
    max_weight: np.ndarray = field(default_factory=lambda: np.zeros(0))


@dataclass(frozen=True)
class Evaluation:
    """Every candidate's figures (`FIGURES`, each `[candidates]`) and the batch's `Drift`."""

    candidates: tuple[Candidate, ...]
    figures: dict[str, np.ndarray]
    drift: Drift
    bootstrap: int

    def row(self, i: int) -> dict[str, float]:
        return {name: float(self.figures[name][i]) for name in FIGURES}


class _SeqStats:
    """Per-sequence sums and maxima of the token quantities every family reads `[S]`."""

    def __init__(self, tok: Tokens) -> None:
        starts = tok.starts
        c = clamp_log_ratio(tok.log_ratio)
        r = ratio(c)
        self.n = tok.lengths.astype(np.float64)
        add = np.add.reduceat
        self.sum_d = add(tok.log_ratio, starts)
        self.sum_l = add(tok.train, starts)
        self.sum_r = add(r, starts)
        self.sum_r2 = add(r * r, starts)
        self.sum_rl = add(r * tok.train, starts)
        self.excess = add(np.maximum(r - 1.0, 0.0), starts)
        self.max_r = np.maximum.reduceat(r, starts)
        self.k_rows = np.stack([token_statistic(e, c) for e in ESTIMATORS])  # [3, N]
        self.k = dict(zip(ESTIMATORS, self.k_rows))
        self.sum_k = {e: add(v, starts) for e, v in self.k.items()}
        self.max_k = {e: np.maximum.reduceat(v, starts) for e, v in self.k.items()}
        self.clamped, self.ratio = c, r
        # what sequence-level IS weights are taken over: the whole sequence, rejected tokens included
        self.is_sum_d = self.sum_d if tok.seq_log_ratio is None else tok.seq_log_ratio
        self.is_n = self.n if tok.seq_tokens is None else tok.seq_tokens.astype(np.float64)


def _token_family(family: str, cands: Sequence[Candidate], tok: Tokens, st: _SeqStats) -> _Sums:
    """Per-sequence sums of a token-level family, thresholds as contiguous rows, chunk by chunk."""
    cols = len(cands)
    shape = (cols, tok.lengths.size)
    names = ("w", "w2", "wl", "removed_mass", "truncated", "removed", "kept_k3")
    sums = {name: np.zeros(shape) for name in names}
    max_weight = np.zeros(cols)
    rules = [c.config for c in cands]
    if family == "token_tis":
        upper = np.array([[c.is_rule.upper] for c in rules])
    elif family == "icepop":
        lower = np.array([[c.is_rule.band_lower] for c in rules])
        upper = np.array([[c.is_rule.upper] for c in rules])
    else:
        which = np.array([ESTIMATOR_ROWS[c.rs_rules[0].estimator] for c in rules])
        lower = np.array([[-np.inf if c.rs_rules[0].lower is None else c.rs_rules[0].lower] for c in rules])
        upper = np.array([[c.rs_rules[0].upper] for c in rules])
    ends = np.cumsum(tok.lengths)
    add = np.add.reduceat
    first = 0
    while first < tok.lengths.size:
        # whole sequences, about CHUNK_TOKENS tokens (at least one sequence)
        start_tok = int(ends[first] - tok.lengths[first])
        last = max(first + 1, int(np.searchsorted(ends, start_tok + CHUNK_TOKENS, side="right")))
        span = slice(start_tok, int(ends[last - 1]))
        local = (ends[first:last] - tok.lengths[first:last] - start_tok).astype(np.int64)
        rows = slice(first, last)
        r, train, k3 = st.ratio[span], tok.train[span], st.k["k3"][span]
        if family == "token_tis":
            w = truncate(r, upper)
            sums["truncated"][:, rows] = add((r > upper).astype(np.float64), local, axis=1)
            sums["removed_mass"][:, rows] = add(r - w, local, axis=1)  # w <= r
            sums["kept_k3"][:, rows] = st.sum_k["k3"][rows]
        else:
            if family == "icepop":
                w = band_weights(r, lower, upper)
                removed_mass = r - w  # w is r or 0
            else:
                w = in_band(st.k_rows[which, span], lower, upper).astype(np.float64)
                removed_mass = np.maximum(r - w, 0.0)
            sums["removed_mass"][:, rows] = add(removed_mass, local, axis=1)
            # ratios are >= exp(-20) > 0, so a zero weight is a masked or rejected token
            kept = w > 0
            sums["removed"][:, rows] = tok.lengths[rows] - add(kept.astype(np.float64), local, axis=1)
            sums["kept_k3"][:, rows] = add(np.where(kept, k3, 0.0), local, axis=1)
        sums["w"][:, rows] = add(w, local, axis=1)
        sums["w2"][:, rows] = sums["w"][:, rows] if family == "token_rs" else add(w * w, local, axis=1)
        sums["wl"][:, rows] = add(w * train, local, axis=1)
        max_weight = np.maximum(max_weight, w.max(axis=1))
        first = last
    return _Sums(**{k: v.T for k, v in sums.items()}, ref=np.repeat(st.sum_r[:, None], cols, 1),
                 ref_l=np.repeat(st.sum_rl[:, None], cols, 1), max_weight=max_weight)


def _sequence_family(family: str, cands: Sequence[Candidate], st: _SeqStats) -> _Sums:
    """Per-sequence sums of a sequence-level family (or "none"): `[S, thresholds]` from `[S]` sums."""
    n = st.n[:, None]
    rules = [c.config for c in cands]
    zeros = np.zeros((n.shape[0], len(cands)))
    if family in ("sequence_tis", "geometric_tis"):
        level = rules[0].is_rule.level
        raw = ratio(clamp_log_ratio(sequence_log_ratio(st.is_sum_d, st.is_n, level)))[:, None]
        w = truncate(raw, np.array([c.is_rule.upper for c in rules]))
        return _Sums(w=n * w, w2=n * w * w, wl=w * st.sum_l[:, None], removed_mass=n * (raw - w),
                     truncated=n * (raw > w), removed=zeros, kept_k3=zeros + st.sum_k["k3"][:, None],
                     ref=zeros + n * raw, ref_l=zeros + raw * st.sum_l[:, None], max_weight=w.max(axis=0))
    if family == "none":
        keep = np.ones_like(zeros, dtype=bool)
    elif family == "seq_mask_tis":
        geo = sequence_log_ratio(st.is_sum_d, st.is_n, "geometric")[:, None]
        lower = np.log([c.is_rule.band_lower for c in rules])
        keep = in_band(geo, lower, np.log([c.is_rule.upper for c in rules]))
    else:  # seq_rs
        keep = np.stack([_keeps_sequences(st, cfg.rs_rules[0]) for cfg in rules], axis=1)
    ref, ref_l = zeros + st.sum_r[:, None], zeros + st.sum_rl[:, None]
    if family == "seq_mask_tis":  # untruncated token weights on kept sequences
        w, w2, wl = keep * st.sum_r[:, None], keep * st.sum_r2[:, None], keep * st.sum_rl[:, None]
        max_weight = np.where(keep, st.max_r[:, None], 0.0).max(axis=0)
        removed_mass = ~keep * st.sum_r[:, None]
    else:  # weight 1 on kept sequences
        w, w2, wl = keep * n, keep * n, keep * st.sum_l[:, None]
        max_weight = keep.any(axis=0).astype(np.float64)
        removed_mass = np.where(keep, st.excess[:, None], st.sum_r[:, None])
    return _Sums(w=w, w2=w2, wl=wl, removed_mass=removed_mass, truncated=zeros, removed=~keep * n,
                 kept_k3=keep * st.sum_k["k3"][:, None], ref=ref, ref_l=ref_l, max_weight=max_weight)


def evaluate(tok: Tokens, candidates: Sequence[Candidate], *, bootstrap: int = 200, seed: int = 0,
             confidence: float = 0.95) -> Evaluation:
    """Every candidate's figures on `tok`, and the residual bias's Poisson bootstrap interval (0: NaN)."""
    if tok.lengths.size == 0:
        raise InputError("advise: no valid tokens to evaluate (the mask is empty)")
    st = _SeqStats(tok)
    n_tok = float(tok.lengths.sum())
    order: dict[str, list[int]] = {}
    for i, cand in enumerate(candidates):
        order.setdefault(cand.family, []).append(i)
    parts: list[tuple[list[int], _Sums]] = []
    for family, idx in order.items():
        group = [candidates[i] for i in idx]
        if family in ("token_tis", "icepop", "token_rs"):
            sums = _token_family(family, group, tok, st)
        elif family in ("none", "sequence_tis", "geometric_tis", "seq_mask_tis", "seq_rs"):
            sums = _sequence_family(family, group, st)
        else:
            raise InputError(f"advise: candidate {group[0].name!r} combines options; the grid evaluates "
                             "single corrections (the recommendation combines them)")
        parts.append((idx, sums))
    cols = len(candidates)
    merged = {name: np.zeros((tok.lengths.size, cols)) for name in
              ("w", "w2", "wl", "removed_mass", "truncated", "removed", "kept_k3", "ref", "ref_l")}
    max_weight = np.zeros(cols)
    for idx, sums in parts:
        for name, arr in merged.items():
            arr[:, idx] = getattr(sums, name)
        max_weight[idx] = sums.max_weight
    m = merged
    w_sum, w2_sum = m["w"].sum(0), m["w2"].sum(0)
    k3_total = float(st.sum_k["k3"].sum())
    bias_seq = m["wl"] - m["ref_l"]
    figures = {
        "frac_tokens_truncated": m["truncated"].sum(0) / n_tok,
        "frac_seqs_truncated": (m["truncated"] > 0).mean(0),
        "frac_tokens_removed": m["removed"].sum(0) / n_tok,
        "frac_seqs_removed": (m["removed"] > 0).mean(0),
        # clipped to what they are (ESS <= 1 by Cauchy-Schwarz, a variance >= 0): equal weights left
        # 1 + 2e-16 and -2e-15 from the per-sequence sums
        "ess": np.minimum(np.divide(w_sum * w_sum, n_tok * w2_sum, out=np.zeros(cols), where=w2_sum > 0),
                          1.0),
        "max_weight": max_weight,
        "weight_var": np.maximum(w2_sum / n_tok - (w_sum / n_tok) ** 2, 0.0),
        "mass_removed": m["removed_mass"].sum(0) / m["ref"].sum(0),
        # clipped: summing per sequence then over sequences can leave -1e-16 where nothing is removed
        "drift_removed": np.maximum(1.0 - m["kept_k3"].sum(0) / k3_total, 0.0) if k3_total > 0
        else np.zeros(cols),
        "bias": bias_seq.sum(0) / n_tok,
    }
    # the bias is a token mean: per-sequence sums over per-sequence token counts; a resample that drew
    # no sequence is no evidence and is dropped (as 0 it pulled the interval to 0 with few sequences)
    low, high = bootstrap_ratio(bias_seq, st.n, bootstrap, seed, confidence, empty=None)
    figures["bias_low"], figures["bias_high"] = low, high
    drift = Drift(max_abs_log_ratio=float(np.abs(tok.log_ratio).max()),
                  ratio_var=float(st.sum_r2.sum() / n_tok - (st.sum_r.sum() / n_tok) ** 2),
                  k3_mean=k3_total / n_tok, tokens=int(n_tok), sequences=int(tok.lengths.size))
    return Evaluation(tuple(candidates), figures, drift, bootstrap)


def _keeps_sequences(st: _SeqStats, rule: RejectionRule) -> np.ndarray:
    """Sequences `[S]` a sequence-level rejection rule keeps."""
    e = rule.estimator
    value = {"sum": st.sum_k[e], "mean": st.sum_k[e] / st.n, "max": st.max_k[e]}[rule.reduce]
    return in_band(value, rule.lower, rule.upper)


def keep_mask(tok: Tokens, cand: Candidate) -> np.ndarray:
    """The tokens `[N]` (bool) a rejection candidate keeps, by the same bands `evaluate` uses."""
    rule = cand.config.rs_rules[0]
    st = _SeqStats(tok)
    if rule.reduce == "token":
        return np.asarray(in_band(st.k[rule.estimator], rule.lower, rule.upper))
    return np.repeat(_keeps_sequences(st, rule), tok.lengths)
