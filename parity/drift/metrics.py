"""Drift metrics on per-token logprob arrays: how far the training forward is from the rollout engine.

Inputs are `[batch, seq]` logprobs of the sampled tokens in nats (torch or NumPy) and a mask of
the tokens that count, or one checked `TokenArrays` (`parity.drift.token_arrays`). Δ = train -
rollout, r = exp(Δ). Ratios are `exp(clamp(Δ, -20, 20))`, verl's bound, so one wild token cannot
overflow a mean (`max_abs_logprob_diff` is unclamped); k3_kl too is at the clamped Δ, unlike verl's
unclamped `rollout_corr/k3_kl` (`parity.correction`), which it undercuts only where |Δ| > 20. Rows
with no valid token count nowhere in `summarize` (verl's `rollout_corr/*` in `parity.correction` count
them where verl does).
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from parity.core.errors import ConfigError, InputError
from parity.core.schema import SUMMARY_KEYS
from parity.drift.bootstrap import resample_chunks
from parity.drift.quantiles import QuantilePass
from parity.drift.ratio_rules import SAFETY_BOUND
from parity.drift.token_arrays import Block, TokenArrays, checked_inputs, row_counts
from parity.drift.token_arrays import token_arrays as token_arrays  # re-exported: callers import it here

#: Default response-position bucket edges (tokens): powers of two, so early tokens get fine buckets.
DEFAULT_POSITION_EDGES: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

#: Default rollout-probability bucket edges: mismatch concentrates on low-probability tokens.
DEFAULT_PROBABILITY_EDGES: tuple[float, ...] = (0.0, 1e-4, 1e-3, 1e-2, 0.1, 0.5, 0.9, 0.99, 1.0)


@dataclass(frozen=True)
class _SummaryRows:
    """What one pass leaves: per-row sums `[batch]` the bootstrap resamples, batch totals of the
    probability-space quantities, per-row maxima `[batch]`, and whether the probabilities are equal.
    """

    sums: dict[str, torch.Tensor]
    totals: dict[str, float]
    extremes: dict[str, torch.Tensor]
    identical: bool


class SummaryPass:
    """`summarize`'s one pass over a batch (a `BlockPass`): every per-row statistic it needs.

    With c = clamp(Δ, ±20), e = expm1(c) keeps k3 = e - c and χ² = e² + 2e exact near Δ = 0, where
    exp(Δ) - 1 would cancel to noise. exp(|c|) for NeMo-RL's mean needs no such care (a second expm1
    is scalar in torch, the slowest op). exp(logp) is 1 at padding, so |Δp| is 0 there.
    """

    def __init__(self, tok: TokenArrays) -> None:
        self.tok = tok
        self._sums: dict[str, list[torch.Tensor]] = {}
        self._totals: dict[str, float] = {}
        self._extremes: dict[str, list[torch.Tensor]] = {}
        # quantiles 0 and 1 are the min and the max: one selection gives all four
        self._quantiles = QuantilePass(tok, (0.0, 0.01, 0.99, 1.0))
        self._identical = True
        #: count, means and centred second moments of both sides' probabilities (`_add_moments`)
        self._moments: dict[str, float] = {}

    def add(self, b: Block) -> None:
        sums, extremes, totals = self._sums, self._extremes, self._totals

        def put(name: str, value: torch.Tensor) -> None:
            sums.setdefault(name, []).append(value)

        d, abs_d = b.log_ratio, b.abs_log_ratio
        work = b.buffer()  # every [rows, seq] temporary is a block buffer, reused (`Buffers`)
        put("d", b.row_log_ratio_sum)
        put("d2", torch.square(d, out=work).sum(-1))
        put("abs_d", abs_d.sum(-1))
        extremes.setdefault("abs_d_max", []).append(b.row_abs_max)
        put("gt2", row_counts(abs_d, above=math.log(2.0)))  # padding's |Δ| = 0 is never counted
        c = b.clamped
        self._quantiles.add(b)
        e = torch.expm1(c, out=b.buffer())  # 0 at padding
        put("e", e.sum(-1))
        put("e2", torch.square(e, out=work).sum(-1))
        put("k3", e.sub_(c).sum(-1))  # e is not needed after: in place
        # Σ exp(|c|) - 1 over valid tokens: padding (c = 0) adds exactly 1 a slot, so the sum over
        # the whole row minus its width
        put("mult", torch.exp(b.abs_clamped, out=work).sum(-1) - c.shape[-1])
        p_train = torch.exp(b.train, out=work)  # 1 at padding
        p_rollout = torch.exp(b.rollout, out=e)
        self._identical = self._identical and torch.equal(p_train, p_rollout)
        p_diff = torch.sub(p_train, p_rollout, out=b.buffer()).abs_()  # 0 at padding
        extremes.setdefault("p_diff_max", []).append(p_diff.amax(-1))
        totals["p_diff"] = totals.get("p_diff", 0.0) + float(p_diff.sum())
        self._add_moments(b, p_train, p_rollout)

    def _add_moments(self, b: Block, p_train: torch.Tensor, p_rollout: torch.Tensor) -> None:
        """Merge the block's centred moments of the probabilities (1 at padding; overwritten) into
        the batch's (Chan et al.): raw sums Σp², Σp·q cancel to rounding noise where the
        probabilities barely vary (confident tokens, p ≈ 1), which made the Pearson coefficient
        anything, above 1 included."""
        count = float(self.tok.lengths[b.rows].sum())
        if count == 0:
            return
        pad = b.mask.numel() - count
        flat_t, flat_r = p_train.reshape(-1), p_rollout.reshape(-1)
        means = []
        for flat in (flat_t, flat_r):
            # the padding's 1s out of the sum; the mean need not be exact: centring on a value off
            # by δ adds count·δ² to Σ(p - mean)², δ ~ eps·(pad + count) / count (p <= 1), `noise`
            mean = (float(flat.sum()) - pad) / count
            means.append(mean)
            flat.sub_(mean)
            if not b.dense:
                flat.mul_(b.maskf.reshape(-1))  # padding to 0
        (dt, dr), (mean_t, mean_r) = (flat_t, flat_r), means
        m2_t, m2_r, co = (float(torch.dot(x, y)) for x, y in ((dt, dt), (dr, dr), (dt, dr)))
        noise = count * (4.0 * _EPS64 * (pad + count) / count) ** 2
        m = self._moments
        if not m:
            m.update(n=count, mean_t=mean_t, mean_r=mean_r, m2_t=m2_t, m2_r=m2_r, co=co, noise=noise)
            return
        n = m["n"] + count
        delta_t, delta_r = mean_t - m["mean_t"], mean_r - m["mean_r"]
        weight = m["n"] * count / n
        m.update(n=n, mean_t=m["mean_t"] + delta_t * count / n, mean_r=m["mean_r"] + delta_r * count / n,
                 m2_t=m["m2_t"] + m2_t + delta_t * delta_t * weight,
                 m2_r=m["m2_r"] + m2_r + delta_r * delta_r * weight,
                 co=m["co"] + co + delta_t * delta_r * weight, noise=m["noise"] + noise)

    def rows(self) -> _SummaryRows:
        """What the pass leaves, once every block was added."""
        return _SummaryRows(
            sums={k: torch.cat(v) for k, v in self._sums.items()},
            totals=dict(self._totals),
            extremes={k: torch.cat(v) for k, v in self._extremes.items()},
            identical=self._identical,
        )

    def result(self, *, bootstrap: int = 0, seed: int = 0) -> dict[str, Any]:
        """The summary (`summarize`'s result) of the scanned batch."""
        _check_bootstrap(bootstrap)
        if bootstrap:
            _check_seed(seed)
        tok, rows = self.tok, self.rows()
        valid_rows = tok.lengths > 0
        n = tok.total
        s = {**{k: float(v.sum()) for k, v in rows.sums.items()}, **rows.totals}
        ext = rows.extremes
        ratio_var = s["e2"] / n - (s["e"] / n) ** 2  # Var(r) = Var(e), better conditioned near r = 1
        r_min, p01, p99, r_max = self._quantiles.result(math.exp)
        seq_log = rows.sums["d"][valid_rows].clamp(-SAFETY_BOUND, SAFETY_BOUND)
        summary: dict[str, Any] = {key: float(fn(s, n)) for key, fn in _TOKEN_MEANS.items()}
        summary.update(
            max_abs_logprob_diff=float(ext["abs_d_max"].max()),
            is_ratio_std=math.sqrt(max(ratio_var, 0.0)),
            is_ratio_min=r_min,
            is_ratio_max=r_max,
            is_ratio_p01=p01,
            is_ratio_p99=p99,
            seq_is_ratio_mean=float(torch.exp(seq_log).mean()),
            rollout_probs_diff_max=float(ext["p_diff_max"].max()),
            rollout_probs_diff_mean=s["p_diff"] / n,
            rollout_probs_pearson=_pearson(self._moments, rows.identical),
            num_tokens=int(n),
            num_sequences=int(valid_rows.sum()),
        )
        out = {key: summary[key] for key in SUMMARY_KEYS}
        if bootstrap:
            ci = _bootstrap(rows.sums, tok.lengths, n_resamples=bootstrap, confidence=0.95, seed=seed)
            out.update({f"{key}_ci95": list(bounds) for key, bounds in ci.items()})
        return out


def _check_bootstrap(bootstrap: Any) -> None:
    if isinstance(bootstrap, bool) or not isinstance(bootstrap, int) or bootstrap < 0:
        raise ConfigError(f"bootstrap must be an integer >= 0 (resamples; 0 = off), got {bootstrap!r}")


def _check_seed(seed: Any) -> None:
    """A bootstrap seed is an integer >= 0: NumPy's own errors for -1 or 1.5 named no option, and None
    drew a fresh interval on every call."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ConfigError(f"seed must be an integer >= 0 (the bootstrap's resampling seed), got {seed!r}")


def _summary_rows(tok: TokenArrays) -> _SummaryRows:
    """`SummaryPass` run alone over `tok`."""
    p = SummaryPass(tok)
    tok.scan(p)
    return p.rows()


# Token means from per-row sums `s` (a dict of `_summary_rows` columns, summed over the rows or
# over a bootstrap resample of them) and the token count `n`. One place for these formulas:
# `summarize` and `bootstrap_ci` both use them. Works on floats and on NumPy arrays.
_TOKEN_MEANS: dict[str, Callable[[dict[str, Any], Any], Any]] = {
    "mean_abs_logprob_diff": lambda s, n: s["abs_d"] / n,
    "is_ratio_mean": lambda s, n: 1.0 + s["e"] / n,
    "k1_kl": lambda s, n: -s["d"] / n,
    "k2_kl": lambda s, n: 0.5 * s["d2"] / n,
    "k3_kl": lambda s, n: s["k3"] / n,
    "chi2_token": lambda s, n: (s["e2"] + 2.0 * s["e"]) / n,
    "token_mult_prob_error": lambda s, n: 1.0 + s["mult"] / n,
    "frac_tokens_ratio_gt_2": lambda s, n: s["gt2"] / n,
}

#: Summary keys that are token means; `bootstrap_ci` gives confidence intervals for these.
BOOTSTRAP_KEYS: tuple[str, ...] = tuple(_TOKEN_MEANS)


def _pearson(m: dict[str, float], identical: bool) -> float:
    """Pearson correlation of the token probabilities from their centred moments `m`; 1.0 for
    identical inputs, NaN (undefined, not "uncorrelated") when a side is constant (its spread within
    the rounding of its mean, `noise` included), as for a single token.
    """
    if identical:
        return 1.0
    n = m["n"]
    resolved = [m[var] > m["noise"] + n * (8.0 * _EPS64 * abs(m[mean])) ** 2
                for var, mean in (("m2_t", "mean_t"), ("m2_r", "mean_r"))]
    if not all(resolved):
        return math.nan
    return max(-1.0, min(1.0, m["co"] / math.sqrt(m["m2_t"] * m["m2_r"])))


#: float64's machine epsilon.
_EPS64 = float(np.finfo(np.float64).eps)


def summarize(
    train_logprobs: Any, rollout_logprobs: Any = None, mask: Any = None, *, bootstrap: int = 0, seed: int = 0
) -> dict[str, Any]:
    """The parity summary of `[batch, seq]` logprobs (nats): every key of `SUMMARY_KEYS`.

    Δ = train - rollout over valid tokens, r = exp(clamp(Δ, ±20)):
        max/mean_abs_logprob_diff: |Δ| unclamped. is_ratio_*: of r (std ddof 0, linear percentiles).
        seq_is_ratio_mean: mean over sequences of exp(clamp(Σ_t Δ_t, ±20)).
        k1/k2/k3_kl: Schulman's KL(π_rollout || π_train) estimators -Δ, Δ²/2, r - 1 - log r (k3 at Δ
        clamped to ±20 like r, as verl's rejection k3 and the advisor; verl's metric
        `rollout_corr/k3_kl` is unclamped, so beyond |Δ| = 20 this one is smaller: Δ = -30 counts
        19 nats, not 29; `max_abs_logprob_diff` shows such a token).
        chi2_token: mean r² - 1. rollout_probs_*: verl's exp(train) vs exp(rollout) debug metrics
        (rollout_probs_pearson: 1.0 for identical sides, NaN where a side's probabilities are constant,
        one token included: a correlation is undefined there).
        token_mult_prob_error: NeMo-RL's mean exp(|Δ|). frac_tokens_ratio_gt_2: |Δ| > log 2.
    `bootstrap > 0` adds `<key>_ci95` = [low, high] for `BOOTSTRAP_KEYS` (95%, over sequences; NaN
    with fewer than two sequences), resampled from `seed` (an integer >= 0).
    """
    _check_bootstrap(bootstrap)
    if bootstrap:
        _check_seed(seed)
    tok = checked_inputs(train_logprobs, rollout_logprobs, mask)
    p = SummaryPass(tok)
    tok.scan(p)
    return p.result(bootstrap=bootstrap, seed=seed)


def _bootstrap(
    row_sums: dict[str, torch.Tensor], lengths: torch.Tensor, *, n_resamples: int, confidence: float,
    seed: int,
) -> dict[str, tuple[float, float]]:
    """Percentile bootstrap of the token means over whole sequences: a response's tokens share a context
    and drift together, so a token bootstrap would understate the spread. One sequence resampled is
    itself: its interval would be [x, x], a certainty one sequence cannot give, so it is (NaN, NaN).
    """
    valid = lengths > 0
    counts = lengths[valid].cpu().numpy()
    n_seq = counts.size
    if n_seq < 2:
        return {key: (math.nan, math.nan) for key in _TOKEN_MEANS}
    rng, pvals = np.random.default_rng(seed), np.full(n_seq, 1.0 / n_seq)
    values = {k: v[valid].cpu().numpy() for k, v in row_sums.items()}
    parts: dict[str, list[np.ndarray]] = {k: [] for k in values}
    n_parts = []
    for rows in resample_chunks(n_resamples, n_seq):  # memory bounded: one [rows, n_seq] at a time
        # How often each sequence is drawn in each resample: [rows, n_seq].
        draws = rng.multinomial(n_seq, pvals, size=rows).astype(np.float64)
        for k, v in values.items():
            parts[k].append(draws @ v)
        n_parts.append(draws @ counts)
    sums = {k: np.concatenate(p) for k, p in parts.items()}
    n = np.concatenate(n_parts)
    alpha = (1.0 - confidence) / 2.0
    out = {}
    for key, fn in _TOKEN_MEANS.items():
        low, high = np.quantile(fn(sums, n), [alpha, 1.0 - alpha])
        out[key] = (float(low), float(high))
    return out


def bootstrap_ci(
    train_logprobs: Any,
    rollout_logprobs: Any = None,
    mask: Any = None,
    *,
    n_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, tuple[float, float]]:
    """Bootstrap `(low, high)` at `confidence` for each key of `BOOTSTRAP_KEYS`, resampling sequences
    (NaN with fewer than two)."""
    if isinstance(n_resamples, bool) or not isinstance(n_resamples, int) or n_resamples < 1:
        raise ConfigError(f"n_resamples must be an integer >= 1, got {n_resamples!r}")
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0.0 < confidence < 1.0:
        raise ConfigError(f"confidence must be in (0, 1), e.g. 0.95, got {confidence!r}")
    _check_seed(seed)
    tok = checked_inputs(train_logprobs, rollout_logprobs, mask)
    row_sums = _summary_rows(tok).sums
    return _bootstrap(row_sums, tok.lengths, n_resamples=n_resamples, confidence=float(confidence), seed=seed)


def _check_edges(edges: Sequence[float], name: str, low: float, high: float) -> list[float]:
    values = [float(e) for e in edges]
    if len(values) < 2 or any(not b > a for a, b in itertools.pairwise(values)):
        raise ConfigError(f"{name} must be at least 2 strictly increasing bucket edges, got {list(edges)!r}")
    if values[0] < low or values[-1] > high:
        raise ConfigError(f"{name} must lie within [{low}, {high}], got {list(edges)!r}")
    return values


def _bucket_rows(
    edges: Sequence[float], count: np.ndarray, abs_sum: np.ndarray, abs_max: np.ndarray, diff_sum: np.ndarray
) -> list[dict[str, Any]]:
    """JSON-ready bucket dicts; the means and max are None for an empty bucket."""
    out = []
    for i, n in enumerate(int(x) for x in count):
        out.append({
            "lo": edges[i],
            "hi": edges[i + 1],
            "num_tokens": n,
            "mean_abs_logprob_diff": float(abs_sum[i]) / n if n else None,
            "max_abs_logprob_diff": float(abs_max[i]) if n else None,
            "mean_log_ratio": float(diff_sum[i]) / n if n else None,
        })
    return out


def drift_by_position(
    train_logprobs: Any, rollout_logprobs: Any = None, mask: Any = None, *, edges: Sequence[int] | None = None
) -> list[dict[str, Any]]:
    """Drift per response-position bucket `[lo, hi)` (column index: responses left-aligned, as verl).

    `edges` default to 0, 1, 2, 4, ... and `seq`. Each bucket: `lo`, `hi`, `num_tokens`, mean / max
    |Δ| and `mean_log_ratio` (nats; None when empty).
    """
    tok = checked_inputs(train_logprobs, rollout_logprobs, mask)
    p = PositionPass(tok, edges=edges)
    tok.scan(p)
    return p.result()


class PositionPass:
    """`drift_by_position`'s pass over a batch (a `parity.drift.token_arrays.BlockPass`): per-column
    sums and maxima, bucketed by `result`. Raises `ConfigError` for bad `edges`."""

    def __init__(self, tok: TokenArrays, *, edges: Sequence[int] | None = None) -> None:
        seq = tok.shape[1]
        if edges is None:
            self.bounds = [e for e in DEFAULT_POSITION_EDGES if e < seq] + [seq]
        else:
            if any(isinstance(e, bool) or not float(e).is_integer() for e in edges):
                raise ConfigError(f"position edges must be integers, got {list(edges)!r}")
            self.bounds = [int(e) for e in _check_edges(edges, "position edges", 0, seq)]
        zeros = torch.zeros(seq, dtype=torch.float64, device=tok.mask.device)
        self.count = torch.zeros(seq, dtype=torch.int64, device=tok.mask.device)  # exact integers
        self.abs_sum, self.abs_max, self.diff_sum = zeros.clone(), zeros.clone(), zeros.clone()

    def add(self, b: Block) -> None:
        # a block of full rows counts its rows in every column; int32 sums a bool mask ~2x faster
        self.count += b.mask.shape[0] if b.dense else b.mask.sum(0, dtype=torch.int32)
        abs_d = b.abs_log_ratio  # 0 at padding, so the column max needs no mask
        self.abs_sum += abs_d.sum(0)
        self.abs_max = torch.maximum(self.abs_max, abs_d.amax(0))
        self.diff_sum += b.log_ratio.sum(0)

    def result(self) -> list[dict[str, Any]]:
        """`drift_by_position`'s buckets of the scanned batch."""
        starts = np.asarray(self.bounds[:-1], dtype=np.int64)
        stop = self.bounds[-1]
        count, abs_sum, abs_max, diff_sum = (x.cpu().numpy()[:stop] for x in (
            self.count.to(torch.float64), self.abs_sum, self.abs_max, self.diff_sum))
        return _bucket_rows(
            self.bounds,
            np.add.reduceat(count, starts),
            np.add.reduceat(abs_sum, starts),
            np.maximum.reduceat(abs_max, starts),
            np.add.reduceat(diff_sum, starts),
        )


def drift_by_probability(
    train_logprobs: Any, rollout_logprobs: Any = None, mask: Any = None, *,
    edges: Sequence[float] | None = None
) -> list[dict[str, Any]]:
    """Drift per rollout-probability bucket `[lo, hi)` (last one closed), as `drift_by_position`'s rows.
    Mismatch concentrates on low-probability tokens, which a token average hides.
    """
    bounds = _check_edges(DEFAULT_PROBABILITY_EDGES if edges is None else edges, "probability edges", 0, 1)
    tok = checked_inputs(train_logprobs, rollout_logprobs, mask)
    device = tok.mask.device
    inner = torch.tensor(bounds[1:-1], dtype=torch.float64, device=device)
    n_buckets = len(bounds) - 1
    zeros = torch.zeros(n_buckets, dtype=torch.float64, device=device)
    count, abs_sum, abs_max, diff_sum = zeros.clone(), zeros.clone(), zeros.clone(), zeros.clone()
    for b in tok.blocks():
        # a logprob a hair above 0 (up to `parity.core.logprobs.MAX_LOGPROB`, log(1) rounded) is
        # probability 1: exp of it would leave [0, 1] and drop the token from every default bucket
        prob = torch.exp(b.rollout[b.mask].clamp(max=0.0))
        d = b.log_ratio[b.mask]
        inside = (prob >= bounds[0]) & (prob <= bounds[-1])
        prob, d = prob[inside], d[inside]
        # right=True: a token exactly at an edge falls in the bucket that starts there.
        idx = torch.bucketize(prob, inner, right=True)
        abs_d = d.abs()
        count += torch.bincount(idx, minlength=n_buckets)
        abs_sum += torch.bincount(idx, weights=abs_d, minlength=n_buckets)
        diff_sum += torch.bincount(idx, weights=d, minlength=n_buckets)
        abs_max.scatter_reduce_(0, idx, abs_d, "amax")
    return _bucket_rows(bounds, *(x.cpu().numpy() for x in (count, abs_sum, abs_max, diff_sum)))


def drift_by_turn(train_logprobs: Any, rollout_logprobs: Any = None, mask: Any = None, *,
                  turns: np.ndarray, after_injection: np.ndarray) -> dict[str, list[dict[str, Any]]]:
    """Drift of multi-turn trajectories on generated tokens: {"by_turn": a row per turn, "after_injection":
    rows "first" (first token after an injection) and "rest"}, rows as `drift_by_position`'s.

    turns: int `[batch, seq]` (`turn_index`; -1 at injected and padding); after_injection: bool
    `[batch, seq]`.
    """
    tok = checked_inputs(train_logprobs, rollout_logprobs, mask)
    turns, after_injection = np.asarray(turns), np.asarray(after_injection)
    for name, given in (("turns", turns), ("after_injection", after_injection)):
        # a [seq] row would broadcast over every sequence: each sequence's turns are its own
        if given.shape != tok.shape:
            raise InputError(f"drift_by_turn: {name} has shape {given.shape}; it must be [batch, seq] "
                             f"{tok.shape}, like the logprobs (one value per token of each sequence)")
    if turns.size and turns.dtype.kind not in "iu":
        raise InputError(f"drift_by_turn: turns must hold integer turn indices (-1 where no turn), got dtype "
                         f"{turns.dtype}")
    # astype(bool) read 0.3 or 2 as "first after an injection": only a flag is one
    if after_injection.dtype != bool and (after_injection.dtype.kind not in "iuf"
                                          or not np.isin(after_injection, (0, 1)).all()):
        raise InputError(f"drift_by_turn: after_injection must be bool or hold only 0 and 1 (1 = the first "
                         f"generated token after an injection), got dtype {after_injection.dtype} with "
                         f"other values")
    valid = tok.mask.cpu().numpy().astype(bool)
    # a counted token of turn -1 (injected) or below would be in the after_injection rows and in no
    # turn's, so the turns' tokens would not add up to them; a turn >= seq (more turns than tokens)
    # would list that many empty rows
    bad = (turns < -1) | (turns >= tok.shape[1]) | (valid & (turns < 0))
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise InputError(f"drift_by_turn: turns[{row}, {col}] is {int(turns[row, col])}; a turn index is in "
                         f"[0, seq={tok.shape[1]}), -1 marking injected and padding tokens, which the mask "
                         f"must leave out (mask[{row}, {col}] is {bool(valid[row, col])})")
    abs_d = (tok.train.double() - tok.rollout.double()).abs().cpu().numpy()
    diff = (tok.train.double() - tok.rollout.double()).cpu().numpy()
    first = after_injection.astype(bool) & valid

    def row(lo: Any, hi: Any, where: np.ndarray) -> dict[str, Any]:
        return _bucket_rows([lo, hi], np.array([where.sum()]), np.array([abs_d[where].sum()]),
                            np.array([abs_d[where].max(initial=0.0)]), np.array([diff[where].sum()]))[0]

    by_turn = [row(t, t + 1, valid & (turns == t)) for t in range(int(turns.max(initial=-1)) + 1)]
    return {"by_turn": by_turn,
            "after_injection": [row("first", "first", first), row("rest", "rest", valid & ~first)]}
