"""Which correction fixes it: evaluate a grid of rollout corrections on measured per-token
logprobs and recommend one, with its reason and the config to paste
(`parity.advise(report).text()`, `.config`, `.to_dict()`). NumPy only: advising a stored report
never loads torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from parity.advisor.diagnose import MIN_TOKENS, WEIGHTS, data_bugs
from parity.advisor.evaluate import FIGURES, Drift, Evaluation, Tokens, evaluate, keep_mask
from parity.advisor.export import framework_configs
from parity.advisor.grid import REWEIGHTING, Candidate, default_grid, describe
from parity.advisor.rule import (
    AdviceRule,
    choose_removal,
    choose_reweighting,
    gold_note,
    noise_clause,
    within_noise,
)
from parity.advisor.text import advice_text
from parity.core.errors import InputError
from parity.core.schema import RECOMMENDATION_KEY
from parity.core.types import check_int
from parity.correction.config import CorrectionConfig
from parity.report.document import ParityReport

__all__ = ["Advice", "AdviceRule", "Candidate", "Tokens", "advise", "default_grid", "tokens_of"]

#: `ParityReport.extras` key of the advice section; the summary key of its recommendation.
SECTION = "advice"
#: `ParityReport.extras` key of data bugs found with forwards (`parity.assess.mismatch`), which advise reads.
DATA_BUGS = "data_bugs"
SUMMARY_KEY = RECOMMENDATION_KEY
#: fewest sequences a recommendation is made on without a caution in its reason (with `MIN_TOKENS`
#: tokens): below it one sequence is more than `AdviceRule.max_removed_seqs`' default 10% and the
#: bias interval's bootstrap of whole sequences has little to resample.
FEW_SEQUENCES = 10


@dataclass(frozen=True)
class Advice:
    """The recommendation and the evaluation behind it: config, a one-sentence reason, each stage's
    chosen candidate, every candidate's figures, data_bugs (with any, no correction is recommended)
    and gold (`gold_note`, or None).
    """

    config: CorrectionConfig
    reason: str
    stages: tuple[tuple[str, str | None, dict[str, float]], ...]
    evaluation: Evaluation
    rule: AdviceRule
    seed: int
    data_bugs: tuple[str, ...] = ()
    gold: str | None = None

    @property
    def name(self) -> str:
        if self.data_bugs:
            return "none (weight mismatch)" if self.data_bugs[0].startswith(WEIGHTS) else "none (data bug)"
        return describe(self.config)

    def to_dict(self) -> dict[str, Any]:
        """The JSON section stored in `ParityReport.extras["advice"]` and rendered from there."""
        ev = self.evaluation
        fields = [f.name for f in dataclasses.fields(CorrectionConfig) if f.init]
        return {
            "recommendation": {
                "name": self.name, "reason": self.reason,
                "config": {k: getattr(self.config, k) for k in fields},
                "stages": [{"stage": s, "candidate": c, "figures": f} for s, c, f in self.stages],
                "frameworks": framework_configs(self.config), "data_bugs": list(self.data_bugs),
            },
            "drift": dataclasses.asdict(ev.drift),
            "rule": dataclasses.asdict(self.rule),
            "bootstrap": ev.bootstrap, "seed": self.seed, "figures": list(FIGURES), "gold": self.gold,
            "candidates": [{"name": c.name, "family": c.family, **ev.row(i)}
                           for i, c in enumerate(ev.candidates)],
        }

    def text(self) -> str:
        """The terminal form: recommendation, reason, configs to paste, every candidate's figures."""
        return advice_text(self.to_dict())


def tokens_of(source: Any, rollout_logprobs: Any = None, mask: Any = None) -> Tokens:
    """The advisor's tokens from a `ParityReport` (tokens outside either side's support left
    out, as in its summary) or from `[batch, seq]` train / rollout logprobs and a mask."""
    if isinstance(source, ParityReport):
        if rollout_logprobs is not None or mask is not None:
            raise InputError("advise: give a ParityReport alone (its own logprobs and mask are advised), or "
                             "train_logprobs, rollout_logprobs and mask arrays, not both")
        valid = source.mask & np.isfinite(source.train_logprobs) & np.isfinite(source.rollout_logprobs)
        return Tokens.from_arrays(source.train_logprobs, source.rollout_logprobs, valid)
    if rollout_logprobs is None or mask is None:
        raise InputError("advise: give a ParityReport, or train_logprobs, rollout_logprobs and mask arrays")
    return Tokens.from_arrays(source, rollout_logprobs, mask)


def advise(report_or_arrays: Any, rollout_logprobs: Any = None, mask: Any = None, *,
           grid: Sequence[Candidate] | None = None, rule: AdviceRule | None = None,
           bootstrap: int = 200, seed: int = 0, policy_lag: int | None = None) -> Advice:
    """Evaluate `grid` (default `default_grid()`) on a report's or arrays' tokens and recommend one
    correction by `rule` (default `AdviceRule()`). bootstrap: resamples for the residual bias's 95%
    interval. policy_lag: the declared lag (> 0: stale-weight drift is intended, not named).
    """
    check_int(bootstrap, "advise: bootstrap (resamples of the bias interval; 0: none)", low=0)
    if policy_lag is not None:
        check_int(policy_lag, "advise: policy_lag (policy versions the rollout's weights trail the "
                  "trainer's; None: not declared)", low=0)
    advice = _recommend(report_or_arrays, rollout_logprobs, mask, grid=grid, rule=rule, bootstrap=bootstrap,
                        seed=seed, policy_lag=policy_lag)
    caution = _few_tokens(advice.evaluation.drift)
    if caution:
        advice = dataclasses.replace(advice, reason=f"{advice.reason[:-1]}; {caution}.")
    if isinstance(report_or_arrays, ParityReport):
        advice = dataclasses.replace(advice, gold=gold_note(report_or_arrays.summary))
    return advice


def _recommend(report_or_arrays: Any, rollout_logprobs: Any, mask: Any, *, grid: Sequence[Candidate] | None,
               rule: AdviceRule | None, bootstrap: int, seed: int, policy_lag: int | None) -> Advice:
    """The recommendation and its reason (`advise` without the gold note)."""
    tok = tokens_of(report_or_arrays, rollout_logprobs, mask)
    grid = tuple(default_grid() if grid is None else grid)
    rule = AdviceRule() if rule is None else rule
    ev = evaluate(tok, grid, bootstrap=bootstrap, seed=seed)
    none = CorrectionConfig(rollout_is=None)
    stored = report_or_arrays.extras.get(DATA_BUGS, []) if isinstance(report_or_arrays, ParityReport) else []
    # findings probed with forwards come first; with one, a stale-weights reading of the same drift is moot
    own = data_bugs(tok, policy_lag=policy_lag)
    bugs = tuple(stored) + tuple(b for b in own if not (stored and b.startswith(WEIGHTS)))
    if bugs:
        weights = bugs[0].startswith(WEIGHTS)
        reason = ("this is not numerical drift: " if weights else "this looks like a data bug, not drift: ") \
            + "; ".join(bugs) + ("; fix the weight sync first" if weights else "; fix the data first") \
            + ", no rollout correction is recommended"
        return Advice(none, _sentence([reason]), (("data_bug", None, {}),), ev, rule, seed, bugs)
    if within_noise(ev, rule):
        return Advice(none, _sentence([noise_clause(ev, rule), "no correction needed"]),
                      (("noise", None, {}),), ev, rule, seed)
    stages: list[tuple[str, str | None, dict[str, float]]] = []
    clauses: list[str] = []
    removal = choose_removal(ev, rule)
    rs: dict[str, Any] = {}
    reweight_ev = ev
    if removal.index is not None:
        cand = grid[removal.index]
        stages.append(("removal", cand.name, ev.row(removal.index)))
        clauses.append(removal.clause)
        if cand.family not in ("token_rs", "seq_rs"):  # masking corrections carry their own IS weights
            return Advice(cand.config, _sentence(clauses), tuple(stages), ev, rule, seed)
        rs = {"rollout_rs": cand.config.rollout_rs, "rollout_rs_threshold": cand.config.rollout_rs_threshold}
        reweighters = [c for c in grid if c.family in REWEIGHTING]
        reweight_ev = evaluate(tok.subset(keep_mask(tok, cand)), reweighters, bootstrap=0)
    choice = choose_reweighting(reweight_ev, rule)
    if choice.index is None:
        stages.append(("reweighting", None, {}))
        clauses.append(("on the kept tokens " if rs else "") + choice.clause + ", so no IS weights")
        config = CorrectionConfig(rollout_is=None, **rs)
        return Advice(config, _sentence(clauses), tuple(stages), ev, rule, seed)
    chosen = reweight_ev.candidates[choice.index]
    stages.append(("reweighting", chosen.name, reweight_ev.row(choice.index)))
    clauses.append(("on the kept tokens " if rs else "") + choice.clause)
    config = CorrectionConfig(rollout_is=chosen.config.rollout_is,
                              rollout_is_threshold=chosen.config.rollout_is_threshold, **rs)
    return Advice(config, _sentence(clauses), tuple(stages), ev, rule, seed)


def _few_tokens(drift: Drift) -> str:
    """A caution when the batch is too small to rely on (`MIN_TOKENS`, `FEW_SEQUENCES`), else ""."""
    if drift.tokens >= MIN_TOKENS and drift.sequences >= FEW_SEQUENCES:
        return ""
    return (f"caution: only {drift.tokens} tokens in {drift.sequences} sequences (fewer than {MIN_TOKENS} "
            f"tokens or {FEW_SEQUENCES} sequences), too few to rely on; measure a larger batch")


def _sentence(clauses: list[str]) -> str:
    return "; ".join(clauses) + "."
