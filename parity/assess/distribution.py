"""The full-distribution section of a report: the engine's top-k at every response position against
the training forward's full row, for rollouts that carry top-k. Summary keys `distribution/*` and
`extras["distribution"]`: per-position KL bounds and the worst positions' top-5 side by side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import numpy as np

from parity.core.errors import InputError
from parity.core.top_k import TopKError, check_top_k
from parity.core.types import Rollout
from parity.drift.distribution import TrainerView, concat_views, position_drift, summarize_distribution

#: worst positions the section keeps, and entries of each side's distribution shown per position.
WORST_POSITIONS = 10
SHOWN_ENTRIES = 5


def has_top_k(rollouts: Sequence[Rollout]) -> bool:
    """Whether the rollouts carry top-k logprobs: all of them (True), none (False); a mix is an InputError."""
    carrying = [r.top_k_ids is not None for r in rollouts]
    if any(carrying) and not all(carrying):
        missing = next(r for r, c in zip(rollouts, carrying) if not c)
        raise InputError(f"rollout {missing.request_id!r}/{missing.sample_index} carries no top-k logprobs "
                         "but others do; give top-k for every rollout or for none")
    return bool(carrying) and all(carrying)


def check_rollout_top_k(rollouts: Sequence[Rollout], vocab_size: int | None) -> int:
    """The rollouts' k (one for all), every id checked against the vocabulary; `TopKError` else."""
    widths = {r.top_k_ids.shape[1] for r in rollouts if r.top_k_ids is not None and r.top_k_ids.size}
    if len(widths) > 1:
        raise TopKError(f"rollouts carry top-k of different k {sorted(widths)}; sample every rollout with "
                        "one top_k_logprobs")
    for r in rollouts:
        check_top_k(r.top_k_ids, r.top_k_logprobs, f"rollout {r.request_id!r}/{r.sample_index}",
                    vocab_size=vocab_size)
    return widths.pop() if widths else 0


def _asked_k(rollouts: Sequence[Rollout]) -> int:
    """The one k of the rollouts' empty top-k arrays or, failing that, of their sampling; 0 if none."""
    widths = {r.top_k_ids.shape[1] for r in rollouts if r.top_k_ids is not None and r.top_k_ids.shape[1]}
    if not widths:
        widths = {r.sampling.top_k_logprobs for r in rollouts if r.sampling is not None}
    return widths.pop() if len(widths) == 1 else 0


def distribution_section(rollouts: Sequence[Rollout], views: Sequence[TrainerView]
                         ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(summary, section) of rollouts with top-k and the trainer's views of them (one per rollout,
    `train_forward(distribution=True)`); generated tokens only."""
    # no generated position shows k: the k the rollouts were sampled with (0 if unknown: NaN in the summary)
    k = check_rollout_top_k(rollouts, None) or _asked_k(rollouts)
    pairs = list(zip(rollouts, views))
    # a rollout with no generated position adds nothing, and its [0, 0] top-k (an empty response
    # read back from JSON) would not concatenate with the others' [n, k]
    pairs = [(r, v) for r, v in pairs if any(r.mask)] or pairs[:1]
    rollouts, views = [r for r, _ in pairs], [v for _, v in pairs]
    keep = [np.asarray(r.mask, dtype=bool) for r in rollouts]
    view = concat_views([TrainerView(*(getattr(v, f.name)[m] for f in fields(TrainerView)))
                         for v, m in zip(views, keep)])
    engine_ids = np.concatenate([r.top_k_ids[m] for r, m in zip(rollouts, keep)])
    engine_lp = np.concatenate([r.top_k_logprobs[m] for r, m in zip(rollouts, keep)])
    drift = position_drift(engine_lp, view)
    where = [(i, int(t)) for i, m in enumerate(keep) for t in np.flatnonzero(m)]
    worst = np.argsort(-drift.kl_train_engine, kind="stable")[:WORST_POSITIONS]
    shown = min(SHOWN_ENTRIES, k)

    def entry(j: int) -> dict[str, Any]:
        ro, position = rollouts[where[j][0]], where[j][1]
        return {"request_id": ro.request_id, "sample_index": ro.sample_index, "position": position,
                "token_id": int(ro.token_ids[position]), "kl_train_engine": float(drift.kl_train_engine[j]),
                "kl_engine_train": float(drift.kl_engine_train[j]), "tv": float(drift.tv[j]),
                "sampled_rank": int(drift.sampled_rank[j]),
                "engine": {"ids": engine_ids[j, :shown].tolist(), "logprobs": engine_lp[j, :shown].tolist()},
                "train": {"ids": view.top_ids[j, :shown].tolist(),
                          "logprobs": view.top_logprobs[j, :shown].tolist()}}

    section = {"top_k": k, "kl_train_engine": drift.kl_train_engine.tolist(),
               "kl_engine_train": drift.kl_engine_train.tolist(), "worst": [entry(j) for j in worst.tolist()]}
    return summarize_distribution(drift, k), section


def shown_ids(section: dict[str, Any]) -> list[int]:
    """Every token id the section shows (to decode for the page)."""
    return sorted({t for w in section["worst"] for side in ("engine", "train") for t in w[side]["ids"]})
