"""The correction advisor: its figures equal the verl-matching correction's, its rule picks the
expected family on synthetic drift with a known answer (each scenario with a negative control
whose answer differs), its exports name the frameworks' real keys, and it reaches the report
page, `parity advise` and the nightly page."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_report import make_report

from parity import advise
from parity.advisor import AdviceRule, Tokens, default_grid
from parity.advisor.evaluate import evaluate
from parity.advisor.export import framework_configs, verl_overrides
from parity.cli import main
from parity.core.errors import ConfigError, InputError
from parity.core.schema import BASELINE_RECOMMENDATION_KEY, RECOMMENDATION_KEY
from parity.correction import CorrectionConfig, apply_correction
from parity.nightly.rows import RowKey, RowResult, correction_change
from parity.render import report_html
from parity.report.document import ParityReport

SEQS, LEN = 500, 256


def batch(drift: np.ndarray, seed: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """train = rollout + drift, rollout logprobs of peaked-ish sampled tokens, every slot valid; both
    sides shifted down where the drift lifts train above 0 (a logprob is <= 0; the drift is kept)."""
    rollout = np.log(np.random.default_rng(seed).uniform(0.05, 1.0, drift.shape))
    lift = np.maximum(rollout + drift, 0.0)
    return rollout + drift - lift, rollout - lift, np.ones(drift.shape, bool)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def noise(sigma: float, shape: tuple[int, int] = (SEQS, LEN), seed: int = 0) -> np.ndarray:
    return rng(seed).normal(0.0, sigma, shape)


def broken_requests(drift: np.ndarray, count: int = 10, seed: int = 2) -> np.ndarray:
    """`count` whole sequences with large drift (a broken request), the rest as given."""
    d = drift.copy()
    d[:count] = rng(seed).normal(-0.5, 0.5, (count, d.shape[1]))
    return d


def spikes(rate: float, base: float = 0.02, seed: int = 3) -> np.ndarray:
    """Rare single-token spikes of ±3 nats (an MoE expert flip) over small noise."""
    g = rng(seed)
    d = g.normal(0.0, base, (SEQS, LEN))
    hit = g.random((SEQS, LEN)) < rate
    d[hit] = g.choice([-3.0, 3.0], int(hit.sum()))
    return d


def family(advice) -> tuple[str, ...]:
    """The families of the recommendation's stages, e.g. ("seq_rs", "token_tis")."""
    names = {c.name: c.family for c in default_grid()}
    return tuple(names[c] for _, c, _ in advice.stages if c is not None) or ("none",)


# -- scenarios with a known answer, each with its negative control ------------------------------


def test_no_drift_needs_no_correction_and_small_noise_does():
    advice = advise(*batch(np.zeros((SEQS, LEN))))
    assert advice.name == "none" and family(advice) == ("none",)
    assert advice.config.rollout_is is None and advice.config.rollout_rs is None
    assert "within noise" in advice.reason
    control = advise(*batch(noise(0.1)))
    assert control.name != "none"


def test_small_symmetric_token_noise_on_long_sequences_gets_token_level_is():
    advice = advise(*batch(noise(0.1)))
    assert family(advice) == ("token_tis",) and advice.config.rollout_is == "token"
    # negative control: the same per-token noise on 4-token sequences keeps the (unbiased)
    # sequence ratio's ESS high, so the rule prefers sequence-level IS
    control = advise(*batch(noise(0.1, (8000, 4))))
    assert family(control) == ("sequence_tis",) and control.config.rollout_is == "sequence"


def test_a_few_broken_requests_are_rejected_whole():
    advice = advise(*batch(broken_requests(noise(0.05))))
    assert family(advice)[0] == "seq_rs" and advice.config.rollout_rs.startswith("seq_")
    removal = advice.stages[0][2]
    assert removal["frac_seqs_removed"] == pytest.approx(10 / SEQS) and removal["drift_removed"] > 0.7
    # negative control: the same drift values scattered over random tokens of every sequence
    d = broken_requests(noise(0.05)).ravel()
    scattered = d[rng(4).permutation(d.size)].reshape(SEQS, LEN)
    control = advise(*batch(scattered))
    assert family(control)[0] not in ("seq_rs", "seq_mask_tis")


def test_rare_single_token_spikes_are_masked_token_by_token():
    advice = advise(*batch(spikes(0.002)))
    assert family(advice)[0] in ("icepop", "token_rs")
    assert advice.stages[0][2]["frac_tokens_removed"] < 0.005
    # negative control: spikes on 12% of tokens are too many to drop; the rule truncates instead
    control = advise(*batch(spikes(0.12)))
    assert family(control) == ("token_tis",)


def test_tighter_bounds_change_the_choice():
    """The rule's bounds decide: forbid dropping more than 0.1% of tokens and the spikes
    (0.2%) can no longer be masked."""
    strict = advise(*batch(spikes(0.002)), rule=AdviceRule(max_removed_tokens=0.001))
    assert family(strict)[0] not in ("icepop", "token_rs")


# -- the figures are the verl-matching correction's ---------------------------------------------


def _torch_figures(cfg: CorrectionConfig, train, rollout, mask) -> dict[str, float]:
    weights, keep, _ = apply_correction(cfg, train, rollout, mask)
    w = (np.ones(train.shape) if weights is None else weights.astype(np.float64)) * keep
    valid = mask.astype(bool)
    n = valid.sum()
    s1, s2 = w[valid].sum(), (w[valid] ** 2).sum()
    return {"ess": s1 * s1 / (n * s2) if s2 > 0 else 0.0, "weight_var": s2 / n - (s1 / n) ** 2,
            "frac_tokens_removed": float((valid & (w == 0)).sum() / n), "max_weight": float(w[valid].max())}


def test_every_candidate_matches_parity_correction():
    """ESS, weight variance, removed share and max weight of all 48 candidates equal those of the
    effective weights (IS weight x keep mask) `parity.correction` computes for the same config
    (to 1e-6: the correction hands its weights back in the inputs' float32)."""
    g = rng(5)
    rows, width = 64, 40
    drift = g.normal(0, 0.2, (rows, width))
    drift[g.random((rows, width)) < 0.02] = 2.5
    drift[:3] -= 1.0
    train, rollout, mask = batch(drift)
    lengths = g.integers(1, width + 1, rows)
    mask = np.arange(width)[None, :] < lengths[:, None]
    train, rollout = train.astype(np.float32), rollout.astype(np.float32)
    grid = default_grid()
    ev = evaluate(Tokens.from_arrays(train, rollout, mask), grid, bootstrap=0)
    for i, cand in enumerate(grid):
        expected = _torch_figures(cand.config, train, rollout, mask)
        for key, value in expected.items():
            assert ev.figures[key][i] == pytest.approx(value, rel=1e-6, abs=1e-9), (cand.name, key)
    assert len(grid) == 48 and len({c.name for c in grid}) == 48


def test_residual_bias_interval_brackets_the_estimate_and_follows_the_seed():
    train, rollout, mask = batch(noise(0.3, (200, 64)))
    a = advise(train, rollout, mask, seed=0).to_dict()["candidates"]
    b = advise(train, rollout, mask, seed=0).to_dict()["candidates"]
    c = advise(train, rollout, mask, seed=1).to_dict()["candidates"]
    assert a == b and a != c
    none = next(row for row in a if row["name"] == "none")
    assert none["bias_low"] < none["bias"] < none["bias_high"]
    assert none["bias_high"] < 0 or none["bias_low"] > 0  # ignoring σ=0.3 drift is a significant bias


def test_bad_input_is_an_input_error():
    with pytest.raises(InputError, match="finite"):
        advise(np.array([[np.nan]]), np.zeros((1, 1)), np.ones((1, 1), bool))
    with pytest.raises(InputError, match="one shape"):
        advise(np.zeros((2, 3)), np.zeros((2, 2)), np.ones((2, 3), bool))
    with pytest.raises(InputError, match="empty"):
        advise(np.zeros((2, 3)), np.zeros((2, 3)), np.zeros((2, 3), bool))
    with pytest.raises(ConfigError, match="share"):
        AdviceRule(min_ess=2.0)


# -- config to paste ------------------------------------------------------------------------------


def test_exported_keys_name_each_framework_option():
    tis = framework_configs(CorrectionConfig(rollout_is="token", rollout_is_threshold=2.0))
    assert tis["verl"] == {
        "algorithm.rollout_correction.rollout_is": "token",
        "algorithm.rollout_correction.rollout_is_threshold": 2.0,
        "algorithm.rollout_correction.rollout_is_batch_normalize": False,
        "algorithm.rollout_correction.rollout_rs": None,
        "algorithm.rollout_correction.rollout_rs_threshold": None,
    }
    assert tis["nemo_rl"] == {"loss_fn.use_importance_sampling_correction": True,
                              "loss_fn.sequence_level_importance_ratios": False,
                              "loss_fn.truncated_importance_sampling_type": "tis",
                              "loss_fn.truncated_importance_sampling_ratio": 2.0}
    assert tis["slime"] == ["--use-tis", "--tis-clip", "2", "--tis-clip-low", "0"]
    icepop = framework_configs(CorrectionConfig(rollout_is="token", rollout_is_threshold="0.5_2"))
    assert icepop["verl"]["algorithm.rollout_correction.rollout_is_threshold"] == "0.5_2"
    assert icepop["nemo_rl"]["loss_fn.truncated_importance_sampling_type"] == "icepop"
    assert icepop["nemo_rl"]["loss_fn.truncated_importance_sampling_ratio_min"] == 0.5
    assert icepop["slime"] is None
    mask_tis = framework_configs(CorrectionConfig(rollout_is="seq_mask_tis", rollout_is_threshold="0.8_1.25"))
    assert mask_tis["verl"] is None and mask_tis["nemo_rl"]["loss_fn.truncated_importance_sampling_type"] \
        == "seq-mask-tis"
    rs = framework_configs(CorrectionConfig(rollout_is="token", rollout_is_threshold=1.5,
                                            rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01))
    assert rs["verl"]["algorithm.rollout_correction.rollout_rs"] == "seq_mean_k3"
    assert rs["verl"]["algorithm.rollout_correction.rollout_rs_threshold"] == 0.01
    assert rs["nemo_rl"] is None and rs["slime"] is None and len(rs["notes"]) == 2
    none = framework_configs(CorrectionConfig(rollout_is=None))
    # verl's own default is rollout_is="sequence": "no IS" must be written out
    assert none["verl"]["algorithm.rollout_correction.rollout_is"] is None
    assert "algorithm.rollout_correction.rollout_is=null" in verl_overrides(none["verl"])
    assert "rollout_is_threshold='0.5_2'" in verl_overrides(icepop["verl"])


def _pasted_blocks(section_html: str) -> dict[str, str]:
    """The text of each framework's <pre> block of an advice section, by its heading."""
    import html as html_lib
    import re

    return {html_lib.unescape(h): html_lib.unescape(t)
            for h, t in re.findall(r"<h3>(.*?)</h3><pre>(.*?)</pre>", section_html, flags=re.S)}


@pytest.mark.parametrize("config", [
    {"rollout_is": "token", "rollout_is_threshold": 2.0},
    {"rollout_is": "token", "rollout_is_threshold": "0.5_2"},
    {"rollout_is": "sequence", "rollout_is_threshold": 5.0, "rollout_is_batch_normalize": True},
    {"rollout_is": "token", "rollout_is_threshold": 1.5, "rollout_rs": "seq_mean_k3",
     "rollout_rs_threshold": 0.01},
    {"rollout_is": None},
])
def test_the_pages_config_is_yaml_a_verl_config_file_reads(config):
    """The config block of the page is YAML whose nesting is verl's (`algorithm:` ->
    `rollout_correction:` -> keys) with the exported values, types included ("0.5_2" a string,
    null, booleans); NeMo-RL's block nests under `loss_fn:` the same way."""
    yaml = pytest.importorskip("yaml")
    from parity.render.advice import advice_html

    cfg = CorrectionConfig(**config)
    frameworks = framework_configs(cfg)
    section = {"recommendation": {"name": "x", "reason": "y.", "stages": [], "frameworks": frameworks},
               "candidates": [], "bootstrap": 0}
    blocks = _pasted_blocks(advice_html(section))
    verl = yaml.safe_load(blocks["verl (YAML for your trainer config)"])
    assert list(verl) == ["algorithm"] and list(verl["algorithm"]) == ["rollout_correction"]
    nested = verl["algorithm"]["rollout_correction"]
    assert {f"algorithm.rollout_correction.{k}": v for k, v in nested.items()} == frameworks["verl"]
    if frameworks["nemo_rl"] is not None:
        nemo = yaml.safe_load(blocks["NeMo-RL (YAML for your config)"])
        assert {f"loss_fn.{k}": v for k, v in nemo["loss_fn"].items()} == frameworks["nemo_rl"]
    # negative control: the flat "dotted.key: value" lines the page used to show are YAML too, but
    # not a verl config: verl would find no `algorithm` section in them
    flat = yaml.safe_load("\n".join(f"{k}: {json.dumps(v)}" for k, v in frameworks["verl"].items()))
    assert "algorithm" not in flat


def test_recommended_config_round_trips_through_the_correction():
    """The emitted config is a valid `CorrectionConfig` the correction runs as is."""
    advice = advise(*batch(broken_requests(noise(0.05))))
    cfg = CorrectionConfig(**advice.to_dict()["recommendation"]["config"])
    assert cfg == advice.config
    train, rollout, mask = batch(broken_requests(noise(0.05)))
    _, _, metrics = apply_correction(cfg, train, rollout, mask)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(10 / SEQS)


# -- report, command line, nightly ------------------------------------------------------------


@pytest.mark.slow
def test_reports_carry_the_advice_section_and_render_it():
    report = make_report(scale=0.3, rows=6, width=20)
    section = report.extras["advice"]
    assert report.summary[RECOMMENDATION_KEY] == section["recommendation"]["name"]
    again = ParityReport.from_json(report.to_json())
    assert again.extras["advice"] == json.loads(json.dumps(section))
    page = report_html(again)
    assert "Which correction fixes it" in page and section["recommendation"]["name"] in page
    assert "rollout_correction:" in page and 'class="chosen"' in page
    exact = make_report(scale=0.0)
    assert exact.summary[RECOMMENDATION_KEY] == "none"


@pytest.mark.slow
def test_parity_advise_command(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(make_report(scale=0.3, rows=6, width=20).to_json())
    out_json, out_html = tmp_path / "advice.json", tmp_path / "r.html"
    argv = ["advise", str(path), "--json", str(out_json), "--html", str(out_html), "--bootstrap", "50"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert text.startswith("recommended correction: ") and "reason: " in text and "candidates (48;" in text
    assert json.loads(out_json.read_text())["bootstrap"] == 50
    assert "Which correction fixes it" in out_html.read_text()
    assert main(["advise", str(tmp_path / "missing.json")]) == 2
    assert "cannot read REPORT" in capsys.readouterr().err


def test_nightly_flags_a_changed_recommendation():
    key = RowKey("moe", "vllm", "bfloat16")
    same = RowResult("n2", key, "pass", summary={RECOMMENDATION_KEY: "token_tis 2",
                                                 BASELINE_RECOMMENDATION_KEY: "token_tis 2"})
    changed = RowResult("n2", key, "pass", summary={RECOMMENDATION_KEY: "icepop 0.5_2",
                                                    BASELINE_RECOMMENDATION_KEY: "token_tis 2"})
    first = RowResult("n1", key, "pass", summary={RECOMMENDATION_KEY: "token_tis 2"})
    assert correction_change(same) is None and correction_change(first) is None
    assert correction_change(changed) == ("token_tis 2", "icepop 0.5_2")
    from parity.nightly.history import RunInfo
    from parity.nightly.html_report import _changes, _rows_table
    from parity.nightly.markdown_report import render_summary

    assert "changed" not in _rows_table([same]) and "changed" in _rows_table([changed])
    assert "token_tis 2 → icepop 0.5_2" in _changes([changed])
    run = RunInfo("n2", 2, "t0", "t1", {}, {})
    assert r"recommended correction changed: token\_tis 2 → icepop 0.5\_2" in render_summary(run, [changed])
