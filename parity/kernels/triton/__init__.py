"""Batch-invariant Triton kernels: parity's invariant ops for CUDA tensors, one kernel idea per
module (matmul, rmsnorm, softmax, scan, rotary, attention, cache, gated, moe, sampling);
`register()` plugs them into the switch for "cuda". CI runs them on CPU under `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from parity.kernels import cpu, switch
from parity.kernels.triton import (
    attention,
    cache,
    gated,
    matmul,
    moe,
    rmsnorm,
    rotary,
    sampling,
    scan,
    softmax,
)


def _attention_op(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    span: int,
    scaling: float,
    max_run: int | None = None,
) -> torch.Tensor:
    """The switch's attention signature; `span` is unneeded, `max_run` 1 picks the decode launch."""
    return attention.attention(query, k_cache, v_cache, slots, positions, scaling, max_run=max_run)


def _activation_op(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Stock CUDA elementwise ops are already position-independent (one scalar functor per element)."""
    return fn(x)


def register() -> None:
    """Make these kernels the batch-invariant ops of `parity.kernels` for device type "cuda"."""
    for family, op, fn in (
        ("matmul", "linear", matmul.linear),
        ("matmul", "linears", matmul.linear3),
        ("rmsnorm", "rms_norm", rmsnorm.rms_norm),
        ("rmsnorm", "add_rms_norm", rmsnorm.add_rms_norm),
        ("softmax", "softmax", softmax.softmax),
        ("softmax", "log_softmax", softmax.log_softmax),
        ("softmax", "cumsum", scan.cumsum),
        ("pointwise", "activation", _activation_op),
        ("pointwise", "gated", gated.gated),
        ("pointwise", "gumbel_argmax", sampling.gumbel_argmax),
        ("pointwise", "log_softmax_draw", sampling.log_softmax_draw),
        ("rotary", "rotary", cpu.rotary),  # a gather from one per-position table: device-agnostic
        ("rotary", "apply", rotary.apply_rotary),
        ("rotary", "norm_apply", rotary.norm_rotary),
        ("moe", "topk", moe.topk),
        ("moe", "experts", moe.experts_forward),
        ("attention", "attention", _attention_op),
        ("attention", "write_kv", cache.write_kv),
    ):
        switch.register(family, op, "cuda", fn)
