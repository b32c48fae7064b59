"""The one matrix-multiply-accumulate every Triton kernel here uses: fp32 in `input_precision="ieee"`
(never TF32 behind a global flag). Under `TRITON_INTERPRET=1` `tl.dot` hands bf16 to numpy as
uint16 and rounds by row position, so products are formed in fp32 and summed with `tl.sum`.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def mma(a, b, acc):
    """acc [M, N] fp32 + a [M, K] @ b [K, N], accumulated in fp32."""
    if INTERPRETED:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    elif a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)
