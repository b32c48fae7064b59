"""Causes other than numerical drift, found before a correction is recommended.

No correction fixes these; each leaves a signature in Δ = rollout − trainer logprob, checked in
order: an off-by-one shift (one position over matches far better, `BETTER`); one-sided nucleus
renormalization (Δ of one sign, `ONE_SIDED`, `OTHER_SIDE`); a temperature mismatch (Δ linear in
both sides' logprobs, `TEMPERATURE_CORR`); a weight mismatch (the typical sequence's mean Δ is a
sizeable KL share, `SAMPLED_FROM`: a sync bug at declared lag 0, intended at lag > 0). Nothing is
named below `MIN_DRIFT` nats or `MIN_TOKENS` tokens; model probes come from `extras["data_bugs"]`.
"""

from __future__ import annotations

import numpy as np

from parity.advisor.evaluate import Tokens

#: an alternative alignment must leave at most this share of the aligned mean |error|.
BETTER = 0.5
#: mean |Δlogp| (nats) below which no finding is made: noise can look like anything.
MIN_DRIFT = 0.05
#: fewest tokens a finding is made on.
MIN_TOKENS = 32
#: share of tokens one side must exceed the other at for a renormalization finding.
ONE_SIDED = 0.9
#: most of the |Δ| mass the other sign may carry for a renormalization finding (noise only).
OTHER_SIDE = 0.05
#: |correlation| of Δ with the trainer's logprob from which a temperature mismatch is named.
TEMPERATURE_CORR = 0.7
#: least median sequence mean Δ / mean |Δ| (the rollout higher) for a weight-mismatch finding.
SAMPLED_FROM = 0.1
#: the opening of a weight-mismatch finding (`Advice.name` tells it from a data bug by it).
WEIGHTS = "the rollout engine's weights are not the trainer's"


def data_bugs(tok: Tokens, *, policy_lag: int | None = None) -> tuple[str, ...]:
    """What in `tok` is not numerical drift: one sentence for the first cause whose signature
    fits (module doc), or (). `policy_lag`: the declared lag of the rollout's weights behind the
    trainer's (None: not declared)."""
    ratio = tok.log_ratio
    aligned = float(np.mean(np.abs(ratio))) if ratio.size else 0.0
    if ratio.size < MIN_TOKENS or aligned < MIN_DRIFT:
        return ()
    train = tok.train
    rollout = train - ratio
    delta = -ratio.astype(np.float64)
    shifted = _shift_error(train, rollout, tok.lengths)
    if shifted is not None and shifted < BETTER * aligned:
        return (f"the rollout logprobs look shifted by one token: they match the trainer's one position over "
                f"(mean |Δlogp| {shifted:.3g} nats) far better than aligned ({aligned:.3g}); check how the "
                "logprobs were sliced against the response tokens",)
    # a tie (Δ = 0, e.g. bit-identical tokens) is higher on neither side
    higher, lower = float(np.mean(delta > 0)), float(np.mean(delta < 0))
    share = max(higher, lower)
    magnitude = np.abs(delta)
    minority = delta < 0 if higher >= lower else delta > 0
    other = float(magnitude[minority].sum() / magnitude.sum())
    if share >= ONE_SIDED and other <= OTHER_SIDE:
        side = "rollout" if higher >= lower else "trainer"
        return (f"the {side} logprob is higher at {share:.0%} of tokens by a never-negative offset (mean "
                f"{abs(float(delta.mean())):.3g} nats; the other sign carries {other:.1%} of the drift): one "
                "side looks renormalized over a top-p/top-k nucleus the other did not use; check top_p, "
                "top_k "
                "and the logprobs mode on both sides",)
    corr = _correlation(delta, train.astype(np.float64))
    corr_rollout = _correlation(delta, rollout.astype(np.float64))
    if min(abs(corr), abs(corr_rollout)) >= TEMPERATURE_CORR and corr * corr_rollout > 0:
        sharper = "rollout" if corr > 0 else "trainer"
        return (f"Δlogp follows the trainer's logprob linearly (correlation {corr:+.2f}): the {sharper} side "
                "looks sharper, as with a lower temperature; check the temperature on both sides (processed "
                "logprobs are at the sampling temperature)",)
    lengths = tok.lengths[tok.lengths > 0]
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    typical = float(np.median(np.add.reduceat(delta, starts) / lengths))
    if (policy_lag is not None and policy_lag > 0) or typical < SAMPLED_FROM * aligned:
        return ()
    why = (f"the rollout sampled from another distribution: the typical sequence's mean Δlogp is "
           f"{typical:.3g} nats (a KL estimate) against mean |Δlogp| {aligned:.3g}, drift on both sides in "
           "every sequence, not the signature of a sampling setting")
    if policy_lag == 0:
        return (f"{WEIGHTS} although both declare the same policy version: a weight-sync bug ({why}); check "
                "that the sync ran and succeeded before this rollout",)
    return (f"{WEIGHTS} (a sync bug or policy lag: {why}); check the weight sync, or declare the intended "
            "lag (policy versions) to have it corrected",)


def _correlation(a: np.ndarray, b: np.ndarray) -> float:
    sa, sb = a.std(), b.std()
    if sa == 0 or sb == 0:
        return 0.0
    return float(np.mean((a - a.mean()) * (b - b.mean())) / (sa * sb))


def _shift_error(train: np.ndarray, rollout: np.ndarray, lengths: np.ndarray) -> float | None:
    """The smaller of the mean one-position-shifted errors within sequences (None: no two-token one)."""
    ends = np.cumsum(lengths)
    inner = np.ones(train.size - 1, dtype=bool)
    inner[ends[:-1] - 1] = False  # pairs that straddle two sequences
    if not inner.any():
        return None
    late = np.abs(rollout[:-1] - train[1:])[inner]
    early = np.abs(rollout[1:] - train[:-1])[inner]
    return float(min(late.mean(), early.mean()))
