"""The correction's one pass over the batch, and its entry points."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from parity.core.errors import InputError
from parity.correction.config import CorrectionConfig
from parity.correction.rejection import RejectionRows, block_keep, rejection_metrics
from parity.correction.stats import EPS, PolicyRows, Rows, join, offpolicy_metrics
from parity.correction.weights import WeightRows, batch_norm_factor, block_weights, weight_metrics
from parity.drift.token_arrays import INPUT_NAMES, Block, TokenArrays, check_logprob_bound, token_arrays

#: half-precision logprobs get weights computed and batch-normalized in float32, cast at the end:
#: float16 holds sequence weights below ~6e-5 as subnormals (a 1e-7 weight off by 10s of %, then
#: scaled up to ~1 by the batch normalization) and none above 65504.
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class BatchRows:
    """Every per-row statistic `[batch]` the metrics need: the policies' always, the weights'
    when `rollout_is` is set, the rejection rules' when `rollout_rs` is."""

    policy: PolicyRows
    weights: WeightRows | None
    rejection: RejectionRows | None


class CorrectionPass:
    """The correction's one pass over a batch (a `parity.drift.token_arrays.BlockPass`): per-row
    statistics, and with `outputs` the weights `[batch, seq]` (the caller's dtype; None without
    `rollout_is`) and keep mask `[batch, seq]` (bool, False at padding). `tok.scan(p)` then
    `p.result()`; scanned with other passes, it shares their blocks' derived arrays."""

    def __init__(self, config: CorrectionConfig, tok: TokenArrays, *, outputs: bool = True) -> None:
        self.config, self.tok = config, tok
        device = tok.mask.device
        work = torch.float32 if tok.dtype in _HALF else tok.dtype
        self.weights = (torch.empty(tok.shape, dtype=work, device=device)
                        if config.is_rule and outputs else None)
        self.keep = torch.empty(tok.shape, dtype=torch.bool, device=device) if outputs else None
        self._parts: list[BatchRows] = []

    def add(self, b: Block) -> None:
        cfg = self.config
        lengths = self.tok.lengths[b.rows]
        row_count = torch.where(lengths > 0, lengths, EPS)
        weight_rows = rejection_rows = None
        if cfg.is_rule:
            block, weight_rows = block_weights(cfg.is_rule, b, row_count)
            if self.weights is not None:
                self.weights[b.rows] = block
        if cfg.rs_rules:
            block, rejection_rows = block_keep(cfg.rs_rules, b, row_count)
            if self.keep is not None:
                self.keep[b.rows] = block
        elif self.keep is not None:
            self.keep[b.rows] = b.mask
        self._parts.append(BatchRows(PolicyRows.of_block(b), weight_rows, rejection_rows))

    def result(self) -> tuple[Any | None, Any, dict[str, float]]:
        """`apply_correction`'s result for the scanned batch: `(weights, new_mask, metrics)`, or
        `(None, None, metrics)` without `outputs`."""
        config, tok = self.config, self.tok
        stats: BatchRows = join(self._parts)
        weights, keep = self.weights, self.keep
        rows = Rows(tok.lengths, tok.total)
        metrics: dict[str, float] = {}
        rule = config.is_rule
        if rule is not None:
            metrics.update(weight_metrics(rule, stats.weights, rows))
            if rule.batch_normalize:
                norm = batch_norm_factor(stats.weights, rows)
                if norm > EPS and weights is not None:
                    weights.div_(norm)
                metrics["rollout_is_batch_norm_factor"] = norm if norm > EPS else 1.0
        if stats.rejection is not None:
            metrics.update(rejection_metrics(config.rs_rules, stats.rejection, rows))
        metrics.update(offpolicy_metrics(stats.policy, rows))
        metrics = {f"rollout_corr/{key}": value for key, value in metrics.items()}
        if keep is None:
            return None, None, metrics
        if weights is not None and weights.dtype != tok.dtype:
            weights = _to_dtype(weights, tok.dtype)
        return None if weights is None else tok.like_train(weights), tok.like_mask(keep), metrics


def _to_dtype(weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float32 `weights` of half-precision logprobs in their dtype; InputError when one
    exceeds it (float16: 65504) rather than an inf weight."""
    top, limit = float(weights.max()), torch.finfo(dtype).max
    if top > limit:
        raise InputError(
            f"an IS weight is {top:.4g}, above the largest {dtype} ({limit:g}) the weights are returned "
            f"in (the train_logprobs' dtype): pass float32 logprobs (or, for truncated IS, a "
            f"rollout_is_threshold <= {limit:g})")
    return weights.to(dtype)


def apply_correction(config: CorrectionConfig, train_logprobs: Any, rollout_logprobs: Any = None,
                     mask: Any = None, *, metrics_only: bool = False
                     ) -> tuple[Any | None, Any, dict[str, float]]:
    """Run `config` on `[batch, seq]` inputs (or one `parity.drift.token_arrays.TokenArrays`); see
    `rollout_correction` for the result; a counted logprob above `MAX_LOGPROB` (probabilities or
    logits passed) is an InputError naming its side and [row, col]. `metrics_only`: the metrics
    alone, `(None, None, metrics)`, without writing the `[batch, seq]` weights and mask (what a
    monitor needs)."""
    tok = token_arrays(train_logprobs, rollout_logprobs, mask)
    for name, values in zip(INPUT_NAMES, (tok.train, tok.rollout)):
        check_logprob_bound(values, tok.mask, name)
    p = CorrectionPass(config, tok, outputs=not metrics_only)
    tok.scan(p)
    return p.result()


def rollout_correction(
    train_logprobs: Any,
    rollout_logprobs: Any = None,
    mask: Any = None,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: float | str | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float | str | None = None,
    rollout_is_clamp_lower: float | None = None,
) -> tuple[Any | None, Any, dict[str, float]]:
    """verl's rollout correction on `[batch, seq]` logprobs (nats) and a mask, or one `TokenArrays`;
    options are `CorrectionConfig`'s.

    Returns `(weights, new_mask, metrics)`: IS weights `[batch, seq]` in the logprobs' dtype and
    container (0 at padding and where an IcePop or seq-mask-TIS band zeroes them; a token that
    `rollout_rs` rejects keeps its weight, as in verl: use the weights with `new_mask`; None without
    `rollout_is`), the mask minus rejected tokens, and `rollout_corr/*` floats by verl's names.
    `ConfigError` / `InputError` on bad input (a counted logprob > `MAX_LOGPROB`: probabilities or
    logits passed).
    """
    config = CorrectionConfig(
        rollout_is=rollout_is,
        rollout_is_threshold=rollout_is_threshold,
        rollout_is_batch_normalize=rollout_is_batch_normalize,
        rollout_rs=rollout_rs,
        rollout_rs_threshold=rollout_rs_threshold,
        rollout_is_clamp_lower=rollout_is_clamp_lower,
    )
    return apply_correction(config, train_logprobs, rollout_logprobs, mask)
