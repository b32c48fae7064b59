"""The AMX bf16 GEMM tiles: the row-invariance proof rejects what it must, the path is the one taken,
and the environment variable that picks it is checked before an engine loads."""

import pytest
import torch

from parity.backends import get_backend, reference
from parity.core.errors import ConfigError
from parity.engine.matmul_routes import linear_routes
from parity.kernels import cpu, cpu_amx, cpu_gemm
from parity.kernels.cpu_gemm import TILE
from parity.monitor.summary import bounded_threads

needs_amx = pytest.mark.skipif(not cpu_amx.amx_available(), reason="this CPU has no AMX bf16 tiles "
                               f"(torch reports {torch.backends.cpu.get_cpu_capability()})")


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


def test_the_proof_accepts_an_invariant_product_and_rejects_what_depends_on_place_or_neighbours():
    weight = _rand(64, 96, seed=1)
    assert cpu_amx.row_invariant(weight, 96, None, product=_float32_tiles)
    assert not cpu_amx.row_invariant(weight, 96, None, product=_by_place)
    assert not cpu_amx.row_invariant(weight, 96, None, product=_by_neighbours)


@needs_amx
def test_bf16_linear_runs_on_the_proven_amx_tiles(monkeypatch):
    monkeypatch.delenv(cpu_amx.CHOICE_ENV, raising=False)
    x, w, b = _rand(70, 576, seed=2), _rand(1536, 576, seed=3), _rand(1536, seed=4)
    for bias in (None, b):
        assert cpu_amx.usable(w, bias)
        got = cpu.linear(x, w, bias)
        assert torch.equal(got, cpu_amx.matmul(x, w, bias))
        float32 = (cpu_gemm.matmul(x, w) + (0 if bias is None else bias)).to(torch.bfloat16)
        # another summation order: some entries round the other way, by about a bf16 step at most
        assert not torch.equal(got, float32)
        assert (got.float() - float32.float()).abs().max() <= 2**-7 * float32.float().abs().max()


@needs_amx
def test_the_thread_count_changes_no_bits_where_onednn_would_split_the_product():
    """oneDNN splits a [32, 32768] x [32768, 16] product over threads by K: between one and two
    threads some of 24 wide-valued tiles differ (the control); `cpu.linear` runs each product on one
    thread, so none do."""
    w = _rand(16, 32768, seed=5)
    packed = cpu_amx._pack(w)
    tiles = [cpu_amx._tile(seed, 32768) for seed in range(24)]
    op = torch.ops.mkldnn._linear_pointwise

    def raw(a):
        return op(a, packed, None, "none", [], "")

    with bounded_threads(1):
        one = [(raw(a), cpu.linear(a, w)) for a in tiles]
    with bounded_threads(2):
        two = [(raw(a), cpu.linear(a, w)) for a in tiles]
    assert all(torch.equal(a[1], b[1]) for a, b in zip(one, two))
    if all(torch.equal(a[0], b[0]) for a, b in zip(one, two)):
        pytest.skip("this host's oneDNN gave the same bits at one and two threads for every tile: no "
                    "control here (on the AMX Xeon it differs)")


@needs_amx
def test_the_variable_picks_float32_tiles_and_the_report_says_which_ran(monkeypatch):
    x, w = _rand(33, 576, seed=2), _rand(576, 576, seed=3)
    monkeypatch.setenv(cpu_amx.CHOICE_ENV, "float32")
    assert cpu_amx.choice() == "float32" and not cpu_amx.usable(w, None)
    assert torch.equal(cpu.linear(x, w), cpu_gemm.matmul(x, w, torch.bfloat16))
    assert {r.route for r in linear_routes("tiny-llama", device="cpu")} == {"float32"}
    assert get_backend("reference", "tiny-llama", dtype="bfloat16").meta["cpu_bf16_gemm"] == "float32"
    monkeypatch.setenv(cpu_amx.CHOICE_ENV, "amx")
    assert {r.route for r in linear_routes("tiny-llama", device="cpu")} == {"amx-bf16"}
    assert get_backend("reference", "tiny-llama", dtype="bfloat16").meta["cpu_bf16_gemm"] == "amx"


def test_a_bad_choice_is_refused_before_the_engine_loads(monkeypatch):
    def loaded(*args, **kwargs):
        raise AssertionError("the engine loaded before the variable was checked")

    monkeypatch.setattr(reference, "ReferenceEngine", loaded)
    monkeypatch.setenv(cpu_amx.CHOICE_ENV, "fp8")
    with pytest.raises(ConfigError, match=f"{cpu_amx.CHOICE_ENV}='fp8'.*'amx'.*'float32'"):
        get_backend("reference", "tiny-llama", dtype="bfloat16")
