"""Triton kernels: correctness against torch, and bitwise batch invariance with negative controls.

With a GPU the tests run on CUDA, plus the `gpu`-marked ones. Without one they run on CPU tensors
under Triton's interpreter (tiny shapes, so a broken index or mask is caught in CI). The
interpreter must be chosen before `triton` is first imported, so a process that did not start
with `TRITON_INTERPRET=1` runs this file again in a child process that does (tests/interpreter.py).

Invariance is proven by bits (`torch.equal`); negative controls show that a plan which follows
the batch (split-K below 64 rows, other KV tile boundaries, another softmax or scan chunking) does change
bits, so the equalities are not vacuous.
"""

from __future__ import annotations

import functools
import importlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from interpreter import run_interpreted
from transformers.activations import ACT2FN

pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ROOT = Path(__file__).resolve().parent.parent
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (CUDA not available)")
#: tests of this file that run under the interpreter: all but the CUDA-only ones and the child runner.
MIN_INTERPRETED = 75


@pytest.mark.slow
@pytest.mark.skipif(CUDA or INTERPRETED, reason="the kernel tests run in this process")
def test_kernels_under_the_triton_interpreter_in_a_child_process() -> None:
    run_interpreted(__file__, min_passed=MIN_INTERPRETED, timeout=900)


@pytest.fixture(scope="module")
def tk() -> ModuleType:
    """`parity.kernels.triton` (on CPU tensors only inside a process started under the interpreter)."""
    if not (CUDA or INTERPRETED):
        pytest.skip("no GPU: run by test_kernels_under_the_triton_interpreter_in_a_child_process")
    return importlib.import_module("parity.kernels.triton")


def _randn(
    *shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


POOL = 160  # rows in the shared pool that batch compositions are drawn from
compositions = st.lists(st.integers(0, POOL - 1), min_size=1, max_size=POOL)
ROWS = 24  # rows for the one-program-per-row kernels (the interpreter pays per program)
row_compositions = st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=ROWS)
#: property tests of the slower kernels draw fewer compositions (the interpreter is slow).
few = settings(max_examples=10)
DTYPES = [torch.float32, torch.bfloat16]


# ---------------------------------------------------------------------------------------- matmul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_float64(tk: ModuleType, dtype: torch.dtype, with_bias: bool) -> None:
    x, w = _randn(POOL, 96, dtype=dtype, seed=1), _randn(192, 96, dtype=dtype, seed=2, scale=0.1)
    bias = _randn(192, dtype=dtype, seed=3) if with_bias else None
    ref = x.double() @ w.double().T + (bias.double() if with_bias else 0)
    # fp32 stays far below TF32's ~3e-4; bf16 is one output rounding (2^-9).
    assert _rel_err(tk.matmul.linear(x, w, bias), ref) < (1e-6 if dtype == torch.float32 else 5e-3)


@functools.cache
def _linear_full(tk: ModuleType, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The pool's inputs and its whole-batch output, computed once per dtype (the interpreter is slow)."""
    x, w = _randn(POOL, 96, dtype=dtype, seed=1), _randn(192, 96, dtype=dtype, seed=2, scale=0.1)
    bias = _randn(192, dtype=dtype, seed=3)
    return x, w, bias, tk.matmul.linear(x, w, bias)


@pytest.mark.parametrize("dtype", DTYPES)
@given(rows=compositions)
def test_linear_rows_are_batch_invariant(tk: ModuleType, dtype: torch.dtype, rows: list[int]) -> None:
    x, w, bias, full = _linear_full(tk, dtype)
    assert torch.equal(tk.matmul.linear(x[rows], w, bias), full[rows])


def _split_k_when_few_rows(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`fn` with a plan that follows the batch, as split-K heuristics do: below 64 rows the K axis
    is cut in two and the partial products are added (the kind of plan the kernels never use)."""

    def split(x: torch.Tensor, w: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= 64:
            return fn(x, w, *args)
        h = x.shape[-1] // 2
        low = fn(x[:, :h].contiguous(), w[..., :h].contiguous(), *args)
        return low + fn(x[:, h:].contiguous(), w[..., h:].contiguous(), *args)

    return split


def test_linear_negative_control_split_k_plan_breaks_invariance(tk: ModuleType) -> None:
    x, w = _randn(POOL, 256, seed=1), _randn(192, 256, seed=2)
    linear = _split_k_when_few_rows(tk.matmul.linear)
    rows = list(range(10))
    assert torch.equal(tk.matmul.linear(x[rows], w), tk.matmul.linear(x, w)[rows])
    assert not torch.equal(linear(x[rows], w), linear(x, w)[rows])


def test_linear_plan_ignores_m_unless_proven(tk: ModuleType) -> None:
    """The long plan is a function of the weight alone; M picks the decode plan only for a shape
    proven to give the same bits (none is proven without `prepare`)."""
    import inspect

    matmul = importlib.import_module("parity.kernels.triton.matmul")
    assert list(inspect.signature(matmul.tile_config).parameters) == ["dtype", "n", "k"]
    plan = matmul.plan_for(torch.bfloat16, 999_999, 64, 1, DEVICE)
    assert plan == matmul.tile_config(torch.bfloat16, 999_999, 64)


@gpu
@needs_cuda
def test_decode_plan_runs_where_proven_with_the_long_plans_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """`prepare` proves the decode plan on a shape; short products then take it and keep the long
    plan's bits. Negative control: a short-row product with another summation order (float32 matmul,
    one rounding) fails the proof and leaves the shape on the long plan."""
    matmul = importlib.import_module("parity.kernels.triton.matmul")
    monkeypatch.setattr(matmul, "_plans_agree", {})
    shape = (torch.bfloat16, 1024, 2048)
    matmul.prove_plans([shape], torch.device("cuda"))
    assert matmul._plans_agree[(matmul.device_key("cuda"), *shape)]
    assert matmul.plan_for(*shape, 256, "cuda") == matmul.decode_config(*shape) != matmul.tile_config(*shape)
    assert matmul.plan_for(*shape, 4096, "cuda") == matmul.tile_config(*shape)
    x, w = _randn(256, 2048, dtype=torch.bfloat16, seed=3), _randn(1024, 2048, dtype=torch.bfloat16, seed=4)
    assert torch.equal(matmul.linear(x, w), matmul.launch(x, w, None, matmul.tile_config(*shape)))

    def other_order(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > matmul.DECODE_ROWS:
            return matmul.launch(x, weight, None, matmul.tile_config(x.dtype, *weight.shape))
        return (x.float() @ weight.float().T).to(x.dtype)

    monkeypatch.setattr(matmul, "_by_rows", other_order)
    monkeypatch.setattr(matmul, "_plans_agree", {})
    matmul.prove_plans([shape], torch.device("cuda"))
    assert not matmul._plans_agree[(matmul.device_key("cuda"), *shape)]
    assert matmul.plan_for(*shape, 256, "cuda") == matmul.tile_config(*shape)


def test_launch3_gives_each_weight_the_bits_of_its_own_launch(tk: ModuleType) -> None:
    """One launch of three weights of one input (q/k/v): each output equals that weight's own launch
    of the same plan, for row counts around the tile edges and widths that end mid-tile."""
    matmul = tk.matmul
    ws = [_randn(n, 256, dtype=torch.bfloat16, seed=10 + n) for n in (192, 64, 136)]
    for m in (1, 63, 65, 130):
        x = _randn(m, 256, dtype=torch.bfloat16, seed=m)
        for got, w in zip(matmul.launch3(x, tuple(ws), matmul.GROUP_PLAN), ws, strict=True):
            assert torch.equal(got, matmul.launch(x, w, None, matmul.GROUP_PLAN))


@gpu
@needs_cuda
def test_grouped_qkv_runs_where_proven_with_each_weights_linear_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """`prove_groups` proves q/k/v of Qwen3-1.7B's shape; short products of the three then take one
    launch (`linear3`) and give each weight its `linear` bits; long ones take `linear` per weight.
    Negative control: a grouped product with another summation order (float32 matmul, one rounding)
    fails the proof and `linear3` declines."""
    matmul = importlib.import_module("parity.kernels.triton.matmul")
    monkeypatch.setattr(matmul, "_groups_agree", {})
    group = (torch.bfloat16, 2048, (2048, 1024, 1024))
    matmul.prove_groups([group], torch.device("cuda"))
    assert matmul._groups_agree[(matmul.device_key("cuda"), *group)]
    ws = tuple(_randn(n, 2048, dtype=torch.bfloat16, seed=n, scale=2048**-0.5) for n in group[2])
    for m in (1, 7, 64, 256, 512):
        x = _randn(m, 2048, dtype=torch.bfloat16, seed=m)
        outs = matmul.linear3(x, ws)
        assert outs is not None
        assert all(torch.equal(o, matmul.linear(x, w)) for o, w in zip(outs, ws, strict=True))
    assert matmul.linear3(_randn(513, 2048, dtype=torch.bfloat16), ws) is None

    def other_order(ns: tuple[int, ...], x: torch.Tensor, stacked: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > matmul.DECODE_ROWS:
            return torch.cat([matmul.linear(x, w) for w in stacked.split(ns)], dim=1)
        return (x.float() @ stacked.float().T).to(x.dtype)

    monkeypatch.setattr(matmul, "_by_group", other_order)
    monkeypatch.setattr(matmul, "_groups_agree", {})
    matmul.prove_groups([group], torch.device("cuda"))
    assert not matmul._groups_agree[(matmul.device_key("cuda"), *group)] and matmul.linear3(x, ws) is None


# ------------------------------------------------------------------------------- rmsnorm, softmax


def _hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_hf_formula(tk: ModuleType, dtype: torch.dtype) -> None:
    x, w = _randn(3, 7, 96, dtype=dtype, seed=4), _randn(96, dtype=dtype, seed=5)
    out = tk.rmsnorm.rms_norm(x, w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    assert _rel_err(out, _hf_rms_norm(x, w, 1e-6)) < (1e-6 if dtype == torch.float32 else 8e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@few
@given(rows=row_compositions)
def test_rms_norm_rows_are_batch_invariant(tk: ModuleType, dtype: torch.dtype, rows: list[int]) -> None:
    x, w = _randn(ROWS, 96, dtype=dtype, seed=4), _randn(96, dtype=dtype, seed=5)
    assert torch.equal(tk.rmsnorm.rms_norm(x[rows], w, 1e-6), tk.rmsnorm.rms_norm(x, w, 1e-6)[rows])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_gives_the_add_then_the_norm(tk: ModuleType, dtype: torch.dtype) -> None:
    """The residual add and RMSNorm in one pass give the two ops' bits (the sum as torch rounds it on
    the GPU; under the interpreter, whose bf16 casts are not round-to-nearest-even, its own sum),
    per row in any batch, reading a strided delta as its copy. Control: normalizing the sum before
    its rounding to bf16 gives other bits, so the comparison sees where the kernel rounds."""
    residual = _randn(ROWS, 96, dtype=dtype, seed=7, scale=8.0)
    delta = _randn(ROWS, 2 * 96, dtype=dtype, seed=8)[:, ::2]
    w = _randn(96, dtype=dtype, seed=5)
    out, total = tk.rmsnorm.add_rms_norm(residual, delta, w, 1e-6)
    if CUDA or dtype == torch.float32:
        assert torch.equal(total, residual + delta)
    assert torch.equal(out, tk.rmsnorm.rms_norm(total, w, 1e-6))
    copied = tk.rmsnorm.add_rms_norm(residual, delta.contiguous(), w, 1e-6)
    assert torch.equal(copied[0], out) and torch.equal(copied[1], total)
    rows = [5, 1, 5, 20]
    part = tk.rmsnorm.add_rms_norm(residual[rows], delta[rows], w, 1e-6)
    assert torch.equal(part[0], out[rows]) and torch.equal(part[1], total[rows])
    if dtype == torch.bfloat16 and CUDA:
        unrounded = tk.rmsnorm.rms_norm(residual.float() + delta.float(), w.float(), 1e-6).to(dtype)
        assert not torch.equal(unrounded, out)


@gpu
@needs_cuda
def test_add_rms_norm_under_autograd_keeps_the_kernel_bits_and_takes_the_stock_gradient(tk: ModuleType
                                                                                        ) -> None:
    """With gradients on, `ops.add_rms_norm` returns the fused launch's bits (both outputs) and
    back-propagates the stock add and norm: both inputs' and the weight's gradients as for HF's ops."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from parity import kernels
    from parity.kernels import ops

    norm = Qwen3RMSNorm(96, eps=1e-6).to(DEVICE, torch.bfloat16)
    norm.weight.data = _randn(96, dtype=torch.bfloat16, seed=5)
    runs = []
    for fused in (True, False):
        residual = _randn(ROWS, 96, dtype=torch.bfloat16, seed=7, scale=8.0).requires_grad_()
        delta = _randn(ROWS, 96, dtype=torch.bfloat16, seed=8).requires_grad_()
        norm.weight.grad = None
        with kernels.invariant(None if fused else ()):
            out = ops.add_rms_norm(residual, delta, norm.weight, 1e-6, native=norm.forward)
        (out[0].float().sum() + 2 * out[1].float().sum()).backward()  # a gradient free of out's bits
        runs.append((out, (residual.grad, delta.grad, norm.weight.grad)))
    (fused_out, fused_grads), (_, stock_grads) = runs
    residual = _randn(ROWS, 96, dtype=torch.bfloat16, seed=7, scale=8.0)
    kernel = tk.rmsnorm.add_rms_norm(residual, _randn(ROWS, 96, dtype=torch.bfloat16, seed=8),
                                     norm.weight.detach(), 1e-6)
    assert torch.equal(fused_out[0], kernel[0]) and torch.equal(fused_out[1], kernel[1])
    assert all(torch.equal(a, b) for a, b in zip(fused_grads, stock_grads))


VOCAB = 5000  # > softmax.CHUNK, so rows take several chunks


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_and_log_softmax_match_torch(tk: ModuleType, dtype: torch.dtype) -> None:
    x = _randn(5, VOCAB, dtype=dtype, seed=6, scale=4.0)
    x[0, :7] = float("-inf")  # masked logits (top-k/top-p) stay exact zeros / -inf
    ref = torch.log_softmax(x.double(), -1)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(tk.softmax.softmax(x).double(), ref.exp(), atol=tol, rtol=tol)
    finite = torch.isfinite(ref)
    torch.testing.assert_close(
        tk.softmax.log_softmax(x).double()[finite], ref[finite], atol=tol * 30, rtol=tol
    )
    assert torch.equal(tk.softmax.log_softmax(x)[0, :7], x[0, :7])


@functools.cache
def _softmax_full(tk: ModuleType) -> tuple[torch.Tensor, ...]:
    x = _randn(16, VOCAB, seed=7, scale=4.0)
    return x, tk.softmax.log_softmax(x), tk.softmax.softmax(x)


@few
@given(rows=st.lists(st.integers(0, 15), min_size=1, max_size=16))
def test_softmax_rows_are_batch_invariant(tk: ModuleType, rows: list[int]) -> None:
    x, log_probs, probs = _softmax_full(tk)
    assert torch.equal(tk.softmax.log_softmax(x[rows]), log_probs[rows])
    assert torch.equal(tk.softmax.softmax(x[rows]), probs[rows])


def test_softmax_negative_control_chunking_changes_bits(
    tk: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    softmax = importlib.import_module("parity.kernels.triton.softmax")
    x = _randn(16, VOCAB, seed=7, scale=4.0)
    fixed = tk.softmax.log_softmax(x)
    monkeypatch.setattr(softmax, "CHUNK", softmax.CHUNK // 4)
    assert not torch.equal(tk.softmax.log_softmax(x), fixed)


def _sorted_probs(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows of probabilities sorted in descending order: the top-p prefix sum's input."""
    probs = torch.softmax(_randn(rows, vocab, seed=seed, scale=4.0).double(), -1).float()
    return probs.sort(-1, descending=True).values


def test_cumsum_matches_float64(tk: ModuleType) -> None:
    x = _sorted_probs(5, VOCAB, seed=8)
    x[1, 3000:] = 0.0  # top-k masked tail: the sum stops growing
    ref = torch.cumsum(x.double(), -1)
    torch.testing.assert_close(tk.scan.cumsum(x).double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(tk.scan.cumsum(x)[:, 0], x[:, 0])


@functools.cache
def _cumsum_full(tk: ModuleType) -> tuple[torch.Tensor, torch.Tensor]:
    x = _sorted_probs(16, VOCAB, seed=9)
    return x, tk.scan.cumsum(x)


@few
@given(rows=st.lists(st.integers(0, 15), min_size=1, max_size=16))
def test_cumsum_rows_are_batch_invariant(tk: ModuleType, rows: list[int]) -> None:
    x, full = _cumsum_full(tk)
    assert torch.equal(tk.scan.cumsum(x[rows]), full[rows])


def test_cumsum_negative_control_chunking_changes_bits(
    tk: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    scan = importlib.import_module("parity.kernels.triton.scan")
    x = _sorted_probs(16, VOCAB, seed=9)
    fixed = tk.scan.cumsum(x)
    monkeypatch.setattr(scan, "BLOCK", scan.BLOCK // 4)
    assert not torch.equal(tk.scan.cumsum(x), fixed)


@gpu
@needs_cuda
def test_torch_cuda_cumsum_follows_the_row_count() -> None:
    """The defect the scan kernel removes: the stock CUDA scan rounds a row differently with the
    number of rows beside it (seen at vocab 151,936 on an H200)."""
    x = _sorted_probs(256, 151936, seed=10)
    full = torch.cumsum(x, -1)
    assert any(not torch.equal(torch.cumsum(x[:n], -1), full[:n]) for n in (1, 2, 3, 8, 17, 64))


# ------------------------------------------------------------------------------------- attention

HQ, HKV, HEAD_DIM, CAPACITY = 4, 2, 16, 96
SEQ_LENS = {0: 37, 2: 5, 3: 70}  # slot -> tokens; slot 1 stays unused


def _cache(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    k = _randn(4, HKV, CAPACITY, HEAD_DIM, dtype=dtype, seed=8)
    v = _randn(4, HKV, CAPACITY, HEAD_DIM, dtype=dtype, seed=9)
    q = {slot: _randn(n, HQ, HEAD_DIM, dtype=dtype, seed=10 + slot) for slot, n in SEQ_LENS.items()}
    return k, v, q


def _attend(
    tk: ModuleType,
    dtype: torch.dtype,
    parts: list[tuple[int, int, int]],
    config: object = None,
    max_run: int | None = None,
) -> torch.Tensor:
    """Attention of the packed query tokens `parts` = [(slot, first position, end position), ...];
    max_run=1 takes the one-token (decode) launch whatever the parts are."""
    k, v, q = _cache(dtype)
    query = torch.cat([q[s][a:b] for s, a, b in parts])
    slots = torch.cat([torch.full((b - a,), s, dtype=torch.int64) for s, a, b in parts]).to(DEVICE)
    positions = torch.cat([torch.arange(a, b) for _, a, b in parts]).to(DEVICE)
    return tk.attention.attention(query, k, v, slots, positions, HEAD_DIM**-0.5, config, max_run=max_run)


@functools.cache
def _whole(tk: ModuleType, dtype: torch.dtype) -> dict[int, torch.Tensor]:
    out = _attend(tk, dtype, [(s, 0, n) for s, n in SEQ_LENS.items()])
    return dict(zip(SEQ_LENS, out.split(list(SEQ_LENS.values()))))


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_matches_sdpa(tk: ModuleType, dtype: torch.dtype) -> None:
    k, v, q = _cache(dtype)
    whole = _whole(tk, dtype)
    for slot, n in SEQ_LENS.items():
        keys = k[slot, :, :n].double().repeat_interleave(HQ // HKV, 0)
        values = v[slot, :, :n].double().repeat_interleave(HQ // HKV, 0)
        ref = F.scaled_dot_product_attention(q[slot].double().transpose(0, 1), keys, values, is_causal=True)
        assert _rel_err(whole[slot], ref.transpose(0, 1)) < (1e-5 if dtype == torch.float32 else 2e-2)


@st.composite
def _steps(draw: st.DrawFn) -> list[tuple[int, int, int]]:
    """A packed step: some sequences' prefill chunks or decode tokens, in any order."""
    parts = []
    for slot, n in SEQ_LENS.items():
        if draw(st.booleans()):
            a = draw(st.integers(0, n - 1))
            parts.append((slot, a, draw(st.integers(a + 1, n))))
    return draw(st.permutations(parts)) if parts else [(2, 4, 5)]


@pytest.mark.parametrize("max_run", [None, 1], ids=["runs", "one_token_launch"])
@pytest.mark.parametrize("dtype", DTYPES)
@few
@given(parts=_steps())
def test_attention_is_invariant_to_step_composition(
    tk: ModuleType, dtype: torch.dtype, max_run: int | None, parts: list[tuple[int, int, int]]
) -> None:
    """Every token equals its whole-prefill bits in any step; under the decode launch too, even
    for steps with prefill chunks (a wrong max_run hint costs speed, never bits)."""
    whole = _whole(tk, dtype)
    expected = torch.cat([whole[s][a:b] for s, a, b in parts])
    assert torch.equal(_attend(tk, dtype, parts, max_run=max_run), expected)


@pytest.mark.parametrize("max_run", [None, 1], ids=["runs", "one_token_launch"])
def test_attention_decode_equals_prefill(tk: ModuleType, max_run: int | None) -> None:
    whole = _whole(tk, torch.bfloat16)
    decode = _attend(tk, torch.bfloat16, [(s, n - 1, n) for s, n in SEQ_LENS.items()], max_run=max_run)
    assert torch.equal(decode, torch.stack([whole[s][-1] for s in SEQ_LENS]))


def _attention_plans() -> list:
    """The candidate plans where the kernels run in this process (collected under the interpreter)."""
    if not (CUDA or INTERPRETED):
        return []
    return list(importlib.import_module("parity.kernels.triton.attention").CANDIDATES)


@pytest.mark.parametrize("plan", _attention_plans(), ids=lambda p: p.name)
def test_every_candidate_plan_gives_decode_equal_prefill_equal_chunked(tk: ModuleType, plan: object) -> None:
    """Each plan the GPU sweep may ship keeps a token's bits whatever step it sits in: whole
    prefill, chunks mixed with other sequences' decode tokens, and decode."""
    whole = _attend(tk, torch.float32, [(s, 0, n) for s, n in SEQ_LENS.items()], plan)
    whole_by_slot = dict(zip(SEQ_LENS, whole.split(list(SEQ_LENS.values()))))
    for max_run in (None, 1):
        decode = _attend(tk, torch.float32, [(s, n - 1, n) for s, n in SEQ_LENS.items()], plan, max_run)
        assert torch.equal(decode, torch.stack([whole_by_slot[s][-1] for s in SEQ_LENS]))
    # chunks that start mid-sequence, one reaching past the KV tile at 64, beside decode tokens
    parts = [(3, 50, 69), (2, 4, 5), (0, 20, 37), (3, 69, 70)]
    expected = torch.cat([whole_by_slot[s][a:b] for s, a, b in parts])
    assert torch.equal(_attend(tk, torch.float32, parts, plan), expected)


@pytest.mark.parametrize("programs_per_sm", [0, 1])
def test_a_slot_met_twice_in_one_tile_is_two_runs(tk: ModuleType, programs_per_sm: int) -> None:
    """The kernel finds runs from the slots themselves: a slot whose tokens come back after another
    slot's, inside one tile of query tokens, is two runs, each with its own keys (same bits as the
    tokens alone)."""
    attention = importlib.import_module("parity.kernels.triton.attention")
    plan = attention.AttentionConfig(64, 64, 4, 2, programs_per_sm=programs_per_sm)
    parts = [(3, 0, 3), (0, 0, 2), (3, 3, 5), (2, 0, 1)]
    got = _attend(tk, torch.float32, parts, plan)
    alone = torch.cat([_attend(tk, torch.float32, [part], plan) for part in parts])
    assert torch.equal(got, alone)


def test_persistent_programs_walking_several_runs_each_give_the_per_token_kernel_bits(tk: ModuleType) -> None:
    """Few programs (2 per KV head here), each taking many runs in turn: same bits as one program
    per token, on a step mixing prefill chunks and decode tokens."""
    attention = importlib.import_module("parity.kernels.triton.attention")
    parts = [(3, 20, 69), (2, 4, 5), (0, 0, 37), (3, 69, 70)]
    per_token = _attend(tk, torch.float32, parts, attention.AttentionConfig(16, 64, 4, 2))
    walking = _attend(tk, torch.float32, parts, attention.AttentionConfig(16, 64, 4, 2, programs_per_sm=1))
    assert torch.equal(walking, per_token)


def test_shipped_long_and_short_step_launches_give_the_same_bits(
    tk: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shipped plan launches persistent programs for long steps and one program per token for
    short ones: a token decoded in a short step equals the same token in a long prefill step."""
    attention = importlib.import_module("parity.kernels.triton.attention")
    monkeypatch.setattr(attention, "LONG_STEP_TOKENS", 8)  # the whole prefill (112 tokens) is long
    assert attention.shipped_config(112).programs_per_sm > 0
    assert attention.shipped_config(3).programs_per_sm == 0
    whole = _attend(tk, torch.bfloat16, [(s, 0, n) for s, n in SEQ_LENS.items()])
    by_slot = dict(zip(SEQ_LENS, whole.split(list(SEQ_LENS.values()))))
    decode = _attend(tk, torch.bfloat16, [(s, n - 1, n) for s, n in SEQ_LENS.items()])
    assert torch.equal(decode, torch.stack([by_slot[s][-1] for s in SEQ_LENS]))


def test_attention_negative_control_decode_and_prefill_under_different_kv_tiles(tk: ModuleType) -> None:
    """The sweep's cross-plan check can fail: plans with other KV tile boundaries change a token."""
    attention = importlib.import_module("parity.kernels.triton.attention")
    prefill = _attend(tk, torch.float32, [(3, 0, 70)], attention.AttentionConfig(64, 64, 4, 2))
    decode = _attend(tk, torch.float32, [(3, 69, 70)], attention.AttentionConfig(16, 32, 4, 2))
    assert not torch.equal(decode[0], prefill[-1])


def test_attention_config_rejects_bad_plans() -> None:
    attention = pytest.importorskip("parity.kernels.triton.attention") if (CUDA or INTERPRETED) else None
    if attention is None:
        pytest.skip("no GPU: run by test_kernels_under_the_triton_interpreter_in_a_child_process")
    from parity.core.errors import InputError

    for bad in ((48, 64, 4, 2), (8, 64, 4, 2), (64, 64, 3, 2), (64, 64, 4, 0), (64, 64, 4, 2, -1)):
        with pytest.raises(InputError):
            attention.AttentionConfig(*bad)


def test_attention_refuses_a_cache_past_32_bit_tma_rows(tk: ModuleType) -> None:
    """TMA row coordinates are 32-bit: a cache of 2**31 rows is refused by name, not wrapped."""
    from parity.core.errors import InputError

    attention = importlib.import_module("parity.kernels.triton.attention")
    with pytest.raises(InputError, match="32-bit"):
        attention._rows_descriptor(torch.empty((2**18, 8, 1024, 16), device="meta"), 64)


@pytest.mark.parametrize("max_run", [None, 1], ids=["runs", "one_token_launch"])
def test_attention_negative_control_tile_boundaries_change_bits(
    tk: ModuleType, monkeypatch: pytest.MonkeyPatch, max_run: int | None
) -> None:
    attention = importlib.import_module("parity.kernels.triton.attention")
    parts = [(3, 60, 70)]  # keys up to 70: tiles [0, 64) and [64, 70) at the shipped BLOCK_N
    fixed = _attend(tk, torch.float32, parts, max_run=max_run)
    monkeypatch.setattr(attention, "BLOCK_N", attention.BLOCK_N // 2)
    assert not torch.equal(_attend(tk, torch.float32, parts, max_run=max_run), fixed)


# ---------------------------------------------------------------------------------------- rotary


@pytest.mark.parametrize("dtype", DTYPES)
@few
@given(
    heads=st.sampled_from([(16, 8), (4, 4), (12, 2), (32, 4)]),
    length=st.integers(1, 9),
    batch=st.integers(1, 3),
)
def test_fused_rotation_gives_hf_stock_bits(
    tk: ModuleType, dtype: torch.dtype, heads: tuple[int, int], length: int, batch: int
) -> None:
    """q and k rotated in one launch each equal HF's apply_rotary_pos_emb bit for bit, from the
    transposed (strided) q/k HF hands over, and come back as views of token-major memory."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    if INTERPRETED and dtype == torch.bfloat16:
        pytest.skip(
            "Triton's interpreter does not round fp32 to bf16 to nearest even as torch and the GPU "
            "do: the bf16 bits are checked on the GPU"
        )
    hq, hkv = heads
    q = _randn(batch, length, hq, 64, dtype=dtype, seed=hq + length).transpose(1, 2)
    k = _randn(batch, length, hkv, 64, dtype=dtype, seed=hkv + 7).transpose(1, 2)
    angles = _randn(batch, length, 32, seed=length) * 3
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    fused = tk.rotary.apply_rotary(apply_rotary_pos_emb, q, k, cos, sin)
    stock = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(fused[0], stock[0]) and torch.equal(fused[1], stock[1])
    assert fused[0].transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@few
@given(
    heads=st.sampled_from([(4, 2), (6, 2), (3, 3)]),
    length=st.integers(1, 5),
    batch=st.integers(1, 2),
)
def test_norm_rotary_gives_the_two_norms_then_the_rotation(
    tk: ModuleType, dtype: torch.dtype, heads: tuple[int, int], length: int, batch: int
) -> None:
    """Qwen3's per-head RMSNorm of q and k and their rotation in one launch give the bits of the norm
    kernel then the rotation kernel, from the strided [B, L, H, D] views of one q/k/v product, each
    token alike in any batch (its first sequence alone gives its rows of the batch)."""
    if INTERPRETED and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter does not round fp32 to bf16 to nearest even: the bf16 bits "
                    "are checked on the GPU")
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    hq, hkv = heads
    d = 64
    qkv = _randn(batch, length, (hq + 2 * hkv) * d, dtype=dtype, seed=hq + length, scale=3.0)
    q = qkv[..., :hq * d].view(batch, length, hq, d)
    k = qkv[..., hq * d:(hq + hkv) * d].view(batch, length, hkv, d)
    qw, kw = _randn(d, dtype=dtype, seed=11), _randn(d, dtype=dtype, seed=12)
    angles = _randn(batch, length, d // 2, seed=length) * 3
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    fused = tk.rotary.norm_rotary(q, k, qw, kw, 1e-6, 1e-5, cos, sin)
    three = tk.rotary.apply_rotary(apply_rotary_pos_emb, tk.rmsnorm.rms_norm(q, qw, 1e-6).transpose(1, 2),
                                   tk.rmsnorm.rms_norm(k, kw, 1e-5).transpose(1, 2), cos, sin)
    assert torch.equal(fused[0], three[0]) and torch.equal(fused[1], three[1])
    assert fused[0].transpose(1, 2).is_contiguous()
    alone = tk.rotary.norm_rotary(q[:1], k[:1], qw, kw, 1e-6, 1e-5, cos[:1], sin[:1])
    assert torch.equal(alone[0], fused[0][:1]) and torch.equal(alone[1], fused[1][:1])
    assert tk.rotary.norm_rotary(q, k, qw, kw, 1e-6, 1e-5, cos.double(), sin) is None  # three ops then


@gpu
@needs_cuda
def test_norm_rotary_under_autograd_keeps_the_kernel_bits_and_takes_the_stock_gradient(tk: ModuleType
                                                                                       ) -> None:
    """With gradients on, `ops.norm_rotary` returns the fused launch's bits and back-propagates the
    stock norms and rotation: q's, k's and both weights' gradients as autograd gives them for HF's ops."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    from parity import kernels
    from parity.kernels import ops

    norms = [Qwen3RMSNorm(64, eps=1e-6).to(DEVICE, torch.bfloat16) for _ in range(2)]
    for i, norm in enumerate(norms):
        norm.weight.data = _randn(64, dtype=torch.bfloat16, seed=20 + i)
    angles = _randn(1, 5, 32, seed=3) * 3
    cos, sin = (torch.cat([f(angles), f(angles)], -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    runs = []
    for fused in (True, False):
        q = _randn(1, 5, 4, 64, dtype=torch.bfloat16, seed=1).requires_grad_()
        k = _randn(1, 5, 2, 64, dtype=torch.bfloat16, seed=2).requires_grad_()
        for norm in norms:
            norm.weight.grad = None
        with kernels.invariant(None if fused else ()):
            out = ops.norm_rotary(q, k, *norms, cos, sin, apply_rotary_pos_emb)
        (out[0].float().sum() + 2 * out[1].float().sum()).backward()  # a gradient free of out's bits
        runs.append((out, (q.grad, k.grad, *(n.weight.grad for n in norms))))
    (fused_out, fused_grads), (_, stock_grads) = runs
    q, k = (_randn(1, 5, h, 64, dtype=torch.bfloat16, seed=seed) for h, seed in ((4, 1), (2, 2)))
    weights = [norm.weight.detach() for norm in norms]
    kernel = tk.rotary.norm_rotary(q, k, *weights, 1e-6, 1e-6, cos, sin)
    assert torch.equal(fused_out[0], kernel[0]) and torch.equal(fused_out[1], kernel[1])
    assert all(torch.equal(a, b) for a, b in zip(fused_grads, stock_grads))


# ---------------------------------------------------------------------------------------- cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_cache_write_puts_each_row_where_index_copy_does(
    tk: ModuleType, dtype: torch.dtype, tokens: int
) -> None:
    """One launch writes keys and values (HF's transposed [B, H, L, D] views, reshaped) into the
    cache rows of their tokens, bit for bit as the two stock `index_copy_` calls; other rows keep
    theirs (control: a row index off by one changes the cache)."""
    heads, d, capacity = 2, 64, 48
    key = _randn(1, tokens, heads, d, dtype=dtype, seed=tokens).transpose(1, 2)
    value = _randn(1, tokens, heads, d, dtype=dtype, seed=tokens + 1).transpose(1, 2)
    g = torch.Generator().manual_seed(tokens)
    rows = torch.randperm(3 * heads * capacity, generator=g)[:tokens * heads].to(DEVICE)
    flat = [x.transpose(1, 2).reshape(-1, d) for x in (key, value)]
    caches = [_randn(3 * heads * capacity, d, dtype=dtype, seed=s) for s in (5, 6)]
    stock = [c.clone() for c in caches]
    tk.cache.write_kv(*caches, rows, *flat)
    for c, x in zip(stock, flat, strict=True):
        c.index_copy_(0, rows, x)
    assert torch.equal(caches[0], stock[0]) and torch.equal(caches[1], stock[1])
    shifted = caches[0].clone()
    tk.cache.write_kv(shifted, caches[1].clone(), (rows + 1) % shifted.shape[0], *flat)
    assert not torch.equal(shifted, stock[0])


@gpu
@needs_cuda
def test_cache_write_under_autograd_carries_the_gradient() -> None:
    """Keys and values that need a gradient take the stock copies, which carry it to them."""
    from parity.kernels import invariant
    from parity.kernels.attention import write_kv

    k_rows, v_rows = torch.zeros(64, 128, device="cuda"), torch.zeros(64, 128, device="cuda")
    key = torch.randn(8, 128, device="cuda", requires_grad=True)
    value = torch.randn(8, 128, device="cuda", requires_grad=True)
    with invariant():
        write_kv(k_rows, v_rows, torch.arange(8, device="cuda") * 3, key, value)
    (k_rows.sum() + 2 * v_rows.sum()).backward()
    assert torch.equal(key.grad, torch.ones_like(key))
    assert torch.equal(value.grad, torch.full_like(value, 2.0))


# ---------------------------------------------------------------------------------------- gated


def _gated_inputs(dtype: torch.dtype, rows: int = 6, width: int = 1500) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up as the two halves of one [rows, 2 * width] product (strided rows), the gate with
    the awkward values: zeros, signed extremes, subnormals, inf and nan."""
    both = _randn(rows, 2 * width, dtype=dtype, seed=rows, scale=4.0)
    gate, up = both.chunk(2, dim=-1)
    edge = torch.tensor([0.0, -0.0, 88.0, -88.0, 1e-39, -1e-39, float("inf"), -float("inf"), float("nan")])
    gate[0, :edge.numel()] = edge.to(dtype)
    return gate, up


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_silu_is_silu_times_up_per_element(
    tk: ModuleType, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SiLU(gate) * up in one pass matches the stock two ops (bit for bit on the GPU, where the
    kernel uses CUDA's expf as torch does; within rounding under the interpreter's numpy exp), reads
    strided halves of one product as their contiguous copies, and is the same per row in any batch."""
    gate, up = _gated_inputs(dtype)
    out = tk.gated.gated(torch.nn.SiLU(), gate, up)
    stock = F.silu(gate) * up
    if CUDA:
        assert _equal_nan(out, stock)
    else:
        torch.testing.assert_close(out, stock, equal_nan=True)
    assert _equal_nan(out, tk.gated.gated(torch.nn.SiLU(), gate.contiguous(), up.contiguous()))
    assert _equal_nan(tk.gated.gated(F.silu, gate[2:4], up[2:4]), out[2:4])
    launches, kernel = [], tk.gated._silu_mul_kernel

    class Counting:
        def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(tk.gated, "_silu_mul_kernel", Counting())
    tk.gated.gated(ACT2FN["silu"], gate, up)
    assert len(launches) == 1  # the activation HF models hold takes the one launch


def _equal_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit where a value is a number, nan at the same places (a nan's payload aside)."""
    same_nan = torch.equal(a.isnan(), b.isnan())
    return same_nan and torch.equal(a.masked_fill(a.isnan(), 0), b.masked_fill(b.isnan(), 0))


@gpu
@needs_cuda
def test_gated_silu_negative_control_triton_exp_differs_from_torch(tk: ModuleType) -> None:
    """The kernel with Triton's own exp (ex2.approx) differs from torch somewhere in a million
    float32 values: the bitwise test above would catch the wrong exp. (In bf16 the last-bit
    differences of the fp32 exp vanished in the rounding on an H100: only float32 shows them.)"""
    gate = torch.randn(1024, 1024, device="cuda") * 4
    up = torch.randn(1024, 1024, device="cuda")
    out = torch.empty_like(gate)
    tk.gated._silu_mul_kernel[(1024, 1)](gate, up, out, 1024, 1024, 1024, 1024, BLOCK=1024, LIBDEVICE=False)
    assert not torch.equal(out, F.silu(gate) * up)


# ------------------------------------------------------------------------------------------- MoE


def test_topk_breaks_ties_to_the_lower_index(tk: ModuleType) -> None:
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0], [0.5, 0.5, 0.5, 0.5, 0.5]], device=DEVICE)
    values, indices = tk.moe.topk(scores, 3)
    assert indices.tolist() == [[1, 2, 4], [0, 1, 2]]
    assert values.tolist() == [[3.0, 3.0, 3.0], [0.5, 0.5, 0.5]]
    values, _ = tk.moe.topk(scores, 2, normalize=True)
    assert values.tolist() == [[0.5, 0.5], [0.5, 0.5]]


TOKENS, HIDDEN, INTER, EXPERTS, TOP_K = 40, 64, 32, 8, 2


def _moe_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    x = _randn(TOKENS, HIDDEN, dtype=dtype, seed=20)
    gate_up = _randn(EXPERTS, 2 * INTER, HIDDEN, dtype=dtype, seed=21, scale=0.125)
    down = _randn(EXPERTS, HIDDEN, INTER, dtype=dtype, seed=22, scale=0.18)
    return x, gate_up, down, _randn(TOKENS, EXPERTS, seed=23)


def _route(tk: ModuleType, logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    weights, index = tk.moe.topk(torch.softmax(logits, -1), TOP_K, normalize=True)
    return weights.to(dtype), index


@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_forward_matches_float64(tk: ModuleType, dtype: torch.dtype) -> None:
    x, gate_up, down, logits = _moe_inputs(dtype)
    weights, index = _route(tk, logits, dtype)
    ref = torch.zeros(TOKENS, HIDDEN, dtype=torch.float64, device=DEVICE)
    for t in range(TOKENS):
        for j in range(TOP_K):
            e = int(index[t, j])
            gate, up = (gate_up[e].double() @ x[t].double()).chunk(2)
            ref[t] += weights[t, j].double() * (down[e].double() @ (F.silu(gate) * up))
    out = tk.moe.experts_forward(x, index, weights, gate_up, down, F.silu)
    assert _rel_err(out, ref) < (1e-6 if dtype == torch.float32 else 3e-2)


@functools.cache
def _moe_full(tk: ModuleType, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    x, gate_up, down, logits = _moe_inputs(dtype)
    weights, index = _route(tk, logits, dtype)
    return x, gate_up, down, weights, index, tk.moe.experts_forward(x, index, weights, gate_up, down, F.silu)


@pytest.mark.parametrize("dtype", DTYPES)
@few
@given(rows=st.lists(st.integers(0, TOKENS - 1), min_size=1, max_size=TOKENS))
def test_experts_forward_is_batch_invariant(tk: ModuleType, dtype: torch.dtype, rows: list[int]) -> None:
    x, gate_up, down, weights, index, full = _moe_full(tk, dtype)
    part = tk.moe.experts_forward(x[rows], index[rows], weights[rows], gate_up, down, F.silu)
    assert torch.equal(part, full[rows])


@pytest.mark.parametrize("dtype", DTYPES)
def test_combine_reads_each_slot_where_the_experts_left_it(tk: ModuleType, dtype: torch.dtype) -> None:
    """`combine(rows=)` on the experts' sorted output gives the bits of combining the slots put back in
    token order first (what experts_forward did before); control: the sorted rows read as if in token
    order give another sum."""
    t, k, h = 7, 3, 40
    slots = _randn(t * k, h, dtype=dtype, seed=31)
    weights = _randn(t, k, dtype=dtype, seed=32)
    order = torch.randperm(t * k, generator=torch.Generator().manual_seed(33)).to(DEVICE)
    position = torch.empty_like(order).scatter_(0, order, torch.arange(t * k, device=DEVICE))
    in_order = tk.moe.combine(slots.view(t, k, h), weights)
    assert torch.equal(tk.moe.combine(slots[order], weights, rows=position), in_order)
    assert not torch.equal(tk.moe.combine(slots[order].view(t, k, h), weights), in_order)


@pytest.mark.parametrize(("slots", "experts"), [(1, 4), (24, 4), (2500, 64)])
def test_route_is_the_stable_argsort_and_its_inverse(tk: ModuleType, slots: int, experts: int) -> None:
    """The counting sort gives argsort(stable=True)'s order (2,500 slots span three blocks; the last
    expert gets none) and its inverse; control: the same experts with ties in reverse slot order differ."""
    flat = torch.randint(0, experts - 1, (slots,), generator=torch.Generator().manual_seed(slots)).to(DEVICE)
    counts = torch.bincount(flat, minlength=experts)
    offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    order, position = tk.moe.route(flat, offsets)
    assert torch.equal(order, torch.argsort(flat, stable=True))
    assert torch.equal(position[order], torch.arange(slots, device=DEVICE))
    assert torch.equal(tk.moe.route(flat, offsets, k=3)[0], order // 3)
    if slots > experts:
        ties_reversed = torch.argsort(flat * slots - torch.arange(slots, device=DEVICE))
        assert not torch.equal(order, ties_reversed)


def test_grouped_linear_negative_control_split_k_plan_breaks_invariance(tk: ModuleType) -> None:
    x, w = _randn(POOL, 256, seed=24), _randn(2, 64, 256, seed=25)
    grouped = _split_k_when_few_rows(tk.moe.grouped_linear)
    few, many = torch.tensor([0, 6, 10], device=DEVICE), torch.tensor([0, 100, POOL], device=DEVICE)
    rows = list(range(6)) + list(range(100, 104))
    assert torch.equal(tk.moe.grouped_linear(x[rows], w, few), tk.moe.grouped_linear(x, w, many)[rows])
    assert not torch.equal(grouped(x[rows], w, few), grouped(x, w, many)[rows])


# ----------------------------------------------------------------------- GPU-only, real shapes


@gpu
@needs_cuda
@pytest.mark.parametrize("n,k", [(6144, 2048), (2048, 6144), (4096, 2048), (151936, 2048)])
def test_linear_rows_invariant_at_qwen3_shapes(tk: ModuleType, n: int, k: int) -> None:
    g = torch.Generator(DEVICE).manual_seed(30)
    x = torch.randn(4096, k, device=DEVICE, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device=DEVICE, generator=g) * k**-0.5).to(torch.bfloat16)
    full = tk.matmul.linear(x, w)
    for m in (1, 2, 15, 16, 17, 255, 256, 1000):
        assert torch.equal(tk.matmul.linear(x[:m], w), full[:m]), f"M={m}"


@gpu
@needs_cuda
def test_fp32_linear_is_not_tf32(tk: ModuleType) -> None:
    torch.backends.cuda.matmul.allow_tf32 = True  # even with the global flag on
    try:
        x, w = _randn(512, 1024, seed=32), _randn(1024, 1024, seed=33)
        assert _rel_err(tk.matmul.linear(x, w), x.double() @ w.double().T) < 1e-6
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


@gpu
@needs_cuda
def test_cublaslt_path_rows_invariant_at_probed_shapes() -> None:
    """The probed cuBLASLt route, in a process configured for it (the env must precede CUDA start)."""
    code = """
import torch
torch.backends.cuda.preferred_blas_library("cublaslt")
from parity.kernels.triton.matmul import cublaslt_ready, linear, prepare, route
assert cublaslt_ready()
shapes = [(torch.bfloat16, n, k) for n, k in ((2048, 2048), (1024, 2048), (6144, 2048), (2048, 6144))]
prepare(shapes, torch.device("cuda"))
g = torch.Generator("cuda").manual_seed(0)
for dtype, n, k in shapes:
    print(n, k, route(dtype, n, k, False))
    x = torch.randn(4096, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(dtype)
    full = linear(x, w)
    for m in (1, 2, 15, 16, 17, 255, 256, 1000):
        assert torch.equal(linear(x[:m], w), full[:m]), (n, k, m)
"""
    matmul = importlib.import_module("parity.kernels.triton.matmul")
    env = {**os.environ, **matmul.CUBLASLT_ENV}
    subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, check=True, timeout=300)
