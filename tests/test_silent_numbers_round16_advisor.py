"""Round 16, the advisor: the config it exports is the one it evaluated, its reason never rounds a
failed bound into a pass, and inputs it would misread (a non-0/1 mask, a report with arrays beside
it, hand-built Tokens with an empty sequence) are refused instead of advised on."""

from __future__ import annotations

import numpy as np
import pytest

from parity import advise
from parity.advisor import AdviceRule, Candidate, Tokens
from parity.advisor.evaluate import FIGURES, Drift, Evaluation, evaluate
from parity.advisor.export import framework_configs, verl_overrides
from parity.advisor.grid import default_grid
from parity.advisor.rule import choose_reweighting
from parity.core.errors import InputError
from parity.correction.config import CorrectionConfig
from parity.drift.tolerance import Tolerance
from parity.report.document import ParityReport


def test_slime_flags_carry_the_cap_that_was_evaluated():
    # old: f"{upper:g}" pasted a cap of 1/0.7 as --tis-clip 1.42857
    cfg = CorrectionConfig(rollout_is="token", rollout_is_threshold=1 / 0.7)
    flags = framework_configs(cfg)["slime"]
    assert float(flags[flags.index("--tis-clip") + 1]) == cfg.is_rule.upper
    low = CorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_is_clamp_lower=1 / 3)
    flags = framework_configs(low)["slime"]
    assert float(flags[flags.index("--tis-clip-low") + 1]) == low.is_rule.clamp_lower
    # short numbers stay short
    plain = framework_configs(CorrectionConfig(rollout_is="token"))["slime"]
    assert plain[2:] == ["2", "--tis-clip-low", "0"]


def test_a_band_without_a_leading_digit_is_quoted_for_hydra():
    # old: ".5_2" went unquoted, which Hydra reads as the float 0.52 (a cap below 1, not a band)
    keys = framework_configs(CorrectionConfig(rollout_is="token", rollout_is_threshold=".5_2"))["verl"]
    assert "\"algorithm.rollout_correction.rollout_is_threshold='.5_2'\"" in verl_overrides(keys)
    rs_cfg = CorrectionConfig(rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01)
    rs = framework_configs(rs_cfg)
    assert "algorithm.rollout_correction.rollout_rs=seq_mean_k3" in verl_overrides(rs["verl"])


def test_an_ess_just_below_the_bound_does_not_print_as_the_bound():
    cands = (Candidate("token_tis", CorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)),)
    figures = {k: np.zeros(1) for k in FIGURES}
    figures["ess"][:], figures["max_weight"][:] = 0.49996, 2.0
    ev = Evaluation(cands, figures, Drift(1.0, 1.0, 0.1, 1000, 100), 0)
    clause = choose_reweighting(ev, AdviceRule()).clause
    # old: "no truncated IS keeps ESS >= 0.5 ... (ESS 0.500)"
    assert "ESS 0.500)" not in clause and "ESS 0.49996" in clause


def _report() -> ParityReport:
    t = np.full((2, 3), -1.0)
    return ParityReport(t, t - 0.2, np.ones((2, 3), bool), np.zeros((2, 3)), np.zeros((2, 3)), [{}, {}],
                        {}, {}, {}, True, Tolerance(), [])


def test_a_report_with_arrays_beside_it_is_refused():
    report = _report()
    assert advise(report, bootstrap=0).evaluation.drift.tokens == 6
    other = np.full((2, 3), -3.0)
    # old: the arrays were silently ignored and the report's own tokens advised
    with pytest.raises(InputError, match="ParityReport alone"):
        advise(report, other, np.ones((2, 3), bool), bootstrap=0)


@pytest.mark.parametrize("bad", [np.nan, 2.0, -1.0, 0.5])
def test_a_mask_that_is_not_zeros_and_ones_is_refused(bad):
    train, rollout = np.full((2, 4), -1.0), np.full((2, 4), -1.2)
    mask = np.array([[1.0, 1.0, 1.0, 0.0], [1.0, bad, 0.0, 0.0]])
    # old: astype(bool) counted NaN, 2, -1 and 0.5 as valid tokens
    with pytest.raises(InputError, match="only 0 and 1"):
        advise(train, rollout, mask, bootstrap=0)
    mask[1, 1] = 1.0
    assert advise(train, rollout, mask, bootstrap=0).evaluation.drift.tokens == 5


def test_hand_built_tokens_with_an_empty_sequence_are_refused():
    # old: np.add.reduceat gave the empty first sequence the value of the next token, so the
    # figures counted a sequence that had none (frac_seqs_* over 2 sequences, one phantom)
    with pytest.raises(InputError, match="positive token counts"):
        evaluate(Tokens(np.array([1.0, 2.0, 3.0]), np.full(3, -1.0), np.array([0, 3])), default_grid()[:2])
    with pytest.raises(InputError, match="positive token counts"):
        Tokens(np.array([1.0, 2.0, 3.0]), np.full(3, -1.0), np.array([1, 1]))
    ok = Tokens(np.array([1.0, 2.0, 3.0]), np.full(3, -1.0), np.array([1, 2]))
    assert evaluate(ok, default_grid()[:2], bootstrap=0).drift.sequences == 2
