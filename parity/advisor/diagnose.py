"""Data bugs that look like drift, found before a correction is recommended.

A correction weighs tokens whose two logprobs differ because two engines computed the same
distribution differently. Classic bugs make the two logprobs differ for another reason, and no
correction fixes them. Two leave a signature in the arrays alone (NumPy, no forward):

- an off-by-one shift (rollout logprobs stored one position early or late): they match the
  trainer's one position over far better than aligned;
- a truncation mismatch (top-p or top-k, or processed vs raw logprobs, on one side only): one
  side's logprob is higher at nearly every token, by the log of the kept mass.

A temperature mismatch has no such signature; where a model is at hand the report probes it with
forwards at other settings (`parity.assess.mismatch`) and stores what it finds under
`extras["data_bugs"]`, which `advise` reads with these.

"Far better" is `BETTER`: the alternative's mean absolute error at most half the aligned one's.
Nothing is called a bug below `MIN_DRIFT` nats of mean |Δlogp| or on fewer than `MIN_TOKENS`
tokens, where bf16 noise can mimic any signature.
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
#: share of tokens one side must exceed the other at for a one-sided (truncation) finding.
ONE_SIDED = 0.9


def data_bugs(tok: Tokens) -> tuple[str, ...]:
    """What in `tok` looks like a data bug rather than drift: one sentence per finding, or ()."""
    ratio = tok.log_ratio
    aligned = float(np.mean(np.abs(ratio))) if ratio.size else 0.0
    if ratio.size < MIN_TOKENS or aligned < MIN_DRIFT:
        return ()
    train, rollout = tok.train, tok.train - ratio
    findings = []
    shifted = _shift_error(train, rollout, tok.lengths)
    if shifted is not None and shifted < BETTER * aligned:
        findings.append(f"the rollout logprobs look shifted by one token: they match the trainer's one "
                        f"position over (mean |Δlogp| {shifted:.3g} nats) far better than aligned "
                        f"({aligned:.3g}); check how the logprobs were sliced against the response tokens")
    higher = float(np.mean(rollout > train))
    if max(higher, 1.0 - higher) >= ONE_SIDED:
        side = "rollout" if higher >= ONE_SIDED else "trainer"
        share, gap = max(higher, 1.0 - higher), abs(float(np.mean(ratio)))
        findings.append(f"the {side} logprob is the higher one at {share:.0%} of tokens (mean gap "
                        f"{gap:.3g} nats): one side looks renormalized over a top-p/top-k nucleus the other "
                        "did not use; check top_p, top_k and the logprobs mode on both sides")
    return tuple(findings)


def _shift_error(train: np.ndarray, rollout: np.ndarray, lengths: np.ndarray) -> float | None:
    """The smaller mean |rollout[t] - train[t+1]| and |rollout[t+1] - train[t]| within sequences, or
    None when no sequence has two tokens."""
    ends = np.cumsum(lengths)
    inner = np.ones(train.size - 1, dtype=bool)
    inner[ends[:-1] - 1] = False  # pairs that straddle two sequences
    if not inner.any():
        return None
    late = np.abs(rollout[:-1] - train[1:])[inner]
    early = np.abs(rollout[1:] - train[:-1])[inner]
    return float(min(late.mean(), early.mean()))
