"""The words every part of parity shares, spelled once: dtypes, backend names, logprob modes,
kernel modes, router-replay modes, summary keys and sweep request ids.

The bottom of the package: standard library and the backend table only, so a case file parses
and a stored report renders without torch.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal, get_args

from parity.core.backend_table import BACKEND_TABLE

#: the package version every report and nightly run records.
VERSION = "0.1.0"

#: model dtypes parity runs, by torch's attribute name (`getattr(torch, name)`).
DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")

#: backend names in the order of `parity.core.backend_table.BACKEND_TABLE`, their one spelling.
BACKEND_NAMES: tuple[str, ...] = tuple(spec.name for spec in BACKEND_TABLE)
#: the backend whose rollout logprobs equal the training forward's bit for bit.
REFERENCE = "reference"

LogprobsMode = Literal["processed", "raw"]
#: "processed": log-probs of the distribution sampled from (after temperature, top-k, top-p);
#: "raw": log_softmax of the unmodified logits.
LOGPROBS_MODES: tuple[str, ...] = get_args(LogprobsMode)

#: the two whole-model kernel settings: every family batch-invariant, or stock torch ops.
KERNEL_MODES: tuple[str, ...] = ("invariant", "native")

ReplayMode = Literal["R2", "R3"]
#: MoE router replay in the training forward: R3 forces the rollout's experts, R2 the experts
#: of a first training forward of the same micro-batch.
REPLAY_MODES: tuple[str, ...] = get_args(ReplayMode)
#: how case files and the command line spell "no replay".
NO_REPLAY = "none"
#: every router-replay value a case file or the command line accepts.
ROUTER_REPLAY_CHOICES: tuple[str, ...] = (NO_REPLAY, *REPLAY_MODES)

#: what a case measures: "compare" (drift against the training forward), "lifecycle" (the
#: backend's sleep/wake, weight-update and cache transitions leave its numbers alone),
#: "trajectory" (drift of multi-turn rollouts), "loop" (an RL loop, `parity.loop`) or "audit" (is the
#: backend deterministic and batch-invariant: `parity.audit`; its repeat noise judges the run's other
#: rows of that backend).
CASE_KINDS: tuple[str, ...] = ("compare", "lifecycle", "trajectory", "loop", "audit")
#: the audit checks each verdict rests on (docs/DESIGN.md); prefill_decode and prefix_cache are
#: reported beside them, and the seed control on its own (`parity.audit.result`, `parity.render.audit`).
AUDIT_VERDICT_CHECKS: dict[str, tuple[str, ...]] = {"deterministic": ("repeat",),
                                                     "batch_invariant": ("batch", "order")}

#: the linear layers parity applies LoRA adapters to, by the last part of their module name: every
#: attention and MLP projection of a dense model; on a MoE model the attention projections only
#: (expert and router weights are not adapted).
LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_MOE_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

#: default K groups of the tensor-parallel row-parallel sum (`reduction_groups`): every degree up to 8
#: divides it. TP bits are equal across degrees only for the same value.
REDUCTION_GROUPS = 8

#: the keys of `parity.drift.metrics.summarize`, in order. Reports, tolerances and dashboards read these.
SUMMARY_KEYS: tuple[str, ...] = (
    "max_abs_logprob_diff",
    "mean_abs_logprob_diff",
    "is_ratio_mean",
    "is_ratio_std",
    "is_ratio_min",
    "is_ratio_max",
    "is_ratio_p01",
    "is_ratio_p99",
    "seq_is_ratio_mean",
    "k1_kl",
    "k2_kl",
    "k3_kl",
    "chi2_token",
    "rollout_probs_diff_max",
    "rollout_probs_diff_mean",
    "rollout_probs_pearson",
    "token_mult_prob_error",
    "frac_tokens_ratio_gt_2",
    "num_tokens",
    "num_sequences",
)
#: summary keys of MoE router agreement (`parity.drift.routes.router_agreement`), in order.
#: summary key of the correction advisor's recommendation (its name, e.g. "token_tis 2"), and
#: the key nightly adds with the baseline row's recommendation, so a page can flag a change.
RECOMMENDATION_KEY = "recommended_correction"
BASELINE_RECOMMENDATION_KEY = "baseline_recommended_correction"

#: summary keys of the tokens one side gives logprob -inf (outside its sampling support): counted
#: apart, and kept out of every other metric, by reports and the monitor alike.
SUPPORT_SUMMARY_KEYS: tuple[str, ...] = ("num_tokens_outside_support", "frac_tokens_outside_support")
#: summary keys of a report's rollouts that `num_sequences` (sequences with a measured token) leaves
#: out: those with no generated token (an empty response, or every token injected) and those whose
#: every generated token is outside a side's support; with `num_sequences` they add up to the rollouts.
UNMEASURED_SEQUENCE_KEYS: tuple[str, ...] = ("num_empty_sequences", "num_sequences_outside_support")
ROUTER_SUMMARY_KEYS: tuple[str, ...] = ("router_agreement", "router_token_any_diff",
                                        "router_agreement_per_layer", "num_router_positions")

#: summary keys of accuracy against the gold forward (`parity.assess.accuracy.gold_summary`), in order: each
#: side's max and mean |logp - logp_gold| (nats), mean rollout error / mean train error with its 95%
#: bootstrap interval, the one-sentence verdict, the tokens counted and those outside some side's support.
GOLD_SUMMARY_KEYS: tuple[str, ...] = (
    "gold/train_max_abs_logprob_diff",
    "gold/train_mean_abs_logprob_diff",
    "gold/rollout_max_abs_logprob_diff",
    "gold/rollout_mean_abs_logprob_diff",
    "gold/rollout_to_train_error_ratio",
    "gold/rollout_to_train_error_ratio_ci95",
    "gold/verdict",
    "gold/num_tokens",
    "gold/num_tokens_outside_support",
)
#: the prefix of the full-distribution drift keys (`parity.drift.distribution`): the engine's top-k
#: against the trainer's full row at every response position; formulas in docs/DISTRIBUTION.md.
DISTRIBUTION_PREFIX = "distribution/"
#: summary keys of `parity.drift.distribution.summarize_distribution`, in order (present only when
#: the rollouts carry top-k logprobs).
DISTRIBUTION_SUMMARY_KEYS: tuple[str, ...] = tuple(DISTRIBUTION_PREFIX + name for name in (
    "top_k", "num_positions", "num_positions_infinite_kl",
    "kl_train_engine_mean", "kl_train_engine_max", "kl_engine_train_mean", "kl_engine_train_max",
    "tv_mean", "tv_max", "top_k_overlap", "argmax_agreement", "entropy_train_mean", "entropy_diff_mean",
    "frac_positions_entropy_computable", "sampled_rank_mean", "sampled_rank_max",
    "frac_sampled_outside_train_top_k",
))

#: the gold keys pages and the advisor read by name.
GOLD_RATIO_KEY = "gold/rollout_to_train_error_ratio"
GOLD_RATIO_CI_KEY = "gold/rollout_to_train_error_ratio_ci95"
GOLD_VERDICT_KEY = "gold/verdict"

#: separates a sweep block's label from the prompt index in a request id ("t0.6/3").
SWEEP_SEPARATOR = "/"


def sweep_request_id(label: str, index: int) -> str:
    """The request id of prompt `index` in the sampling block `label` of a sweep ("t0.6", 3 -> "t0.6/3")."""
    return f"{label}{SWEEP_SEPARATOR}{index}"


def sweep_label(request_id: str) -> str | None:
    """The sampling-block label of a sweep request id ("t0.6/3" -> "t0.6"); None outside a sweep."""
    label, sep, _ = request_id.rpartition(SWEEP_SEPARATOR)
    return label if sep else None


#: how the JSON files parity writes (records, JSONL dumps, nightly results) spell the floats JSON has
#: no number for: a logprob of -inf is a finding (a token outside one side's sampling support), so it
#: is kept, as a string, rather than refused or turned into a number it is not.
NONFINITE_JSON: dict[str, float] = {"-inf": float("-inf"), "inf": float("inf"), "nan": float("nan")}


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float inside (dicts, lists, tuples) spelled as in
    `NONFINITE_JSON`, so `json.dumps(..., allow_nan=False)` writes strict JSON without losing it."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def json_float(value: Any) -> Any:
    """The inverse of `json_safe` for one value where a number is expected: "-inf", "inf" and
    "nan" become floats; anything else is returned unchanged (and checked by its reader)."""
    return NONFINITE_JSON.get(value, value) if isinstance(value, str) else value


#: the correction advisor's candidate table, for the terminal and the page alike: (short header,
#: page header, figure key, format); the "" key is the residual bias's bootstrap interval.
ADVICE_COLUMNS: tuple[tuple[str, str, str, str], ...] = (
    ("trunc tok", "truncated tokens", "frac_tokens_truncated", "{:.2%}"),
    ("trunc seq", "truncated seqs", "frac_seqs_truncated", "{:.1%}"),
    ("removed tok", "masked/rejected tokens", "frac_tokens_removed", "{:.2%}"),
    ("removed seq", "masked/rejected seqs", "frac_seqs_removed", "{:.1%}"),
    ("ESS", "ESS", "ess", "{:.3f}"),
    ("max w", "max weight", "max_weight", "{:.3g}"),
    ("var w", "weight var", "weight_var", "{:.3g}"),
    ("mass removed", "mass removed", "mass_removed", "{:.3%}"),
    ("drift removed", "drift removed", "drift_removed", "{:.1%}"),
    ("bias", "residual bias", "bias", "{:+.2e}"),
    ("bias 95% CI", "bias 95% CI", "", ""),
)


def advice_cell(row: dict[str, Any], key: str, fmt: str) -> str:
    """One candidate's figure `key` as text (`ADVICE_COLUMNS`); "" key: its bias interval, empty
    without a bootstrap (NaN bounds)."""
    if not key:
        low, high = row["bias_low"], row["bias_high"]
        return "" if low != low else f"[{low:+.2e}, {high:+.2e}]"
    share = re.fullmatch(r"\{:\.(\d+)%\}", fmt)
    if share:
        return percent(row[key], int(share[1]))
    spec = re.fullmatch(r"\{:(\+?\.)(\d+)([fg])\}", fmt)
    if spec is None:
        return fmt.format(row[key])
    # an ESS of 0.99996 must not print as 1.000, nor a max weight of 1.0000001 as 1
    return text_apart(row[key], int(spec[2]), (0.0, 1.0, -1.0), spec[1][:-1] + spec[3], most=20)


def text_apart(value: float, digits: int, landmarks: tuple[float, ...], spec: str = "g",
               most: int = 17) -> str:
    """`value` formatted `{:.{digits}{spec}}` (spec "g": significant digits, "f": places; "+f" signed),
    with more digits, up to `most`, while it would print as one of `landmarks` though it is not it: a
    figure that reads as exact (1, 0) or as its own limit must be told apart from it."""
    sign, kind = spec[:-1], spec[-1]

    def text(d: int, x: float) -> str:
        return f"{x:{sign}.{d}{kind}}"

    marks = [m for m in landmarks if m != value]
    out = text(digits, value)
    while digits < most and any(float(out) == m or out == text(digits, m) for m in marks):
        digits += 1
        out = text(digits, value)
    return out


def percent(share: float, decimals: int) -> str:
    """A share in [0, 1] as a percentage to `decimals` places; "<0.01%" / ">99.99%" where rounding
    would print a share that is neither 0 nor 1 as 0% or 100% (one differing element of millions)."""
    text = f"{100 * share:.{decimals}f}%"
    step = f"{10.0 ** -decimals:.{decimals}f}"
    if 0 < share < 1 and text == f"{0:.{decimals}f}%":
        return f"<{step}%"
    if 0 < share < 1 and text == f"{100:.{decimals}f}%":
        return f">{100 - float(step):.{decimals}f}%"
    return text
