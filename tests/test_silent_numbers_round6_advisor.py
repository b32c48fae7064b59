"""Round 6 of the silent-numbers review, the advisor (`parity.advisor`) and `parity.score`: each test
failed on the code before its fix."""

from __future__ import annotations

import json
import shlex

import numpy as np
import pytest

import parity
from parity.advisor import AdviceRule, Tokens, advise, default_grid
from parity.advisor.diagnose import data_bugs
from parity.advisor.evaluate import evaluate, keep_mask
from parity.advisor.export import framework_configs, verl_overrides
from parity.core.errors import ConfigError
from parity.correction.config import CorrectionConfig
from parity.rollouts.dumps import load_rollouts


def _override(cfg: CorrectionConfig, key: str) -> str:
    """What the shell hands Hydra for `key` when the printed overrides are pasted."""
    args = shlex.split(verl_overrides(framework_configs(cfg)["verl"]))
    return next(a for a in args if a.startswith(f"algorithm.rollout_correction.{key}="))


def test_a_band_threshold_keeps_its_quotes_through_the_shell():
    # unquoted, Hydra's grammar reads 0.5_2 as the float 0.52: verl would run token TIS capped at 0.52
    icepop = CorrectionConfig(rollout_is="token", rollout_is_threshold="0.5_2")
    assert _override(icepop, "rollout_is_threshold") == \
        "algorithm.rollout_correction.rollout_is_threshold='0.5_2'"
    both = CorrectionConfig(rollout_is=None, rollout_rs="seq_mean_k3,token_k1",
                            rollout_rs_threshold="0.01,0.5_2")
    assert _override(both, "rollout_rs").endswith("='seq_mean_k3,token_k1'")  # unquoted: a Hydra sweep
    assert _override(both, "rollout_rs_threshold").endswith("='0.01,0.5_2'")
    plain = CorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)
    assert _override(plain, "rollout_is_threshold").endswith("=2.0")
    assert _override(plain, "rollout_rs") == "algorithm.rollout_correction.rollout_rs=null"


def _at_most_zero(train: np.ndarray, rollout: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both sides shifted down where either is above 0 (a logprob is <= 0; Δ is kept)."""
    lift = np.maximum(np.maximum(train, rollout), 0.0)
    return train - lift, rollout - lift


def test_the_bias_interval_of_few_sequences_is_not_pulled_to_zero():
    rng = np.random.default_rng(0)
    train = -np.abs(rng.normal(2, 1, (2, 64)))
    tok = Tokens.from_arrays(*_at_most_zero(train, train + rng.normal(0.3, 0.3, (2, 64))), np.ones((2, 64)))
    f = evaluate(tok, default_grid()[:1], bootstrap=200).figures
    # a resample that drew neither sequence used to count as bias 0: interval [-0.42, 0.0]
    assert f["bias"][0] < 0 and f["bias_low"][0] <= f["bias"][0] <= f["bias_high"][0] < 0


def test_bit_identical_tokens_are_higher_on_neither_side():
    rng = np.random.default_rng(0)
    train = -np.abs(rng.normal(2, 1, (10, 40)))
    delta = np.where(rng.random((10, 40)) < 0.12, -3.0, 0.0)  # rollout lower on 12% of tokens only
    tok = Tokens.from_arrays(train, train + delta, np.ones_like(train))
    assert data_bugs(tok) == ()  # was "the trainer logprob is higher at 100% of tokens": renormalized
    assert advise(train, train + delta, np.ones_like(train)).name.startswith("token_tis")
    low = train - 0.25  # the rollout 0.2-0.25 above it stays <= 0
    offset = Tokens.from_arrays(low, low + 0.2 + 0.05 * rng.random(train.shape), np.ones_like(train))
    (finding,) = data_bugs(offset)  # an offset on every token still is one
    assert "rollout logprob is higher at 100% of tokens" in finding


def _spikes_on_short_sequences() -> tuple[np.ndarray, np.ndarray, list, AdviceRule]:
    rng = np.random.default_rng(1)
    train = -np.abs(rng.normal(2, 1, (2000, 8))) - 3.5
    delta = rng.normal(0, 0.05, train.shape)
    spikes = rng.random(train.shape) < 0.004
    delta[spikes] = rng.choice([-3.0, 3.0], spikes.sum())
    grid = [c for c in default_grid() if c.family not in ("icepop", "seq_mask_tis")]
    return train, train - delta, grid, AdviceRule(max_removed_seqs=0.01)


def test_sequence_is_after_a_token_rejection_weighs_the_whole_sequence_as_verl_does():
    train, rollout, grid, rule = _spikes_on_short_sequences()
    tok = Tokens.from_arrays(train, rollout, np.ones_like(train))
    rejection = next(c for c in grid if c.name == "token_k1 1.5")
    seq_tis = next(c for c in grid if c.name == "sequence_tis 2")
    kept = keep_mask(tok, rejection)
    f = evaluate(tok.subset(kept), [seq_tis], bootstrap=0).figures
    # verl (and parity.correction) take the sequence weight over the original mask, rejected tokens in
    d = (train - rollout).sum(1)
    raw = np.exp(np.clip(d, -20, 20))
    n_kept = kept.reshape(train.shape).sum(1)
    expected = ((raw - np.minimum(raw, 2.0)) * n_kept).sum() / (raw * n_kept).sum()
    assert expected > 0.2 and f["mass_removed"][0] == pytest.approx(expected, rel=1e-9)  # was 0.0
    advice = advise(train, rollout, np.ones_like(train), grid=grid, rule=rule)
    assert advice.name == "token_k1 1.5 + token_tis 1.5"  # was "... + sequence_tis 2" (0.000% claimed)


def test_a_recommendation_from_few_tokens_says_so():
    rng = np.random.default_rng(0)
    train = -np.abs(rng.normal(2, 1, (2, 5)))
    few = advise(*_at_most_zero(train, train + rng.normal(0, 0.3, (2, 5))), np.ones_like(train))
    assert "caution: only 10 tokens in 2 sequences" in few.reason and few.reason.endswith(".")
    assert "caution" in few.text()
    train = -np.abs(rng.normal(2, 1, (20, 16)))
    assert "caution" not in advise(*_at_most_zero(train, train + rng.normal(0, 0.3, train.shape)),
                                   np.ones_like(train)).reason


@pytest.mark.parametrize("kwargs", [{"bootstrap": -5}, {"bootstrap": 2.5}, {"policy_lag": -1},
                                    {"policy_lag": True}])
def test_nonsense_bootstrap_or_policy_lag_is_refused(kwargs):
    train = np.full((4, 8), -1.0)
    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        advise(train, train, np.ones_like(train), **kwargs)


def test_export_notes_name_what_the_framework_lacks():
    clamp = framework_configs(CorrectionConfig(rollout_is="token", rollout_is_threshold=2.0,
                                               rollout_is_clamp_lower=0.5))
    assert clamp["verl"] is None and clamp["notes"][0].startswith("verl has no rollout_is_clamp_lower")
    normalized = framework_configs(CorrectionConfig(rollout_is="token", rollout_is_threshold=2.0,
                                                    rollout_is_batch_normalize=True))
    assert normalized["notes"][0] == "NeMo-RL has no equivalent (no batch-normalized IS weights)"


def test_score_takes_trainer_logprobs_as_a_numpy_array(tmp_path):
    rows = [{"prompts": [0, 5, 6], "responses": [r, 8, 0], "attention_mask": [0, 1, 1, 1, 1, 0],
             "rollout_log_probs": [-0.5, lp, 0.0], "uid": u} for r, lp, u in ((7, -1.0, "g"), (9, -1.2, "h"))]
    (tmp_path / "v.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rollouts = load_rollouts(tmp_path / "v.jsonl", logprobs_mode="raw")
    report = parity.score(rollouts, trainer_logprobs=np.array([[-0.5, -1.5], [-0.5, -1.0]]))
    assert report.summary["max_abs_logprob_diff"] == pytest.approx(0.5)  # was a bare ValueError
