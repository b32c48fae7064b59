"""Hypothesis strategies shared by the metrics and correction property tests."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st


@st.composite
def batches(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random [batch, seq] logprobs and a mask with at least one valid token (empty rows allowed)."""
    batch, seq = draw(st.integers(1, 6)), draw(st.integers(1, 12))
    scale = draw(st.sampled_from([0.0, 1e-4, 0.05, 1.0, 30.0]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rollout = -rng.exponential(2.0, size=(batch, seq))
    train = rollout + rng.normal(0.0, scale, size=(batch, seq))
    # a logprob is <= 0: where the drift lifts train above 0, shift both sides down by as much
    # (Δ = train - rollout unchanged, so large drifts stay large; rollout stays <= 0)
    lift = np.maximum(train, 0.0)
    train, rollout = train - lift, rollout - lift
    mask = rng.random((batch, seq)) < draw(st.sampled_from([0.3, 0.8, 1.0]))
    mask[rng.integers(batch), rng.integers(seq)] = True
    return train, rollout, mask
