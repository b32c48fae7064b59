"""Round 7, GPU kernel selection caches and `parity kernels`: a proof made on one GPU is not reused
on another, the probe's on-disk fingerprint tells a MIG slice or cut-down card from the full card,
and the listing says what a run does for a weight Triton cannot load. CPU only: device properties
are faked and no Triton kernel is launched."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from torch import nn

from parity.core.errors import InputError
from parity.engine import matmul_routes
from parity.kernels import probe

pytest.importorskip("triton")

BF16 = torch.bfloat16


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[ModuleType, list]]:
    """`parity.kernels.triton.matmul` in a stand-in process set up for cuBLASLt with two different GPUs:
    on "cuda:0" every probe passes, on "cuda:1" every probe finds differing rows (verdicts made up,
    nothing runs). Yields the module and the (device, "cublaslt" or "triton") probes run, in order;
    the proofs start empty."""
    from parity.kernels.triton import matmul

    probed: list[tuple[str, str]] = []

    def probe_rows(linear, dtype, n, k, device, **_):
        where = str(torch.device(device))
        probed.append((where, "cublaslt" if linear is matmul.F.linear else "triton"))
        differing = () if where == "cuda:0" else (65, 127)
        return probe.Verdict(str(dtype).removeprefix("torch."), n, k, not differing, differing,
                             len(probe.PROBE_M))

    monkeypatch.setenv("PARITY_CACHE", str(tmp_path))
    monkeypatch.setattr(matmul, "cublaslt_ready", lambda: True)
    monkeypatch.setattr(matmul, "fingerprint", lambda device, env: {"gpu": f"model of {device}"})
    monkeypatch.setattr(matmul, "probe_rows", probe_rows)
    monkeypatch.setattr(matmul.torch.cuda, "device", lambda device: contextlib.nullcontext())
    for name in ("_verdicts", "_plans_agree", "_groups_agree"):
        monkeypatch.setattr(matmul, name, {})
    yield matmul, probed


def test_a_cublaslt_verdict_of_one_gpu_is_not_reused_on_another(two_gpus) -> None:
    """The in-process verdicts were keyed by (dtype, N, K): `prepare` on GPU 1 found GPU 0's verdict and
    probed nothing, and GPU 1's products took cuBLASLt on GPU 0's proof."""
    matmul, probed = two_gpus
    shape = (BF16, 16, 32)
    matmul.prepare({shape}, torch.device("cuda", 0))
    matmul.prepare({shape}, torch.device("cuda", 1))
    assert [where for where, kind in probed if kind == "cublaslt"] == ["cuda:0", "cuda:1"]
    assert matmul.route(*shape, False, "cuda:0")[0] == "cublaslt"
    path, why = matmul.route(*shape, False, "cuda:1")
    assert path == "triton" and "differ" in why
    assert matmul._on_cublaslt(*shape, "cuda:0") and not matmul._on_cublaslt(*shape, "cuda:1")
    # a device that never probed takes Triton; forgetting drops the shape on every device
    assert "not probed on this device" in matmul.route(*shape, False, "cuda:2")[1]
    matmul.forget_verdicts([shape])
    assert not matmul._on_cublaslt(*shape, "cuda:0")


def test_a_decode_plan_proven_on_one_gpu_is_not_taken_on_another(two_gpus) -> None:
    """`prove_plans` on GPU 1 skipped a shape GPU 0 had proven, so GPU 1's short steps took the decode
    plan (other bits than its long steps) on GPU 0's proof."""
    matmul, probed = two_gpus
    shape = (BF16, 1024, 2048)
    matmul.prove_plans([shape], torch.device("cuda", 0))
    matmul.prove_plans([shape], torch.device("cuda", 1))
    assert probed == [("cuda:0", "triton"), ("cuda:1", "triton")]
    assert matmul.plan_for(*shape, 256, "cuda:0") == matmul.decode_config(*shape)
    assert matmul.plan_for(*shape, 256, "cuda:1") == matmul.tile_config(*shape)
    assert matmul.plan_for(*shape, 256, "cuda:2") == matmul.tile_config(*shape)  # never proven there


def test_a_grouped_launch_proven_on_one_gpu_is_proven_again_on_another(two_gpus) -> None:
    matmul, probed = two_gpus
    group = (BF16, 2048, (256, 128, 64))
    matmul.prove_groups([group], torch.device("cuda", 0))
    matmul.prove_groups([group], torch.device("cuda", 1))
    # each device proves the three weights' plans and then the group
    assert [where for where, _ in probed] == ["cuda:0"] * 4 + ["cuda:1"] * 4
    assert matmul._groups_agree[(torch.device("cuda", 0), *group)]
    assert not matmul._groups_agree[(torch.device("cuda", 1), *group)]


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, sms: int, l2: int = 50 * 2**20) -> None:
    """torch.cuda reports an H100 (by name and capability) with `sms` SMs and `l2` bytes of L2."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(multi_processor_count=sms, L2_cache_size=l2))


def test_the_probe_fingerprint_tells_a_gpu_slice_from_the_full_card(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    """A MIG slice (or a cut-down card) reports the full card's name and capability; the fingerprint
    left out its SM count, which cuBLAS's split-K and tile heuristics follow, so the full card's
    cached proof was read back on the slice and its shapes took cuBLASLt unproven."""
    env = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    _fake_gpu(monkeypatch, sms=132)
    full = probe.fingerprint(torch.device("cpu"), env)
    _fake_gpu(monkeypatch, sms=16)
    mig = probe.fingerprint(torch.device("cpu"), env)
    _fake_gpu(monkeypatch, sms=132, l2=10 * 2**20)
    small_l2 = probe.fingerprint(torch.device("cpu"), env)
    assert mig["gpu"] == full["gpu"] and len({str(sorted(f.items())) for f in (full, mig, small_l2)}) == 3
    cache = probe.VerdictCache(tmp_path / "probe.json")
    verdict = probe.Verdict("bfloat16", 16, 32, True, (), len(probe.PROBE_M))
    cache.put(full, verdict, BF16)
    assert cache.get(full, BF16, 16, 32) == verdict and cache.get(mig, BF16, 16, 32) is None


def test_the_probe_fingerprint_follows_the_reduced_precision_reduction_setting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's allow_bf16/fp16_reduced_precision_reduction filter the cuBLASLt kernels a product may take:
    a proof made under one setting says nothing of the other."""
    _fake_gpu(monkeypatch, sms=132)
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_bf16_reduced_precision_reduction
    default = probe.fingerprint(torch.device("cpu"), {})
    try:
        matmul.allow_bf16_reduced_precision_reduction = not before
        assert probe.fingerprint(torch.device("cpu"), {}) != default
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before


@pytest.mark.parametrize(("dtype", "n", "k"), [(BF16, 60, 2048), (torch.float16, 128, 100),
                                               (torch.float32, 6, 64)])
def test_the_route_of_a_weight_triton_cannot_load_is_refused_as_the_run_is(two_gpus, dtype: torch.dtype,
                                                                           n: int, k: int) -> None:
    """A 60-expert bf16 router (120-byte rows) was listed as "triton" while `linear` raises InputError on
    it; where the probe had passed the shape, even as "cublaslt"."""
    matmul, _ = two_gpus
    matmul.prepare({(dtype, n, k)}, torch.device("cuda", 0))
    for has_bias in (False, True):
        path, why = matmul.route(dtype, n, k, has_bias, "cuda:0")
        assert path == "refused" and "InputError" in why and "matmul family off" in why
    with pytest.raises(InputError, match="TMA row alignment"):
        matmul.linear(torch.zeros(1, k, dtype=dtype), torch.zeros(n, k, dtype=dtype))
    # aligned rows still route as before: 60 float32 outputs are 240 bytes
    assert matmul.route(torch.float32, 60, 2048, False, "cuda:0")[0] == "triton"
    assert matmul.route(BF16, 64, 2048, True, "cuda:0")[0] == "triton"


def test_parity_kernels_lists_a_router_triton_cannot_load_as_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """`linear_routes` on CUDA (the load faked: the weights stay on the CPU, no kernel runs): the
    [60, 64] bf16 router row says "refused", the aligned [128, 64] projection "triton"."""
    model = nn.Sequential(nn.Linear(64, 60, bias=False, dtype=BF16),
                          nn.Linear(64, 128, bias=False, dtype=BF16))
    monkeypatch.setattr(matmul_routes.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(matmul_routes, "load_model", lambda *args, **kwargs: SimpleNamespace(model=model))
    rows = {(r.n, r.k): r for r in matmul_routes.linear_routes("stand-in", device="cuda")}
    assert rows[(60, 64)].route == "refused" and "InputError" in rows[(60, 64)].reason
    assert rows[(128, 64)].route == "triton"
