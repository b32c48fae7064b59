"""One step's drift record from the trainer's and the rollout's logprobs of the same tokens: no
forward runs, the trainer already holds both.

From one checked `TokenArrays` in one scan (`step_record`): summary (`summarize`), rollout_corr
(`apply_correction`, verl's names), by_position, worst_tokens (`WORST`, ties by row then
position), and on asked steps the advisor's recommendation. Heavy: torch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from parity.advisor import advise
from parity.correction.apply import CorrectionPass
from parity.correction.config import CorrectionConfig
from parity.drift.metrics import PositionPass, SummaryPass
from parity.drift.token_arrays import BLOCK_TOKENS, Block, TokenArrays, token_arrays
from parity.monitor.background import Background, advice_job

#: worst tokens kept per step.
WORST = 10
#: bootstrap resamples behind the recommendation's bias interval (the advisor's default).
ADVICE_BOOTSTRAP = 200
#: most tokens the background advisor reads of a step: whole rows, a seeded uniform sample of
#: them beyond this (its cost grows with the tokens, its choice settles long before a million).
ADVICE_TOKENS = 131_072

log = logging.getLogger("parity.monitor")


def check_arrays(old_log_probs: np.ndarray, rollout_log_probs: np.ndarray, response_mask: np.ndarray,
                 names: tuple[str, str, str]) -> TokenArrays:
    """The step's inputs checked once (shapes, dtypes, NaN/+inf, -inf at a valid token, a mask
    with no valid token): `InputError` naming the array in `names`' spelling."""
    return token_arrays(old_log_probs, rollout_log_probs, response_mask, names=names)


def step_record(tok: TokenArrays, *, correction: CorrectionConfig, responses: np.ndarray | None,
                advice: bool, seed: int = 0) -> dict[str, Any]:
    """The stored record of one step from `check_arrays`' `tok`, in one scan of its blocks (the same
    results as `summarize`, `apply_correction` and `drift_by_position` alone).
    """
    summary, corr = SummaryPass(tok), CorrectionPass(correction, tok, outputs=False)
    position, worst = PositionPass(tok), WorstPass(tok)
    tok.scan(summary, corr, position, worst)
    record: dict[str, Any] = {
        "shape": list(tok.shape),
        "summary": summary.result(),
        "rollout_corr": corr.result()[2],
        "by_position": position.result(),
        "worst_tokens": worst.result(responses),
    }
    if advice:
        record["recommendation"] = recommendation(tok, seed=seed)
    return record


def recommendation(tok: TokenArrays, *, policy_lag: int | None = None, seed: int = 0) -> dict[str, Any]:
    """The advisor's recommendation for one step (name, reason, config, frameworks, data_bugs);
    `policy_lag` the declared lag of the rollout's weights (None: not declared)."""
    chosen = advise(tok.train.numpy(), tok.rollout.numpy(), tok.mask.numpy(), bootstrap=ADVICE_BOOTSTRAP,
                    seed=seed, policy_lag=policy_lag)
    return chosen.to_dict()["recommendation"]


class AdviceWorker:
    """Runs the advisor off the training thread: `submit` returns at once, `drain` hands back
    `(attempt, step, recommendation)`, failures are logged and skipped, `close` waits.
    """

    def __init__(self, background: Background) -> None:
        self._background = background
        self._pending: list[tuple[int, int, Future[dict[str, Any]]]] = []

    def submit(self, attempt: int, step: int, tok: TokenArrays, policy_lag: int | None) -> None:
        # copies (the trainer may reuse its buffers before the advisor reads them) of a row sample
        rows = advice_rows(tok.shape, step)
        arrays = tuple(np.ascontiguousarray(x.numpy()[rows]) for x in (tok.train, tok.rollout, tok.mask))
        self._pending.append((attempt, step, self._background.submit(advice_job, *arrays, policy_lag,
                                                                     ADVICE_BOOTSTRAP)))

    def drain(self, wait: bool = False) -> list[tuple[int, int, dict[str, Any]]]:
        out, left = [], []
        for attempt, step, future in self._pending:
            if not (wait or future.done()):
                left.append((attempt, step, future))
                continue
            try:
                out.append((attempt, step, future.result()))
            except Exception as exc:  # advice is a view: its failure never stops training
                log.warning("parity monitor: no recommendation for step %d (%s: %s)", step,
                            type(exc).__name__, exc)
        self._pending = left
        return out


def advice_rows(shape: tuple[int, int], seed: int) -> np.ndarray:
    """The rows the background advisor reads of a `[batch, seq]` step: all, or a seeded uniform
    sample of `ADVICE_TOKENS // seq` of them, in order."""
    batch, seq = shape
    keep = max(1, ADVICE_TOKENS // max(seq, 1))
    if batch <= keep:
        return np.arange(batch)
    return np.sort(np.random.default_rng(seed).choice(batch, keep, replace=False))


@contextmanager
def bounded_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set to `threads` inside the block and restored after: parity's work
    in a training process must not take every core from the trainer's own threads."""
    before = torch.get_num_threads()
    if before != threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if before != threads:
            torch.set_num_threads(before)


def worst_tokens(tok: TokenArrays, responses: np.ndarray | None, k: int = WORST) -> list[dict[str, Any]]:
    """The `k` valid tokens of largest |Δlogp| > 0 (identical tokens are never "worst"), largest
    first, ties by row then position: `{"row", "position", "token_id" (or None), "trainer_logprob",
    "rollout_logprob", "logprob_diff"}` (nats)."""
    p = WorstPass(tok, k)
    tok.scan(p)
    return p.result(responses)


class WorstPass:
    """`worst_tokens`' pass: each row's largest |Δ| `[batch]`; `result` recomputes only the rows whose
    max is at least m, the k-th largest row max (every k-worst token, ties included, lies there).
    """

    def __init__(self, tok: TokenArrays, k: int = WORST) -> None:
        self.tok, self.k = tok, k
        self._row_max: list[torch.Tensor] = []

    def add(self, b: Block) -> None:
        self._row_max.append(b.row_abs_max)

    def result(self, responses: np.ndarray | None) -> list[dict[str, Any]]:
        """The worst tokens (`worst_tokens`' rows) of the scanned batch; `responses` `[batch, seq]`
        token ids or None."""
        tok, k = self.tok, self.k
        seq = tok.shape[1]
        row_max = torch.cat(self._row_max).cpu().numpy()
        # with fewer rows than k, every token of every row is a candidate
        cut = np.partition(row_max, row_max.size - k)[row_max.size - k] if row_max.size > k else 0.0
        candidates = np.flatnonzero((row_max >= cut) & (row_max > 0))
        per_chunk = max(1, BLOCK_TOKENS // seq)
        values, index = [np.empty(0)], [np.empty(0, np.int64)]
        for start in range(0, candidates.size, per_chunk):
            rows = candidates[start:start + per_chunk]
            picked = torch.from_numpy(rows).to(tok.mask.device)
            # |Δ| as the blocks compute it: float64 difference, 0 at padding
            drift = torch.where(tok.mask[picked], tok.train[picked].to(torch.float64)
                                - tok.rollout[picked].to(torch.float64), 0.0).abs().cpu().numpy().reshape(-1)
            where = np.flatnonzero(drift >= cut)
            value, flat = _largest(drift[where], rows[where // seq] * seq + where % seq, k)
            values.append(value)
            index.append(flat)
        value, flat = np.concatenate(values), np.concatenate(index)
        out = []
        for i in flat[np.lexsort((flat, -value))[:k]]:
            r, c = divmod(int(i), seq)
            trainer, rollout = float(tok.train[r, c]), float(tok.rollout[r, c])
            out.append({"row": r, "position": c,
                        "token_id": None if responses is None else int(responses[r, c]),
                        "trainer_logprob": trainer, "rollout_logprob": rollout,
                        "logprob_diff": trainer - rollout})
        return out


def _largest(value: np.ndarray, flat: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The `k` largest of `value` > 0 (ties by smallest `flat`), with their indices, in linear time."""
    keep = value > 0
    value, flat = value[keep], flat[keep]
    if value.size <= k:
        return value, flat
    kth = np.partition(value, value.size - k)[value.size - k]
    keep = value > kth
    keep[np.flatnonzero(value == kth)[:k - int(keep.sum())]] = True
    return value[keep], flat[keep]
