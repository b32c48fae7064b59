"""The CPU attention, RMSNorm and AMX linear after their speed rework (docs/PERF.md, "The CPU engine,
round of 2026-12-05 night"): bit for bit the definitions as they were, at one and two threads, over
any batch composition; each property with a negative control that its own examples catch.

The definitions are written here as they were: attention with its operands converted and padded
afresh each call (`pad`, an expanded query copy per round, a `pointwise` exp, a padded `tree_sum`,
the quotient in float32 then rounded); RMSNorm with both column blocks of the ones-column GEMM and
a zero-padded `pointwise` rsqrt; the AMX linear through `usable` and `matmul` on 2-D rows.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis_controls import examples_until_failure

from parity.kernels import cpu, cpu_attention, cpu_bf16, cpu_gemm
from parity.kernels.cpu_attention import ALIGN, HEAD_ROWS, KEY_BLOCK
from parity.monitor.summary import bounded_threads

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _bits(x: torch.Tensor) -> torch.Tensor:
    """x's bit patterns as integers: signed zeros and NaNs compare as the bits they are."""
    return x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


# --- attention: the definition -------------------------------------------------------------------

def _gather_as_written(cache, plan, width, columns, ones):
    _, hkv, capacity, d = cache.shape
    have = min(capacity, width)
    out = torch.zeros(plan.slot_order.numel(), hkv, width, columns)
    out[:, :, :have, :d] = cache[:, :, :have].index_select(0, plan.slot_order)
    if columns > d:
        out[..., d] = float(ones)
    return out


def _attention_as_written(query, k_cache, v_cache, slots, positions, span, scaling):
    t, hq, d = query.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    gp = -(-g // HEAD_ROWS) * HEAD_ROWS
    dk, dv = -(-d // ALIGN) * ALIGN, -(-(d + 1) // ALIGN) * ALIGN
    plan = cpu_attention._plan(slots, positions, span)
    blocks = plan.blocks
    width = blocks * KEY_BLOCK
    keys = _gather_as_written(k_cache, plan, width, dk, False).view(-1, KEY_BLOCK, dk).transpose(1, 2)
    values = _gather_as_written(v_cache, plan, width, dv, True).view(-1, KEY_BLOCK, dv)
    groups = gp // HEAD_ROWS
    q = torch.nn.functional.pad(query.to(torch.float32)[plan.order].view(t, hkv, 1, g, d),
                                (0, dk - d, 0, gp - g)).view(t, hkv, 1, groups, HEAD_ROWS, dk)
    out = torch.empty(t, hkv, gp, dv)
    for lo, hi, rounds in cpu_attention._chunks(plan.rounds, hkv * blocks * gp * (KEY_BLOCK + dv)):
        scores = torch.empty(groups, hi - lo, hkv, blocks, HEAD_ROWS, KEY_BLOCK)
        weighted = torch.empty(groups, hi - lo, hkv, blocks, HEAD_ROWS, dv)
        for start, n in rounds:
            for group in range(groups):
                a = q[start:start + n, :, :, group].expand(n, hkv, blocks, HEAD_ROWS, dk)
                a = a.reshape(-1, HEAD_ROWS, dk)
                scores[group, start - lo:start - lo + n] = cpu_gemm.bmm(a, keys[:n * hkv * blocks]).view(
                    n, hkv, blocks, HEAD_ROWS, KEY_BLOCK)
        key = torch.arange(width).view(1, 1, blocks, 1, KEY_BLOCK)
        hidden = key > positions[plan.order].view(t, 1, 1, 1, 1)
        scores.mul_(scaling).masked_fill_(hidden[lo:hi], float("-inf"))
        p = cpu.pointwise(torch.exp, scores - scores.amax(dim=(3, 5), keepdim=True))
        for start, n in rounds:
            for group in range(groups):
                weighted[group, start - lo:start - lo + n] = cpu_gemm.bmm(
                    p[group, start - lo:start - lo + n].reshape(-1, HEAD_ROWS, KEY_BLOCK),
                    values[:n * hkv * blocks]).view(n, hkv, blocks, HEAD_ROWS, dv)
        out[lo:hi] = cpu.tree_sum(weighted, 3).permute(1, 2, 0, 3, 4).reshape(hi - lo, hkv, gp, dv)
    result = torch.empty(t, hkv, g, dv)
    result[plan.order] = out[:, :, :g]
    return (result[..., :d] / result[..., d:d + 1]).reshape(t, hq, d).to(query.dtype)


# --- attention: the property ---------------------------------------------------------------------

@st.composite
def attention_calls(draw):
    """One attention call: heads (KV heads, query heads per KV head: padded groups and several groups),
    a head dim (padded columns or none), a cache, tokens of any slots and positions (repeated slots:
    prefill rounds; one per slot: decode; consecutive slots or not), a span up to past the capacity."""
    hkv = draw(st.integers(1, 3))
    g = draw(st.sampled_from([1, 3, 4, 5, 9]))
    d = draw(st.sampled_from([8, 16, 24, 64]))
    num_slots = draw(st.integers(1, 5))
    capacity = draw(st.sampled_from([32, 64, 96]))
    t = draw(st.integers(1, 24))
    slots = draw(st.lists(st.integers(0, num_slots - 1), min_size=t, max_size=t))
    positions = draw(st.lists(st.integers(0, capacity - 1), min_size=t, max_size=t))
    span = max(positions) + 1 + draw(st.sampled_from([0, 31, KEY_BLOCK * 2]))
    return hkv, g, d, num_slots, capacity, slots, positions, span


ATTENTION_DRAWS = {"calls": st.lists(attention_calls(), min_size=2, max_size=3),
                   "dtype": st.sampled_from(DTYPES), "chunk": st.sampled_from([1 << 23, 3000]),
                   "seed": st.integers(0, 2**16)}


def _check_attention(calls, dtype, chunk, seed, attention=cpu_attention.attention):
    """Each call of the sequence (so that the kernel's scratch meets other layouts in between), at one
    and two threads, in and out of inference mode (the scratch serves both), equals the definition."""
    g = torch.Generator().manual_seed(seed)
    with mock.patch.object(cpu_attention, "CHUNK_ELEMENTS", chunk):
        for threads in (1, 2):
            with bounded_threads(threads):
                for i, (hkv, heads, d, num_slots, capacity, slots, positions, span) in enumerate(calls):
                    k, v = (torch.randn(num_slots, hkv, capacity, d, generator=g).to(dtype) for _ in range(2))
                    q = (torch.randn(len(slots), hkv * heads, d, generator=g) * 3).to(dtype)
                    args = (q, k, v, torch.tensor(slots), torch.tensor(positions), span, 0.125)
                    expected = _attention_as_written(*args)
                    with torch.inference_mode((i + threads) % 2 == 0):
                        assert torch.equal(_bits(attention(*args)), _bits(expected))


@given(**ATTENTION_DRAWS)
def test_attention_is_the_definition_at_any_threads_layout_and_batch(calls, dtype, chunk, seed):
    _check_attention(calls, dtype, chunk, seed)


def test_control_scratch_padding_kept_across_layouts_is_caught():
    """Negative control: scratch that keeps its padding whatever the layout (the K/V and query padding
    written only at a buffer's first use) fails the property within its examples."""
    def stale(name, shape, device, layout=(), dtype=torch.float32):
        numel = 1
        for size in shape:
            numel *= size
        kept = getattr(cpu._SCRATCH, name, None)
        if kept is not None and kept[0].numel() >= numel:
            return kept[0][:numel].view(shape), False
        with torch.inference_mode(False):  # as `cpu.scratch`: written in and out of inference mode
            buffer = torch.full((numel,), float("nan"), dtype=dtype)
        setattr(cpu._SCRATCH, name, (buffer, None, None))
        return buffer.view(shape), True

    def broken(**drawn):
        with mock.patch.object(cpu_attention, "scratch", stale):
            _check_attention(**drawn)

    first = examples_until_failure(test_attention_is_the_definition_at_any_threads_layout_and_batch, None,
                                   ATTENTION_DRAWS, broken)
    print(f"stale scratch padding fails at example {first}")


def _first_failure_with_plan(change) -> int:
    """The example at which the attention property fails with each plan replaced by `change(plan)`'s
    fields (raises if none of its examples fails)."""
    def changed(*args, **kwargs):
        plan = cpu_attention._plan(args[3], args[4], args[5])
        with mock.patch.object(cpu_attention, "_plan", lambda *_: plan.__class__(
                **{**plan.__dict__, **change(plan)})):
            return cpu_attention.attention(*args, **kwargs)

    def broken(**drawn):
        _check_attention(**drawn, attention=changed)

    return examples_until_failure(test_attention_is_the_definition_at_any_threads_layout_and_batch, None,
                                  ATTENTION_DRAWS, broken)


def test_control_tokens_left_in_round_order_are_caught():
    """Negative control: outputs left in the plan's round order (not put back where each token came
    from) fail the property within its examples."""
    first = _first_failure_with_plan(lambda plan: {"inverse": None})
    print(f"round-order outputs fail at example {first}")


def test_control_a_mask_that_hides_nothing_is_caught():
    """Negative control: a plan that hides no key (bias -0.0 and floor -inf everywhere, keep 1: the
    scale-and-mask pass only scales, nothing is zeroed) fails the property within its examples."""
    first = _first_failure_with_plan(lambda plan: {"bias": torch.full_like(plan.bias, -0.0),
                                                   "floor": torch.full_like(plan.floor, -math.inf),
                                                   "keep": torch.ones_like(plan.keep)})
    print(f"a mask that hides nothing fails at example {first}")


# --- pointwise_: whole buffers where proven ------------------------------------------------------

def _tail_rounds_apart(pieces):
    """A foreach exp whose short pieces (a scalar tail's lengths) round one ulp apart."""
    for piece in pieces:
        piece.exp_()
        if piece.numel() < 16:
            piece.copy_(torch.nextafter(piece, torch.full_like(piece, float("inf"))))


@given(length=st.integers(1, 800).map(lambda n: n * cpu.POINTWISE_ALIGN),
       dtype=st.sampled_from([torch.float32, torch.float64]), threads=st.sampled_from([1, 2]),
       op=st.sampled_from(["exp", "log", "rsqrt"]), seed=st.integers(0, 2**16))
def test_pointwise_in_place_is_the_pieces_at_any_length_and_threads(length, dtype, threads, op, seed):
    """`pointwise_` (one whole-buffer op where `rounds_alike` proved it) gives the bits of the op over
    POINTWISE_CHUNK pieces, element by element in 1-element pieces too."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(length, generator=g, dtype=torch.float64) * 8).to(dtype)
    x = x.abs() if op != "exp" else x
    fn_ = getattr(torch, f"_foreach_{op}_")
    expected = x.clone()
    fn_(expected.split(cpu.POINTWISE_CHUNK))
    singles = x.clone()
    fn_(singles.split(1))
    with bounded_threads(threads):
        got = cpu.pointwise_(fn_, x.clone())
    assert torch.equal(_bits(got), _bits(expected))
    assert torch.equal(_bits(got), _bits(singles))


def test_an_op_whose_tail_rounds_apart_keeps_its_pieces():
    """Negative control of the proof: a foreach op whose short pieces round differently is not proven,
    and `pointwise_` hands it pieces of POINTWISE_CHUNK (the whole buffer would round other bits)."""
    x = torch.randn(3 * cpu.POINTWISE_CHUNK)
    assert not cpu.rounds_alike(_tail_rounds_apart, torch.float32)
    seen = []
    cpu.pointwise_(lambda pieces: seen.append([p.numel() for p in pieces]) or _tail_rounds_apart(pieces), x)
    assert seen[-1] == [cpu.POINTWISE_CHUNK] * 3  # the calls before it are the proof's probes


# --- RMSNorm -------------------------------------------------------------------------------------

def _rms_norm_as_written(x, weight, eps):
    xf = x.to(torch.float32)
    rows = (xf * xf).reshape(-1, x.shape[-1])
    sums = cpu_gemm._tiled(rows, cpu_gemm._ones_column(rows.shape[1], rows.device))[:, :1]
    rstd = cpu.pointwise(torch.rsqrt, sums.view(*x.shape[:-1], 1) / x.shape[-1] + eps)
    return weight * (xf * rstd).to(x.dtype)


RMS_DRAWS = {"rows": st.sampled_from([1, 5, 31, 32, 33, 64, 65, 200]),
             "width": st.sampled_from([1, 7, 64, 576, 1000]),
             "dtype": st.sampled_from(DTYPES), "weight_dtype": st.sampled_from(["same", "float32"]),
             "seed": st.integers(0, 2**16)}


def _check_rms_norm(rows, width, dtype, weight_dtype, seed, rms_norm=cpu.rms_norm):
    g = torch.Generator().manual_seed(seed)
    # values over 2^-12 .. 2^12: sums in another order round differently
    spread = torch.exp2(torch.randint(-12, 13, (rows, width), generator=g).float())
    x = (torch.randn(2, rows, width, generator=g) * spread).to(dtype)
    weight = torch.randn(width, generator=g).to(dtype if weight_dtype == "same" else torch.float32)
    expected = _rms_norm_as_written(x, weight, 1e-6)
    for threads in (1, 2):
        with bounded_threads(threads):
            assert torch.equal(_bits(rms_norm(x, weight, 1e-6)), _bits(expected))
            assert torch.equal(_bits(rms_norm(x[1, -1:], weight, 1e-6)), _bits(expected[1, -1:]))


@given(**RMS_DRAWS)
def test_rms_norm_is_the_definition_at_any_threads_and_batch(rows, width, dtype, weight_dtype, seed):
    _check_rms_norm(rows, width, dtype, weight_dtype, seed)


def test_control_a_plain_row_sum_is_caught():
    """Negative control: sums of squares by ATen's vectorized sum (another order) fail the property."""
    def plain(rows):
        return rows.sum(-1, keepdim=True)

    def broken(**drawn):
        with mock.patch.object(cpu_gemm, "row_sums", plain):
            _check_rms_norm(**drawn)

    first = examples_until_failure(test_rms_norm_is_the_definition_at_any_threads_and_batch, None, RMS_DRAWS,
                                   broken)
    print(f"a plain row sum fails at example {first}")


# --- the bf16 linear's one look-up per call (AMX or AVX-512 BF16) ---------------------------------

needs_bf16 = pytest.mark.skipif(cpu_bf16.bf16_hardware() is None,
                                reason="this CPU has neither AMX nor AVX-512 BF16")
LINEAR_DRAWS = {"lead": st.sampled_from([(), (1,), (2,), (1, 1)]),
                "rows": st.sampled_from([1, 31, 32, 33, 70]), "bias": st.booleans(), "offset": st.booleans(),
                "seed": st.integers(0, 2**16)}


def _check_linear(lead, rows, bias, offset, seed, linear=cpu.linear):
    """x of any leading dims (a whole tile of rows or not, 64-byte aligned or not) times a weight, then
    again after an in-place update of the weight: the bf16 tiles' `matmul` on the rows."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(192, 576, generator=g).to(torch.bfloat16)
    b = torch.randn(192, generator=g).to(torch.bfloat16) if bias else None
    numel = rows * 576 * (2 if lead == (2,) else 1)
    x = torch.randn(int(offset) + numel, generator=g).to(torch.bfloat16)[int(offset):].view(*lead, rows, 576)
    # the bf16 route whatever PARITY_CPU_BF16_GEMM the suite runs under (float32 would take the other tiles)
    with mock.patch.dict(os.environ, {cpu_bf16.CHOICE_ENV: "bf16"}):
        for _ in range(2):
            expected = cpu_bf16.matmul(x.reshape(-1, 576), weight, b).reshape(*x.shape[:-1], 192)
            for threads in (1, 2):
                with bounded_threads(threads):
                    assert torch.equal(linear(x, weight, b), expected)
            weight.mul_(-0.5)


@needs_bf16
@given(**LINEAR_DRAWS)
def test_amx_linear_is_matmul_on_the_rows_before_and_after_a_weight_update(lead, rows, bias, offset, seed):
    _check_linear(lead, rows, bias, offset, seed)


@needs_bf16
def test_control_a_route_kept_across_a_weight_update_is_caught():
    """Negative control: a route looked up by the weight alone (its first packing kept after an
    in-place update) fails the property within its examples."""
    def broken(**drawn):
        def by_address(weight, bias):
            return weight.data_ptr(), bias is None

        with mock.patch.object(cpu_bf16, "_route_key", by_address):
            _check_linear(**drawn)

    first = examples_until_failure(test_amx_linear_is_matmul_on_the_rows_before_and_after_a_weight_update,
                                   None, LINEAR_DRAWS, broken)
    print(f"a route kept across a weight update fails at example {first}")


# --- freed memory kept for the kernels' temporaries ----------------------------------------------

_CHURN = """
import resource, sys, torch
from parity import kernels
if sys.argv[1] == "prepared":
    kernels.prepare(torch.nn.Linear(4, 4))  # a CPU model, as the engine loads it
def prefill():  # a prefill's pattern over 30 layers: temporaries of 2-6 MB freed, one result kept per layer
    kept = []
    for _ in range(30):
        temporaries = [torch.ones(2048 * 576), torch.ones(2048 * 576),
                       torch.ones(2048 * 1536, dtype=torch.bfloat16)]
        kept.append(torch.ones(2048 * 576, dtype=torch.bfloat16))
        del temporaries
prefill()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    prefill()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_a_prepared_cpu_model_keeps_freed_memory_and_its_temporaries_fault_no_pages():
    """Temporaries of several MB made and freed again and again: after `kernels.prepare` of a CPU model
    their pages stay mapped (a few faults); without it (the control) glibc hands them back each time.
    Faults are counted over five prefills after a first one, in children that fix glibc's heap layout
    from their first allocation (MALLOC_TOP_PAD_, which also turns off the adaptive mmap threshold:
    the control then faults alike in every prefill). One prefill in a child left to the adaptive
    threshold gave anything from 0 to 49k faults in either mode: the single-prefill form of this test
    failed in ~35% of runs."""
    if not cpu.keep_freed_memory():
        pytest.skip("this C library has no mallopt")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "MALLOC_TOP_PAD_": "0"}
    faults = {mode: int(subprocess.run([sys.executable, "-c", _CHURN, mode], capture_output=True, text=True,
                                       check=True, env=env).stdout.split()[-1])
              for mode in ("prepared", "default")}
    assert 10 * faults["prepared"] < faults["default"], faults
