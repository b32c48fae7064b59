"""A step's keys and values written into the KV cache in one launch (stock: one `index_copy_` each).

A copy, so the bits are the inputs'; what it saves is a launch a layer (~4 us each at decode).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: source rows (token x KV head) per program.
ROWS = 16


@triton.jit(do_not_specialize=["N"])
def _write_kv_kernel(rows_ptr, key_ptr, value_ptr, k_ptr, v_ptr, N, key_stride, value_stride,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)[None, :]
    ok = (i < N)[:, None] & (d < D)
    dest = tl.load(rows_ptr + i, mask=i < N, other=0).to(tl.int64)[:, None] * D + d
    tl.store(k_ptr + dest, tl.load(key_ptr + i[:, None] * key_stride + d, mask=ok), mask=ok)
    tl.store(v_ptr + dest, tl.load(value_ptr + i[:, None] * value_stride + d, mask=ok), mask=ok)


def write_kv(k_rows: torch.Tensor, v_rows: torch.Tensor, rows: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor) -> None:
    """k_rows[rows] = key and v_rows[rows] = value: caches viewed as [R, D], rows [N], key/value [N, D]."""
    d = k_rows.shape[1]
    fits = (key.shape == value.shape == (rows.shape[0], d) and v_rows.shape == k_rows.shape
            and key.dtype == value.dtype == k_rows.dtype == v_rows.dtype and k_rows.is_contiguous()
            and v_rows.is_contiguous() and rows.is_contiguous() and key.stride(1) == value.stride(1) == 1)
    if not fits:  # the stock copies (and their errors)
        k_rows.index_copy_(0, rows, key)
        v_rows.index_copy_(0, rows, value)
        return
    n = rows.shape[0]
    if n:
        _write_kv_kernel[(triton.cdiv(n, ROWS),)](
            rows, key, value, k_rows, v_rows, n, key.stride(0), value.stride(0),
            D=d, BLOCK_D=triton.next_power_of_2(d), ROWS=ROWS, num_warps=4)
