"""The one matrix-multiply-accumulate every Triton kernel here uses.

fp32 operands are multiplied with `input_precision="ieee"`: a float32 matmul must never silently
run as TF32 (10-bit mantissa products), which would make "fp32" results depend on a global flag.

Under Triton's CPU interpreter (`TRITON_INTERPRET=1`, used by CI) `tl.dot` is unusable for these
tests: it hands bf16 to numpy as raw uint16 integers, and numpy's BLAS rounds a row differently
depending on its position in the tile (a false invariance failure). The interpreter therefore
forms the products in fp32 (exact for bf16 inputs) and sums them over K with `tl.sum`, whose
per-element order does not depend on the row's position.
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
