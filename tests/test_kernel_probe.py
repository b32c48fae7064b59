"""The load-time matmul probe: its verdicts, its on-disk cache, the routes it selects, `parity kernels`.

On CPU the probe runs over stand-in matmuls (parity's row-invariant CPU linear, and a negative
control whose K split follows M); on CUDA, in a process set up for cuBLASLt without split-K, it
probes real weight shapes of two model families and the chosen route must be row-invariant.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from parity.cli import main
from parity.kernels import cpu, cpu_bf16, probe

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()


def _split_k_when_large(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A matmul whose plan follows M, as split-K does: above 64 rows K is reduced in two halves."""
    if x.shape[0] <= 64:
        return cpu.linear(x, w)
    half = w.shape[1] // 2
    return cpu.linear(x[:, :half], w[:, :half]) + cpu.linear(x[:, half:], w[:, half:])


def test_probe_m_covers_every_power_of_two_boundary() -> None:
    for p in range(1, 14):
        assert {2**p - 1, 2**p} <= set(probe.PROBE_M)
    assert probe.PROBE_MAX_M == 8192 and probe.PROBE_M[0] == 1


def test_probe_proves_a_row_invariant_matmul() -> None:
    verdict = probe.probe_rows(cpu.linear, torch.float32, 16, 32, "cpu")
    assert verdict.invariant and verdict.differing_m == ()
    assert "row-invariant" in verdict.reason()


def test_probe_rejects_a_matmul_whose_plan_follows_m() -> None:
    verdict = probe.probe_rows(_split_k_when_large, torch.float32, 16, 32, "cpu")
    assert not verdict.invariant
    assert set(verdict.differing_m) <= {m for m in probe.PROBE_M if m <= 64} and verdict.differing_m
    assert "differ" in verdict.reason()


def test_cache_round_trip_is_keyed_by_fingerprint_and_shape(tmp_path: Path) -> None:
    cache = probe.VerdictCache(tmp_path / "k" / "probe.json")
    fp = {"gpu": "X", "driver": "1"}
    verdict = probe.probe_rows(cpu.linear, torch.float32, 16, 32, "cpu")
    assert cache.get(fp, torch.float32, 16, 32) is None
    cache.put(fp, verdict, torch.float32)
    assert cache.get(fp, torch.float32, 16, 32) == verdict
    assert cache.get({**fp, "driver": "2"}, torch.float32, 16, 32) is None  # a driver upgrade re-probes
    assert cache.get(fp, torch.bfloat16, 16, 32) is None
    assert cache.get(fp, torch.float32, 32, 16) is None
    data = json.loads(cache.path.read_text())
    cache.path.write_text(json.dumps({**data, "version": probe.CACHE_VERSION + 1}))
    assert cache.get(fp, torch.float32, 16, 32) is None  # another cache format is ignored
    cache.path.write_text("{not json")
    assert cache.get(fp, torch.float32, 16, 32) is None


def test_cache_path_follows_parity_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PARITY_CACHE", str(tmp_path))
    assert probe.cache_path() == tmp_path / "kernels" / "matmul-probe.json"


def test_parity_kernels_lists_each_linear_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kernels", "--model", "tiny-qwen3-moe", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    # bf16 weights: the bf16 tiles where the CPU has them
    route = cpu_bf16.HARDWARE.get(cpu_bf16.choice(), ("float32",))[0]
    assert "weight [N, K]" in out and "128 x 128" in out and route in out


@pytest.fixture
def stand_in_probe(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[ModuleType, list]]:
    """`parity.kernels.triton.matmul` in a stand-in process set up for cuBLASLt, without a GPU: its
    probe runs parity's CPU linear (and the split-K control for weight [32, 16]), its verdicts are
    cached under `tmp_path`; yields the module and the shapes probed. Forgets every verdict after."""
    pytest.importorskip("triton")
    from parity.kernels.triton import matmul

    probed: list[tuple[int, int]] = []

    def probe_rows(linear, dtype, n, k, device):
        probed.append((n, k))
        stand_in = _split_k_when_large if (n, k) == (32, 16) else cpu.linear
        return probe.probe_rows(stand_in, torch.float32, n, k, "cpu")

    monkeypatch.setenv("PARITY_CACHE", str(tmp_path))
    monkeypatch.setattr(matmul, "cublaslt_ready", lambda: True)
    monkeypatch.setattr(matmul, "fingerprint", lambda device, env: {"gpu": "stand-in"})
    monkeypatch.setattr(matmul, "probe_rows", probe_rows)
    monkeypatch.setattr(matmul.torch.cuda, "device", lambda device: contextlib.nullcontext())
    yield matmul, probed
    matmul.forget_verdicts({(torch.bfloat16, n, k) for n, k in probed})


@pytest.mark.slow
def test_route_follows_the_verdict_bias_and_process_setup(stand_in_probe,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    matmul, _ = stand_in_probe
    matmul.prepare({(torch.bfloat16, 16, 32), (torch.bfloat16, 32, 16)}, torch.device("cpu"))
    bad = probe.probe_rows(_split_k_when_large, torch.float32, 32, 16, "cpu")
    assert matmul.route(torch.bfloat16, 16, 32, False, "cpu")[0] == "cublaslt"
    assert matmul.route(torch.bfloat16, 32, 16, False, "cpu") == ("triton", bad.reason())
    assert matmul.route(torch.bfloat16, 16, 32, True, "cpu")[0] == "triton"  # a bias: not probed
    assert "not probed" in matmul.route(torch.bfloat16, 64, 64, False, "cpu")[1]
    monkeypatch.setattr(matmul, "cublaslt_ready", lambda: False)
    assert matmul.route(torch.bfloat16, 16, 32, False, "cpu")[0] == "triton"


def test_forgotten_verdicts_come_back_from_the_disk_cache(stand_in_probe) -> None:
    """`forget_verdicts` drops a verdict from the process (its shape takes Triton), and the next
    `prepare` reads it from the on-disk cache without probing again (the probe section's cached time)."""
    matmul, probed = stand_in_probe
    shape = (torch.bfloat16, 16, 32)
    matmul.prepare({shape}, torch.device("cpu"))
    assert probed == [(16, 32)] and matmul.route(torch.bfloat16, 16, 32, False, "cpu")[0] == "cublaslt"
    matmul.forget_verdicts([shape])
    assert "not probed" in matmul.route(torch.bfloat16, 16, 32, False, "cpu")[1]
    matmul.prepare({shape}, torch.device("cpu"))
    assert probed == [(16, 32)] and matmul.route(torch.bfloat16, 16, 32, False, "cpu")[0] == "cublaslt"


def test_prepare_probes_nothing_in_a_process_not_set_up_for_cublaslt(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from parity.kernels.triton import matmul

    monkeypatch.setattr(matmul, "cublaslt_ready", lambda: False)
    monkeypatch.setattr(matmul, "probe_rows", lambda *a, **k: pytest.fail("probed"))
    matmul.prepare({(torch.bfloat16, 16, 32)}, torch.device("cpu"))


def test_parity_kernels_cublaslt_needs_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kernels", "--model", "tiny-qwen3", "--device", "cpu", "--cublaslt"]) == 2
    assert "--cublaslt needs --device cuda" in capsys.readouterr().err


_GPU_CHILD = """
import json, sys, torch
torch.backends.cuda.preferred_blas_library("cublaslt")
from parity.kernels.probe import PROBE_M, cancelling_rows
from parity.kernels.triton import matmul
assert matmul.cublaslt_ready()
# Qwen3-1.7B and Llama-3.2-1B linear shapes: nobody wrote these down for the route
shapes = [(2048, 2048), (1024, 2048), (6144, 2048), (2048, 6144), (151936, 2048),
          (512, 2048), (8192, 2048), (2048, 8192), (128256, 2048)]
matmul.prepare({(torch.bfloat16, n, k) for n, k in shapes}, torch.device("cuda"))
routes = {f"{n}x{k}": matmul.route(torch.bfloat16, n, k, False) for n, k in shapes}
g = torch.Generator("cuda").manual_seed(5)
for n, k in shapes:
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(torch.bfloat16)
    x = cancelling_rows(w, 4096, 5)  # a row's result there is its summation order's rounding alone
    full = matmul.linear(x, w)
    for m in (1, 2, 15, 16, 17, 255, 256, 1000):
        assert torch.equal(matmul.linear(x[:m], w), full[:m]), (n, k, m)
print(json.dumps(routes))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (CUDA not available)")
def test_probe_selects_cublaslt_for_two_model_families_and_the_route_is_row_invariant(tmp_path: Path) -> None:
    from parity.kernels.triton.matmul import CUBLASLT_ENV

    env = {**os.environ, **CUBLASLT_ENV, "PARITY_CACHE": str(tmp_path)}
    child = subprocess.run([sys.executable, "-c", _GPU_CHILD], env=env, cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-4000:]
    routes = json.loads(child.stdout.strip().splitlines()[-1])
    print(routes)
    assert (tmp_path / "kernels" / "matmul-probe.json").exists()
    # the verdict is the probe's, not a list: any shape may fail it, but then the linear took Triton
    assert all(path in ("cublaslt", "triton") for path, _ in routes.values())
    assert any(path == "cublaslt" for path, _ in routes.values()), routes


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (CUDA not available)")
def test_without_the_cublaslt_setup_every_shape_takes_triton() -> None:
    from parity.kernels.triton import matmul

    if matmul.cublaslt_ready():
        pytest.skip("this process is set up for cuBLASLt")
    matmul.prepare({(torch.bfloat16, 2048, 2048)}, torch.device("cuda"))
    path, why = matmul.route(torch.bfloat16, 2048, 2048, False, "cuda")
    assert path == "triton" and "not set up" in why


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (CUDA not available)")
def test_parity_kernels_routes_a_llama_shaped_model_through_the_probe(tmp_path: Path) -> None:
    """`parity kernels --cublaslt` on another family's shapes: the probe, not a list, picks the route."""
    from parity.models import shaped

    config = shaped.shaped_config("llama-3.2-1b", 1)
    path = shaped.save_random_model(config, tmp_path / "llama", device="cuda")
    argv = ["kernels", "--model", str(path), "--cublaslt"]
    code = f"from parity.cli import main; raise SystemExit(main({argv!r}))"
    child = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                           timeout=300, env={**os.environ, "PARITY_CACHE": str(tmp_path / "cache")})
    assert child.returncode == 0, child.stderr[-4000:]
    print(child.stdout)
    routes = {(cols[1], cols[3]): cols[5] for cols in map(str.split, child.stdout.splitlines()[1:])}
    assert set(routes) >= {("8192", "2048"), ("2048", "8192"), ("512", "2048")}
    assert "cublaslt" in routes.values(), child.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cancelling_rows_sum_to_exactly_zero_against_their_weight_rows(dtype: torch.dtype) -> None:
    w = (torch.randn(40, 70, generator=torch.Generator().manual_seed(2)) * 70**-0.5).to(dtype)
    x = probe.cancelling_rows(w, 9, 3)
    # products of two float32 values are exact in float64, and fsum rounds their sum once
    sums = [math.fsum((x[r].double() * w[(r * 7919 + 3) % 40].double()).tolist()) for r in range(9)]
    assert x.dtype == dtype and sums == [0.0] * 9
    assert bool(torch.isfinite(x).all()) and float(x.abs().max()) > 1


def test_cublaslt_products_longer_than_the_probe_run_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe proves row counts up to PROBE_MAX_M only: a longer product (an 8192-token engine step, a
    training batch) runs as pieces of at most that many rows, each starting on a multiple of it."""
    pytest.importorskip("triton")
    from parity.kernels.triton import matmul

    rows: list[int] = []
    real = matmul.F.linear

    def counted(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows.append(x.reshape(-1, x.shape[-1]).shape[0])
        return real(x, weight)

    monkeypatch.setattr(matmul.F, "linear", counted)
    weight = torch.randn(8, 16)
    x = torch.randn(2, probe.PROBE_MAX_M + 5, 16)
    out = matmul.cublaslt_linear(x, weight)
    assert rows == [probe.PROBE_MAX_M, probe.PROBE_MAX_M, 10]  # 2 * 8197 rows: 8192 + 8192 + 10
    assert out.shape == (2, probe.PROBE_MAX_M + 5, 8)
    assert torch.equal(out, torch.cat([real(p, weight) for p in x.reshape(-1, 16).split(probe.PROBE_MAX_M)])
                       .reshape(2, -1, 8))
    rows.clear()
    matmul.cublaslt_linear(x[:, :7], weight)
    assert rows == [14]  # within the probe's rows: one call, as before


_PAST_THE_PROBE = """
import torch
import torch.nn.functional as F
from parity.kernels import probe
from parity.kernels.triton import matmul

matmul.configure_cublaslt()
n = k = 2048
matmul.prepare({(torch.bfloat16, n, k)}, torch.device("cuda"))
path, why = matmul.route(torch.bfloat16, n, k, False)
if path != "cublaslt":
    print("not on cuBLASLt:", why)
    raise SystemExit(3)
g = torch.Generator(device="cuda").manual_seed(0)
w = (torch.randn(n, k, generator=g, device="cuda") * k ** -0.5).bfloat16()
x = probe.cancelling_rows(w, 3 * 8192 + 100, 1)
cuts = [(a, m) for m in (1, 4096, 8192, 8193, 12000, 16384, 16385, 20000) for a in (0, 1, 8, 8191)
        if a + m <= x.shape[0]]
for name, linear in (("cublaslt_linear", matmul.linear), ("one F.linear call", F.linear)):
    full = linear(x, w)
    bad = [(a, m) for a, m in cuts if not torch.equal(linear(x[a:a + m], w), full[a:a + m])]
    print(name, "differing (offset, rows):", bad)
    if name == "cublaslt_linear" and bad:
        raise SystemExit(1)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (CUDA not available)")
def test_cublaslt_route_stays_row_invariant_past_the_probed_rows(tmp_path: Path) -> None:
    """Slices of up to 20,000 rows of a cuBLASLt-routed product equal the whole product's rows bit for
    bit (the pieces of `cublaslt_linear`); it prints whether one unsplit F.linear call would have."""
    child = subprocess.run([sys.executable, "-c", _PAST_THE_PROBE], cwd=ROOT, capture_output=True, text=True,
                           timeout=300, env={**os.environ, "PARITY_CACHE": str(tmp_path)})
    print(child.stdout)
    if child.returncode == 3:
        pytest.skip(child.stdout.strip())
    assert child.returncode == 0, child.stdout + child.stderr[-4000:]
