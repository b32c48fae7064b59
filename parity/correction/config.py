"""What to compute: `CorrectionConfig` (verl's `algorithm.rollout_correction` plus extras), parsed
once into typed rules; bad options raise `ConfigError` naming the accepted forms.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from parity.core.errors import ConfigError
from parity.core.strict import from_mapping

#: `rollout_is` levels verl 0.9.x has.
VERL_IS_LEVELS: tuple[str, ...] = ("token", "sequence")
#: Every `rollout_is` level parity accepts (verl's plus parity's extras).
IS_LEVELS: tuple[str, ...] = (*VERL_IS_LEVELS, "geometric", "seq_mask_tis")
#: `rollout_rs` options, verl's names: level (`token`, `seq_sum`, `seq_mean`, `seq_max`) and estimator.
RS_OPTIONS: tuple[str, ...] = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)


@dataclass(frozen=True)
class ImportanceRule:
    """The parsed `rollout_is*` options: level, upper (> 0), band_lower (IcePop, seq-mask-TIS),
    clamp_lower, metric_lower (the low-side metrics' bound; verl's default 1/upper), batch_normalize.
    """

    level: str
    upper: float
    band_lower: float | None
    clamp_lower: float | None
    metric_lower: float
    batch_normalize: bool

    @property
    def sequence_level(self) -> bool:
        """One weight per sequence ("sequence", "geometric") rather than per token."""
        return self.level in ("sequence", "geometric")


@dataclass(frozen=True)
class RejectionRule:
    """One parsed `rollout_rs` criterion: option (e.g. "seq_mean_k3"), reduce ("token", "sum", "mean",
    "max"), estimator (k1, k2, k3 at Δ clamped ±20), lower (k1 only) and upper bounds (k1: log ratios).
    """

    option: str
    reduce: str
    estimator: str
    lower: float | None
    upper: float


def _positive(value: float) -> bool:
    return value > 0  # False for NaN too


def _is_real(value: Any) -> bool:
    """A real number, Python's or NumPy's (np.float32(2.0), np.int64(2)); never a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _plain(value: Any) -> Any:
    """A NumPy (or other) real number as the Python int or float it holds, so the option is stored,
    exported and printed as a plain number; anything else as given."""
    if _is_real(value) and type(value) not in (int, float):
        return int(value) if isinstance(value, numbers.Integral) else float(value)
    return value


def _parse_is_threshold(spec: Any) -> tuple[float, float | None]:
    """verl's `_parse_rollout_is_threshold`: a number (TIS upper bound) or "lower_upper" (IcePop)."""
    if not (_is_real(spec) or isinstance(spec, str)):
        raise ConfigError(
            f"rollout_is_threshold must be a number (TIS upper bound) or a 'lower_upper' string "
            f"(IcePop band), e.g. 2.0 or '0.5_2.0'; got {spec!r}"
        )
    lower: float | None = None
    if isinstance(spec, str):
        text = spec.strip()
        try:
            if "_" in text:
                low_text, up_text = text.split("_")  # one "_": float() reads "2_0" as 20
                lower, upper = float(low_text), float(up_text)
            else:
                upper = float(text)
        except ValueError as exc:
            raise ConfigError(
                f"rollout_is_threshold {spec!r} is not a number or a 'lower_upper' pair such as '0.5_2.0'"
            ) from exc
    else:
        upper = float(spec)
    if not _positive(upper):
        raise ConfigError(f"rollout_is_threshold upper bound must be a positive number, got {spec!r}")
    if lower is not None and not (_positive(lower) and lower <= upper):
        raise ConfigError(f"rollout_is_threshold {spec!r} needs 0 < lower <= upper")
    return upper, lower


def _parse_is(level: Any, threshold: Any, batch_normalize: Any, clamp: Any) -> ImportanceRule | None:
    """The `rollout_is*` options as one rule (None when `level` is None), checked together."""
    upper, lower = 0.0, None
    if level is not None:
        if level not in IS_LEVELS:
            raise ConfigError(f"rollout_is must be None or one of {IS_LEVELS}, got {level!r}")
        if threshold is None:
            raise ConfigError(
                f"rollout_is={level!r} needs rollout_is_threshold (e.g. 2.0); "
                f"set rollout_is=None to compute no weights"
            )
        upper, lower = _parse_is_threshold(threshold)
        if level == "seq_mask_tis" and lower is None:
            raise ConfigError(
                f"rollout_is='seq_mask_tis' needs a 'lower_upper' rollout_is_threshold such as "
                f"'0.5_2.0', got {threshold!r}"
            )
    if not isinstance(batch_normalize, bool):
        raise ConfigError(f"rollout_is_batch_normalize must be True or False, got {batch_normalize!r}")
    if batch_normalize and level is None:
        raise ConfigError("rollout_is_batch_normalize=True normalizes IS weights, but rollout_is=None "
                          "computes none; set rollout_is (e.g. 'token') or rollout_is_batch_normalize=False")
    if clamp is not None:
        if level not in ("token", "sequence", "geometric") or lower is not None:
            raise ConfigError(
                "rollout_is_clamp_lower applies to truncated IS only: rollout_is 'token', 'sequence' "
                "or 'geometric' with a numeric rollout_is_threshold"
            )
        # finite: an infinite clamp (under rollout_is_threshold='inf') made every weight inf
        if not _is_real(clamp) or not (0 < clamp <= upper) or not math.isfinite(clamp):
            raise ConfigError(
                f"rollout_is_clamp_lower must be a finite number in (0, rollout_is_threshold={upper}], "
                f"got {clamp!r}"
            )
        clamp = float(clamp)
    if level is not None and lower is None and clamp is None and upper < 1.0:
        # the low-side metrics count ratios below 1/upper > upper: every token would be both "high"
        # (above the cap) and "low", fractions that add up to more than 1
        raise ConfigError(
            f"rollout_is_threshold={threshold!r} truncates below 1: its low-side metrics "
            f"(rollout_is_*_fraction_low) would count ratios below 1/{upper:g} = {1.0 / upper:g}, above "
            f"the cap itself; give a threshold >= 1 (e.g. 2.0), or set rollout_is_clamp_lower "
            f"(<= {upper:g}) as the low bound"
        )
    if level is None:
        return None
    metric_lower = lower if lower is not None else clamp if clamp is not None else 1.0 / upper
    return ImportanceRule(level, upper, lower, clamp, metric_lower, batch_normalize)


def _parse_rs(rollout_rs: Any, threshold: Any) -> tuple[RejectionRule, ...]:
    """verl's parsing: comma lists, duplicates dropped, one shared threshold or one per option."""
    if rollout_rs is None:
        return ()
    if not isinstance(rollout_rs, str):
        raise ConfigError(f"rollout_rs must be a comma-separated string of {RS_OPTIONS}, got {rollout_rs!r}")
    options: list[str] = []
    for name in (part.strip() for part in rollout_rs.split(",")):
        if not name:
            continue
        if name not in RS_OPTIONS:
            raise ConfigError(f"rollout_rs option {name!r} is unknown; allowed: {', '.join(RS_OPTIONS)}")
        if name not in options:
            options.append(name)
    if not options:
        raise ConfigError(f"rollout_rs must name at least one of {RS_OPTIONS}, got {rollout_rs!r}")
    if threshold is None:
        raise ConfigError(
            "rollout_rs_threshold is required when rollout_rs is set, e.g. 2.0 or '0.5_2.0,0.01'"
        )
    if not (_is_real(threshold) or isinstance(threshold, str)):
        raise ConfigError(
            f"rollout_rs_threshold must be a number or a comma-separated string, got {threshold!r}"
        )
    specs = [part.strip() for part in threshold.split(",") if part.strip()] if isinstance(threshold, str) \
        else [threshold]
    if len(specs) not in (1, len(options)):
        raise ConfigError(
            f"rollout_rs_threshold {threshold!r} has {len(specs)} entries; give one shared by all options "
            f"or exactly {len(options)}, one per option of {options}"
        )
    if len(specs) == 1:
        specs = specs * len(options)
    return tuple(_parse_rule(name, spec) for name, spec in zip(options, specs))


def _parse_rule(option: str, spec: float | str) -> RejectionRule:
    estimator = option[-2:]
    reduce = "token" if option.startswith("token") else option.split("_")[1]
    band = isinstance(spec, str) and "_" in spec
    if band and estimator != "k1":
        raise ConfigError(
            f"rollout_rs_threshold for {option!r} takes a single upper bound, not a "
            f"'lower_upper' pair ({spec!r}); only k1 options take a ratio band"
        )
    try:
        if band:
            low_text, up_text = spec.split("_")
            lower, upper = float(low_text), float(up_text)
        else:
            upper = float(spec)
            lower = 1.0 / upper if estimator == "k1" and upper != 0 else None
    except ValueError as exc:
        raise ConfigError(f"rollout_rs_threshold {spec!r} for {option!r} is not a number") from exc
    if not _positive(upper) or (estimator == "k1" and not (lower is not None and _positive(lower))):
        raise ConfigError(f"rollout_rs_threshold for {option!r} must be positive, got {spec!r}")
    if estimator != "k1":
        return RejectionRule(option, reduce, estimator, None, upper)
    if lower > upper:
        raise ConfigError(f"rollout_rs_threshold for {option!r} needs lower <= upper, got {spec!r}")
    return RejectionRule(option, reduce, estimator, math.log(lower), math.log(upper))


#: the correction whose `rollout_corr/*` metrics a report or a monitored step carries unless told
#: otherwise: verl's token-level truncated IS at 2.0.
DEFAULT_OPTIONS: dict[str, Any] = {"rollout_is": "token", "rollout_is_threshold": 2.0}


@dataclass(frozen=True)
class CorrectionConfig:
    """Which correction to compute; verl's `algorithm.rollout_correction` fields plus extras.

    rollout_is: None, "token" (exp(Δ_t)), "sequence" (exp(Σ_t Δ_t)), "geometric" (exp(mean_t Δ_t),
    length-independent, extra) or "seq_mask_tis" (token weights, whole sequences zeroed when the
    geometric ratio leaves [lower, upper]; NeMo-RL). rollout_is_threshold: u truncates (TIS; u >= 1
    unless rollout_is_clamp_lower sets the low bound, which is otherwise 1/u);
    "lower_upper" zeroes outside (IcePop). rollout_is_batch_normalize: mean 1 over the batch.
    rollout_rs: criteria from `RS_OPTIONS`, all must keep; rollout_rs_threshold: shared or one per
    criterion. rollout_is_clamp_lower: lower TIS clamp (slime, OpenRLHF; extra).
    """

    rollout_is: str | None = None
    rollout_is_threshold: float | str | None = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None
    rollout_is_clamp_lower: float | None = None
    #: The parsed `rollout_is*` options; None when `rollout_is` is None.
    is_rule: ImportanceRule | None = field(init=False, repr=False)
    #: The parsed `rollout_rs` criteria, in the order given.
    rs_rules: tuple[RejectionRule, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("rollout_is_threshold", "rollout_rs_threshold", "rollout_is_clamp_lower"):
            object.__setattr__(self, name, _plain(getattr(self, name)))
        is_rule = _parse_is(self.rollout_is, self.rollout_is_threshold, self.rollout_is_batch_normalize,
                            self.rollout_is_clamp_lower)
        object.__setattr__(self, "is_rule", is_rule)
        object.__setattr__(self, "rs_rules", _parse_rs(self.rollout_rs, self.rollout_rs_threshold))

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, where: str = "correction") -> CorrectionConfig:
        """Build from a mapping (a case file's table); unknown keys raise `ConfigError`."""
        return from_mapping(cls, d, where=where, what="option")


#: `correction_from_name`'s families: name -> (rollout_is level, default threshold). Every
#: `RS_OPTIONS` name is a family too, with no default (its threshold must be given).
NAMED_IS: dict[str, tuple[str, float | str]] = {
    "token_tis": ("token", 2.0),
    "sequence_tis": ("sequence", 2.0),
    "geometric_tis": ("geometric", 2.0),
    "icepop": ("token", "0.5_2"),
    "seq_mask_tis": ("seq_mask_tis", "0.5_2"),
}


def _number_or_text(text: str) -> float | str:
    """`text` as a float, or as given (the threshold parsers name what is wrong with it)."""
    try:
        return float(text)
    except ValueError:
        return text


def correction_from_name(text: str) -> CorrectionConfig:
    """A correction as `parity loop --correction` names it: "none", a `NAMED_IS` family with optional
    ":threshold" ("token_tis:3", "icepop:0.8_1.25"), or an `RS_OPTIONS` criterion ("seq_mean_k3:0.01").
    """
    if not isinstance(text, str):
        raise ConfigError(f"a correction name must be a string, got {text!r}")
    family, _, threshold = text.strip().partition(":")
    if family == "none" and not threshold:
        return CorrectionConfig(rollout_is=None)
    value: float | str | None = None
    if threshold:
        # a band stays text: float() reads "0.5_2" as 0.52 (an underscore is a digit separator)
        value = threshold if "_" in threshold else _number_or_text(threshold)
    if family in NAMED_IS:
        level, default = NAMED_IS[family]
        if isinstance(default, str) and value is not None and not isinstance(value, str):
            raise ConfigError(f"correction {text!r}: {family} takes a band 'lower_upper', e.g. "
                              f"'{family}:{default}'")
        if not isinstance(default, str) and isinstance(value, str) and "_" in value:
            raise ConfigError(f"correction {text!r}: {family} truncates at one upper bound, e.g. "
                              f"'{family}:{default}'; a 'lower_upper' band zeroes the weights outside it "
                              f"instead (icepop:{value} for tokens, seq_mask_tis:{value} for sequences)")
        return CorrectionConfig(rollout_is=level, rollout_is_threshold=default if value is None else value)
    if family in RS_OPTIONS:
        if value is None:
            raise ConfigError(f"correction {text!r} needs a threshold, e.g. '{family}:0.01'")
        return CorrectionConfig(rollout_is=None, rollout_rs=family, rollout_rs_threshold=value)
    raise ConfigError(f"unknown correction {text!r}; use 'none', one of {sorted(NAMED_IS)} with an optional "
                      f"':threshold', or a rejection criterion with its threshold ({', '.join(RS_OPTIONS)})")
