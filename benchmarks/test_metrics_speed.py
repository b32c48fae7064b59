"""Speed of the full parity summary plus verl rollout correction on 10 million tokens.

Run: .venv/bin/python -m pytest benchmarks/test_metrics_speed.py --benchmark-enable
The median goes in docs/PERF.md ("Metrics and correction"); the aim is under 2 s on 2 CPU cores.
"""

from __future__ import annotations

import pytest
import torch

from parity.correction import rollout_correction
from parity.drift.metrics import summarize

BATCH, SEQ = 10_000, 1_000


@pytest.fixture(scope="module")
def tokens() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 logprobs [10000, 1000] with ~5% bf16-like drift and right padding (~50% valid)."""
    g = torch.Generator().manual_seed(0)
    rollout = torch.log(torch.rand(BATCH, SEQ, generator=g).clamp_min(1e-12))
    train = (rollout + 0.05 * torch.randn(BATCH, SEQ, generator=g)).clamp(max=0.0)
    lengths = torch.randint(1, SEQ + 1, (BATCH,), generator=g)
    mask = torch.arange(SEQ)[None, :] < lengths[:, None]
    return train, rollout, mask


def _summary_and_correction(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> None:
    summarize(train, rollout, mask)
    rollout_correction(
        train, rollout, mask,
        rollout_is="token", rollout_is_threshold=2.0,
        rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="0.5_2.0,0.01",
    )


def test_summary_and_correction_10m_tokens(benchmark, tokens) -> None:
    benchmark.pedantic(_summary_and_correction, args=tokens, rounds=5, warmup_rounds=1, iterations=1)


def test_summary_10m_tokens(benchmark, tokens) -> None:
    benchmark.pedantic(summarize, args=tokens, rounds=5, warmup_rounds=1, iterations=1)


def test_correction_sequence_is_all_rs_10m_tokens(benchmark, tokens) -> None:
    """The heaviest verl configuration: sequence IS with batch normalization and every criterion."""
    benchmark.pedantic(
        rollout_correction, args=tokens, rounds=3, warmup_rounds=1, iterations=1,
        kwargs={
            "rollout_is": "sequence", "rollout_is_threshold": "0.5_5.0", "rollout_is_batch_normalize": True,
            "rollout_rs": ",".join(
                ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                 "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
            ),
            "rollout_rs_threshold": 2.0,
        },
    )
