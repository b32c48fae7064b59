"""A recommended `CorrectionConfig` as the config to paste into verl, NeMo-RL and slime.

verl 0.9.x `algorithm.rollout_correction` (`rollout_is`, written as null for "no IS" since verl
defaults to "sequence"; `rollout_is_threshold`, `rollout_is_batch_normalize`, `rollout_rs`,
`rollout_rs_threshold`); NeMo-RL `loss_fn` (`use_importance_sampling_correction`,
`truncated_importance_sampling_type`, `..._ratio`, `..._ratio_min`,
`sequence_level_importance_ratios`); slime `--use-tis --tis-clip U --tis-clip-low L`. No
equivalent: None and a note, never an approximation.
"""

from __future__ import annotations

from typing import Any

from parity.correction.config import VERL_IS_LEVELS, CorrectionConfig

VERL_PREFIX = "algorithm.rollout_correction."


def verl_keys(cfg: CorrectionConfig) -> dict[str, Any] | None:
    """verl's `algorithm.rollout_correction.*` keys, or None when verl lacks the level."""
    if cfg.rollout_is is not None and cfg.rollout_is not in VERL_IS_LEVELS:
        return None
    if cfg.rollout_is_clamp_lower is not None:
        return None
    keys: dict[str, Any] = {
        "rollout_is": cfg.rollout_is,
        "rollout_is_threshold": cfg.rollout_is_threshold if cfg.rollout_is is not None else None,
        "rollout_is_batch_normalize": cfg.rollout_is_batch_normalize,
        "rollout_rs": cfg.rollout_rs,
        "rollout_rs_threshold": cfg.rollout_rs_threshold,
    }
    return {VERL_PREFIX + k: v for k, v in keys.items()}


def nemo_rl_keys(cfg: CorrectionConfig) -> dict[str, Any] | None:
    """NeMo-RL's `loss_fn.*` keys, or None: NeMo-RL has no rejection sampling and no
    product-of-ratios sequence IS."""
    rule = cfg.is_rule
    if cfg.rs_rules:
        return None
    if rule is None:
        return {"loss_fn.use_importance_sampling_correction": False}
    if rule.level == "sequence" or rule.batch_normalize:
        return None
    keys: dict[str, Any] = {"loss_fn.use_importance_sampling_correction": True,
                            "loss_fn.sequence_level_importance_ratios": rule.level == "geometric"}
    if rule.level == "seq_mask_tis":
        kind, low = "seq-mask-tis", rule.band_lower
    elif rule.band_lower is not None:
        kind, low = "icepop", rule.band_lower
    else:
        kind, low = "tis", rule.clamp_lower
    keys["loss_fn.truncated_importance_sampling_type"] = kind
    keys["loss_fn.truncated_importance_sampling_ratio"] = rule.upper
    if low is not None:
        keys["loss_fn.truncated_importance_sampling_ratio_min"] = low
    return keys


def slime_flags(cfg: CorrectionConfig) -> list[str] | None:
    """slime's flags, or None: slime's built-in correction is token-level TIS only."""
    rule = cfg.is_rule
    if cfg.rs_rules:
        return None
    if rule is None:
        return []
    if rule.level != "token" or rule.band_lower is not None or rule.batch_normalize:
        return None
    return ["--use-tis", "--tis-clip", _flag_number(rule.upper), "--tis-clip-low",
            _flag_number(rule.clamp_lower or 0.0)]


def _flag_number(value: float) -> str:
    """`value` as a flag: short ("2") where that reads back as it, else every digit (`:g` keeps six
    significant ones, so a cap of 1/0.7 was pasted as 1.42857, not the cap evaluated)."""
    short = f"{value:g}"
    return short if float(short) == value else repr(float(value))


def framework_configs(cfg: CorrectionConfig) -> dict[str, Any]:
    """{"verl": keys | None, "nemo_rl": keys | None, "slime": flags | None, "notes": [...]}."""
    out: dict[str, Any] = {"verl": verl_keys(cfg), "nemo_rl": nemo_rl_keys(cfg), "slime": slime_flags(cfg),
                           "notes": []}
    if out["verl"] is None:  # name what verl lacks: the level, else the lower clamp
        lacks = f"rollout_is={cfg.rollout_is!r}" if cfg.rollout_is not in VERL_IS_LEVELS \
            else "rollout_is_clamp_lower (a lower clamp of the IS weights)"
        out["notes"].append(f"verl has no {lacks}; parity computes it as an extra")
    if out["nemo_rl"] is None:
        lacks = "rejection sampling" if cfg.rs_rules else "batch-normalized IS weights" \
            if cfg.rollout_is_batch_normalize else "product-of-ratios sequence IS"
        out["notes"].append(f"NeMo-RL has no equivalent (no {lacks})")
    if out["slime"] is None:
        out["notes"].append("slime's built-in correction is token-level TIS only (--use-tis)")
    return out


def verl_overrides(keys: dict[str, Any]) -> str:
    """Hydra command-line overrides, e.g. `algorithm.rollout_correction.rollout_is=token ...`, to paste
    into a shell: a value Hydra must see quoted (a band such as '0.5_2', which Hydra's grammar reads
    unquoted as the float 0.52, as it does ".5_2"; a comma list, else a sweep) keeps its quotes inside
    double quotes; an option name such as seq_mean_k3 starts with a letter and needs none."""
    def override(key: str, value: Any) -> str:
        if value is None:
            return f"{key}=null"
        if isinstance(value, bool):
            return f"{key}={str(value).lower()}"
        if isinstance(value, str) and ("," in value or ("_" in value and not value[:1].isalpha())):
            return f"\"{key}='{value}'\""
        return f"{key}={value}"

    return " ".join(override(k, v) for k, v in keys.items())
