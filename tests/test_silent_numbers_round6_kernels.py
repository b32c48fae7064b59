"""Round 6, kernel dispatch and reporting: what the switch accepts, what a cached probe verdict may
be, which environment ATen really took, fused ops on a device registered without them, and what
`parity kernels` lists. CPU only; no engine starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from parity import kernels
from parity.cli import main
from parity.core.errors import ConfigError
from parity.engine import matmul_routes
from parity.kernels import cpu, ops, probe, switch

#: ATen picks its CPU kernels once, at its first vector op, from ATEN_CPU_CAPABILITY: picked here,
#: before any test sets the variable, so that none changes this process's kernels.
torch.backends.cpu.get_cpu_capability()


def _boom(*args: object) -> None:
    raise AssertionError("the replacement ran")


@pytest.mark.parametrize(("op", "device"), [("lienar", "cpu"), ("linear", "cpu:0"), ("linear", "CUDA"),
                                            ("linear", "")])
def test_a_replacement_that_would_never_run_is_refused(op: str, device: str) -> None:
    """`replaced` under an op name parity never looks up, or a device type no tensor has, used to
    register quietly: the block then ran the stock CPU kernel while its caller measured 'its' kernel."""
    before = switch.registrations()
    with pytest.raises(ConfigError, match=r"kernels\.register"), switch.replaced("matmul", op, device, _boom):
        pass
    assert switch.registrations() == before
    with pytest.raises(ConfigError, match="callable"):
        switch.register("matmul", "linear", "cpu", None)  # type: ignore[arg-type]
    assert switch.registrations() == before


def test_every_registered_op_is_one_parity_looks_up() -> None:
    assert {(f, o) for f, o, _ in switch.registrations("cpu")} == {
        (f, o) for f, ops_ in switch.OPS.items() for o in ops_}


def test_a_misspelt_family_is_refused_not_served_stock() -> None:
    with switch.native(), pytest.raises(ConfigError, match="unknown family 'matmull'"):
        switch.impl("matmull", "linear", "cpu")
    with switch.native():
        assert switch.impl("matmul", "linear", "cpu") is None  # a known family switched off: stock


def _cache_with(tmp_path: Path, entry: object, n: int = 16, k: int = 32) -> tuple[probe.VerdictCache, dict]:
    cache = probe.VerdictCache(tmp_path / "probe.json")
    fp = {"gpu": "X"}
    key = cache.key(fp, torch.bfloat16, n, k)
    cache.path.write_text(json.dumps({"version": probe.CACHE_VERSION, "verdicts": {key: entry}}))
    return cache, fp


def _entry(**changes: object) -> dict:
    return {"dtype": "bfloat16", "n": 16, "k": 32, "invariant": True, "differing_m": [], "probed_m": 40,
            **changes}


@pytest.mark.parametrize("entry", [
    _entry(invariant="false", differing_m=[3]),  # a truthy string: would route to cuBLASLt
    _entry(n=64, k=64),  # another shape's verdict under this shape's key
    _entry(invariant=True, differing_m=[3]),  # contradicts itself
    _entry(invariant=False),  # "not invariant" with no differing row count
    _entry(differing_m=["3"], invariant=False),
    {"invariant": True},  # fields missing: used to crash with TypeError
    [1, 2],
])
def test_a_cached_entry_that_is_not_exactly_a_verdict_is_probed_again(tmp_path: Path, entry: object) -> None:
    cache, fp = _cache_with(tmp_path, entry)
    assert cache.get(fp, torch.bfloat16, 16, 32) is None


def test_a_sound_cached_verdict_is_read_back_and_odd_files_read_as_empty(tmp_path: Path) -> None:
    cache, fp = _cache_with(tmp_path, _entry(invariant=False, differing_m=[3, 5]))
    assert cache.get(fp, torch.bfloat16, 16, 32) == probe.Verdict("bfloat16", 16, 32, False, (3, 5), 40)
    for text in ("[1, 2]", json.dumps({"version": probe.CACHE_VERSION, "verdicts": [1]})):
        cache.path.write_text(text)  # used to crash with AttributeError
        assert cache.get(fp, torch.bfloat16, 16, 32) is None


@pytest.mark.parametrize("value", ["AVX2", "bogus", " avx2", "sve"])
def test_an_aten_cpu_capability_that_aten_ignored_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                              value: str) -> None:
    """ATen ignores an unknown ATEN_CPU_CAPABILITY (a warning) and runs its own pick: a run meant as
    another host's kernels silently was this host's. Refused where parity loads a CPU model."""
    model = nn.Linear(2, 2, bias=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", value)
    with pytest.raises(ConfigError, match=r"ATEN_CPU_CAPABILITY=.*ATen ignored it and runs its AVX512"):
        cpu.check_capability()
    with pytest.raises(ConfigError, match="ATEN_CPU_CAPABILITY"):
        kernels.prepare(model)


@pytest.mark.parametrize(("value", "running"), [("avx2", "AVX2"), ("avx512", "AVX512"), ("default", "NO AVX"),
                                                ("default", "DEFAULT"), ("", "AVX512")])
def test_an_aten_cpu_capability_that_aten_took_passes(monkeypatch: pytest.MonkeyPatch, value: str,
                                                      running: str) -> None:
    model = nn.Linear(2, 2, bias=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: running)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", value)
    cpu.check_capability()
    kernels.prepare(model)


def test_a_device_registered_without_the_fused_ops_runs_their_pieces() -> None:
    """A device registered (`kernels.register`) with the core ops but not the fused norm+rotary or
    log-softmax+draw: as `ops.linears` does, the caller runs the pieces (each its family's kernel);
    it used to raise BackendUnavailableError naming that very device as one parity has kernels for."""
    q, k = torch.empty(1, 2, 3, 4, device="meta"), torch.empty(1, 2, 1, 4, device="meta")
    cos = sin = torch.empty(1, 2, 4, device="meta")
    with switch.replaced("rmsnorm", "rms_norm", "meta", lambda x, *_: x), \
            switch.invariant(["rmsnorm", "rotary"]):
        q2, k2 = ops.norm_rotary(q, k, nn.Identity(), nn.Identity(), cos, sin, lambda a, b, c, s: (a, b))
    assert q2.shape == (1, 3, 2, 4) and k2.shape == (1, 1, 2, 4)
    logits = torch.empty(2, 5, device="meta")
    state = torch.empty(2, dtype=torch.int64, device="meta")
    noisy = torch.empty(2, dtype=torch.bool, device="meta")
    with switch.replaced("softmax", "log_softmax", "meta", lambda x: x), \
            switch.replaced("pointwise", "gumbel_argmax", "meta", lambda s, *_: s.argmax(-1)), \
            switch.invariant(["softmax", "pointwise"]):
        tokens, logprobs = ops.log_softmax_draw(logits, state, noisy)
    assert tokens.shape == logprobs.shape == (2,)


def test_parity_kernels_lists_the_routers_products() -> None:
    """A MoE router's scores run through the invariant linear (`routing.route`) but were not listed:
    tiny-mixtral's [8, 128] router had no row."""
    rows = matmul_routes.linear_routes("tiny-mixtral", dtype="bfloat16", device="cpu")
    router = [r for r in rows if (r.n, r.k, r.has_bias) == (8, 128, False)]
    assert len(router) == 1 and router[0].count == 2 and router[0].dtype == "bfloat16"
    # a sigmoid router scores in float32 on float32 copies (`routing.route`): that is its product
    sigmoid = type("DeepseekV3TopkRouter", (nn.Module,), {})()
    sigmoid.weight = nn.Parameter(torch.ones(4, 6, dtype=torch.bfloat16))
    (weight, bias), = matmul_routes._products(nn.Sequential(sigmoid))
    assert weight.dtype == torch.float32 and weight.shape == (4, 6) and bias is None


def test_parity_kernels_tells_a_biased_shape_from_a_bias_free_one(capsys: pytest.CaptureFixture[str]) -> None:
    """tiny-qwen2's q_proj (bias) and o_proj (none) are both 128 x 128: two rows that read alike."""
    assert main(["kernels", "--model", "tiny-qwen2", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    shapes = [line.split("bfloat16")[0].split(None, 1)[1].strip() for line in lines[1:]]
    assert "128 x 128" in shapes and "128 x 128 + bias" in shapes
    assert len(set(shapes)) == len(shapes)
    starts = {line.index("why") if i == 0 else len(line) - len(line.split("  ")[-1])
              for i, line in enumerate(lines)}
    assert len(starts) == 1  # the why column lines up whatever the route's name
