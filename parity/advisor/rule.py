"""The documented rule that turns the grid's figures into one recommendation and its reason.

Three stages (docs/ADVISOR.md states them with their defaults): noise (no correction), removal
(masking or rejection within token, sequence, ESS and weight limits; most drift removed, then
sequence level, fewest tokens, grid order), reweighting on the kept tokens (sequence level
first, tightest cap within `max_mass_removed`, else the least mass, else the largest ESS).
`gold_note` adds that a rollout-side correction cannot fix a trainer farther from the gold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from parity.advisor.evaluate import Evaluation
from parity.advisor.grid import REMOVING
from parity.core.errors import ConfigError
from parity.core.schema import GOLD_RATIO_CI_KEY, GOLD_RATIO_KEY, json_float, percent, text_apart

#: reweighting families stage 3 recommends, in its order of preference. Geometric IS is evaluated
#: and shown but not recommended: its weight is no likelihood ratio of the sampled data, so its
#: mass and bias figures (against its own untruncated weight) always look harmless.
REWEIGHT_ORDER = ("sequence_tis", "token_tis")


@dataclass(frozen=True)
class AdviceRule:
    """The bounds of the rule (shares are fractions in [0, 1]; see the module docstring)."""

    noise_ratio_var: float = 1e-4
    noise_max_log_ratio: float = 0.1
    min_drift_removed: float = 0.5
    drift_tie: float = 0.05
    max_removed_tokens: float = 0.05
    max_removed_seqs: float = 0.10
    min_ess: float = 0.5
    max_weight: float = 5.0
    max_mass_removed: float = 1e-3

    def __post_init__(self) -> None:
        for name in ("noise_ratio_var", "noise_max_log_ratio", "max_weight", "max_mass_removed"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"AdviceRule.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("min_drift_removed", "drift_tie", "max_removed_tokens", "max_removed_seqs", "min_ess"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"AdviceRule.{name} is a share: give a number in [0, 1], "
                                  f"got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Choice:
    """One stage's outcome: the chosen candidate's index in the evaluation (None: nothing
    needed) and the clause of the reason it contributes."""

    index: int | None
    clause: str


def within_noise(ev: Evaluation, rule: AdviceRule) -> bool:
    """Stage 1: the untruncated token ratios are within noise."""
    d = ev.drift
    return d.ratio_var <= rule.noise_ratio_var and d.max_abs_log_ratio <= rule.noise_max_log_ratio


def noise_clause(ev: Evaluation, rule: AdviceRule) -> str:
    d = ev.drift
    rms, bound = percent(math.sqrt(max(d.ratio_var, 0.0)), 2), percent(math.sqrt(rule.noise_ratio_var), 2)
    return (f"drift is within noise (token ratios vary by {rms} RMS, "
            f"max |Δlogp| {d.max_abs_log_ratio:.3g} nats, bounds {bound} and "
            f"{rule.noise_max_log_ratio:g})")


def choose_removal(ev: Evaluation, rule: AdviceRule) -> Choice:
    """Stage 2: the masking or rejection candidate, or None when none qualifies."""
    f = ev.figures
    qualified = [i for i, c in enumerate(ev.candidates) if c.family in REMOVING
                 and f["drift_removed"][i] >= rule.min_drift_removed
                 and f["frac_tokens_removed"][i] <= rule.max_removed_tokens
                 and (not ev.candidates[i].sequence_level
                      or f["frac_seqs_removed"][i] <= rule.max_removed_seqs)
                 and f["ess"][i] >= rule.min_ess and f["max_weight"][i] <= rule.max_weight]
    if not qualified:
        return Choice(None, "")
    best = max(f["drift_removed"][i] for i in qualified)
    pool = [i for i in qualified if f["drift_removed"][i] >= best - rule.drift_tie]
    i = min(pool, key=lambda j: (not ev.candidates[j].sequence_level, f["frac_tokens_removed"][j], j))
    cand = ev.candidates[i]
    where = "whole sequences" if cand.sequence_level else "single tokens"
    return Choice(i, f"{percent(f['drift_removed'][i], 1)} of the mismatch (k3 KL) sits in {where} that "
                     f"{cand.name} removes ({percent(f['frac_tokens_removed'][i], 2)} of tokens, "
                     f"{percent(f['frac_seqs_removed'][i], 1)} of sequences)")


def choose_reweighting(ev: Evaluation, rule: AdviceRule) -> Choice:
    """Stage 3: the reweighting candidate for `ev` (evaluated on the tokens stage 2 keeps)."""
    if within_noise(ev, rule):
        return Choice(None, noise_clause(ev, rule))
    f = ev.figures
    admissible = [i for i, c in enumerate(ev.candidates) if c.family in REWEIGHT_ORDER
                  and f["ess"][i] >= rule.min_ess and f["max_weight"][i] <= rule.max_weight]
    if not admissible:
        pool = [i for i, c in enumerate(ev.candidates) if c.family in REWEIGHT_ORDER]
        if not pool:
            raise ConfigError("advise: the grid has no sequence- or token-level truncated IS candidate to "
                              "recommend; add one")
        i = max(pool, key=lambda j: (f["ess"][j], -j))
        return Choice(i, f"no truncated IS keeps ESS >= {rule.min_ess} with max weight <= "
                         f"{rule.max_weight:g}; {ev.candidates[i].name} keeps the most "
                         f"(ESS {text_apart(float(f['ess'][i]), 3, (rule.min_ess,), 'f')}): "
                         "the drift is too large to correct by reweighting, fix the rollout engine")

    def rank(i: int) -> tuple[int, float]:
        cand = ev.candidates[i]
        return REWEIGHT_ORDER.index(cand.family), cand.config.is_rule.upper

    light = [i for i in admissible if f["mass_removed"][i] <= rule.max_mass_removed]
    if light:
        i = min(light, key=rank)
        why = (f"{ev.candidates[i].name} is the tightest cap of the most preferred level "
               f"that truncates at most {percent(rule.max_mass_removed, 1)} of the importance mass "
               f"({percent(f['mass_removed'][i], 3)}, ESS {f['ess'][i]:.3f})")
        return Choice(i, why)
    i = min(admissible, key=lambda j: (f["mass_removed"][j], rank(j)))
    return Choice(i, f"{ev.candidates[i].name} truncates the least importance mass "
                     f"({percent(f['mass_removed'][i], 2)}) of the corrections with ESS >= {rule.min_ess} "
                     f"and max weight <= {rule.max_weight:g}")


def gold_note(summary: dict) -> str | None:
    """When the trainer is farther from the gold than the rollout (ratio interval below 1), a sentence
    that a rollout-side correction pulls toward the less accurate side; None otherwise.
    """
    ratio, interval = json_float(summary.get(GOLD_RATIO_KEY)), summary.get(GOLD_RATIO_CI_KEY)
    if isinstance(interval, list) and len(interval) == 2:
        interval = [json_float(v) for v in interval]
    if not isinstance(ratio, (int, float)) or not interval or not interval[1] < 1.0:
        return None
    if ratio == 0.0:
        farther = "the rollout matches the gold exactly and the trainer does not"
    else:
        farther = (f"the trainer is {1.0 / ratio:.3g}x farther from the gold than the rollout (95% interval "
                   f"{_inverse(interval[1]):.3g}-{_inverse(interval[0]):.3g}x)")
    return (f"{farther}: a rollout-side correction weighs the update "
            "toward the trainer's logprobs, the less accurate side, and does not fix that; raise the "
            "trainer's precision instead (the LM head and log-softmax in fp32, fp16 rather than bf16 "
            "for the training forward, or an fp32 training forward)")


def _inverse(value: float) -> float:
    """1 / value, inf for 0."""
    return float("inf") if value == 0.0 else 1.0 / value
