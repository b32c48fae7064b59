"""The corrections the advisor evaluates: every verl `rollout_is` level and `rollout_rs` criterion
at a few thresholds, IcePop bands, geometric sequence IS and seq-mask-TIS, each a validated
`CorrectionConfig` in a family evaluated in one vectorised expression.
"""

from __future__ import annotations

from dataclasses import dataclass

from parity.core.errors import ConfigError
from parity.correction.config import CorrectionConfig

#: family -> what it does; the order is the tie-break preference (verl's own options first).
FAMILIES: dict[str, str] = {
    "none": "no correction (weights 1)",
    "token_tis": "token-level truncated IS (verl rollout_is='token', numeric threshold)",
    "sequence_tis": "sequence-level truncated IS (verl rollout_is='sequence')",
    "icepop": "token-level IS, tokens outside a ratio band masked (verl 'lower_upper' threshold)",
    "token_rs": "token-level rejection sampling (verl rollout_rs='token_k*')",
    "seq_rs": "sequence-level rejection sampling (verl rollout_rs='seq_sum_*|seq_mean_*|seq_max_*')",
    "geometric_tis": "geometric-mean sequence IS, truncated (parity extra, GSPO-style)",
    "seq_mask_tis": "token IS, sequences whose geometric-mean ratio leaves a band masked (NeMo-RL)",
}
#: families that change the data kept (mask or reject tokens), rather than only reweighting them.
REMOVING = ("icepop", "seq_mask_tis", "token_rs", "seq_rs")
#: families that only reweight.
REWEIGHTING = ("token_tis", "sequence_tis", "geometric_tis")


@dataclass(frozen=True)
class Candidate:
    """One correction of the grid.

    family: a key of `FAMILIES`. config: the correction, verl's option names.
    """

    family: str
    config: CorrectionConfig

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"candidate family {self.family!r}; allowed: {list(FAMILIES)}")
        expected = _family_of(self.config)
        if expected != self.family:
            raise ConfigError(f"candidate family {self.family!r} does not match its config "
                              f"({describe(self.config)} is {expected!r})")

    @property
    def name(self) -> str:
        return describe(self.config)

    @property
    def sequence_level(self) -> bool:
        """Whole sequences are weighted or removed together."""
        return self.family in ("sequence_tis", "geometric_tis", "seq_mask_tis", "seq_rs")


def _family_of(cfg: CorrectionConfig) -> str:
    rule, rs = cfg.is_rule, cfg.rs_rules
    if len(rs) > 1 or (rs and rule is not None):
        return "combined"
    if rs:
        return "token_rs" if rs[0].reduce == "token" else "seq_rs"
    if rule is None:
        return "none"
    if rule.batch_normalize or rule.clamp_lower is not None:
        return "other"
    if rule.level == "seq_mask_tis":
        return "seq_mask_tis"
    if rule.band_lower is not None:
        return "icepop" if rule.level == "token" else "other"
    return {"token": "token_tis", "sequence": "sequence_tis", "geometric": "geometric_tis"}[rule.level]


def describe(cfg: CorrectionConfig) -> str:
    """A short stable name, e.g. "token_tis 2", "icepop 0.5_2", "seq_mean_k3 0.01",
    "seq_mean_k3 0.01 + token_tis 2" or "none"."""
    parts = []
    if cfg.rollout_rs is not None:
        parts.append(f"{cfg.rollout_rs} {_num(cfg.rollout_rs_threshold)}")
    rule = cfg.is_rule
    if rule is not None:
        kind = {"token": "icepop" if rule.band_lower is not None else "token_tis", "sequence": "sequence_tis",
                "geometric": "geometric_tis", "seq_mask_tis": "seq_mask_tis"}[rule.level]
        parts.append(f"{kind} {_num(cfg.rollout_is_threshold)}")
    return " + ".join(parts) or "none"


def _num(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def default_grid() -> tuple[Candidate, ...]:
    """The grid `parity.advise` evaluates unless given another (48 corrections)."""
    out = [Candidate("none", CorrectionConfig(rollout_is=None))]
    out += [Candidate("token_tis", CorrectionConfig(rollout_is="token", rollout_is_threshold=u))
            for u in (1.5, 2.0, 3.0, 5.0, 10.0)]
    out += [Candidate("sequence_tis", CorrectionConfig(rollout_is="sequence", rollout_is_threshold=u))
            for u in (2.0, 3.0, 5.0, 10.0)]
    out += [Candidate("icepop", CorrectionConfig(rollout_is="token", rollout_is_threshold=band))
            for band in ("0.8_1.25", "0.5_2", "0.2_5", "0.1_10")]
    token_rs = {"token_k1": (1.5, 2.0, 5.0, 10.0), "token_k2": (0.1, 0.5, 2.0), "token_k3": (0.1, 0.5, 2.0)}
    seq_rs = {"seq_sum_k1": (2.0, 10.0, 100.0), "seq_sum_k3": (1.0, 10.0), "seq_mean_k1": (1.05, 1.2, 1.5),
              "seq_mean_k2": (0.01, 0.1), "seq_mean_k3": (0.01, 0.05, 0.2), "seq_max_k2": (0.5, 2.0),
              "seq_max_k3": (0.5, 2.0, 10.0)}
    for family, table in (("token_rs", token_rs), ("seq_rs", seq_rs)):
        out += [Candidate(family, CorrectionConfig(rollout_is=None, rollout_rs=opt, rollout_rs_threshold=t))
                for opt, thresholds in table.items() for t in thresholds]
    out += [Candidate("geometric_tis", CorrectionConfig(rollout_is="geometric", rollout_is_threshold=u))
            for u in (1.1, 1.5, 2.0)]
    out += [Candidate("seq_mask_tis", CorrectionConfig(rollout_is="seq_mask_tis", rollout_is_threshold=band))
            for band in ("0.9_1.1", "0.8_1.25", "0.5_2")]
    return tuple(out)
