"""Load-time proof that a vendor matmul is row-invariant for one weight shape, cached on disk.

cuBLASLt without split-K is 2-3x faster than the Triton kernel at decode sizes but invariant only
as observed. `probe_rows` requires `linear(x[a:a+m]) == linear(x)[a:a+m]` bit for bit for every m
in PROBE_M and offset in PROBE_OFFSETS, on `cancelling_rows` (a result there is the rounding of
its summation order); verdicts are cached by `fingerprint()` (GPU and its SMs, driver, CUDA,
cuBLASLt, torch, workspace), so any upgrade or other card re-probes.

Why a finite probe is trusted: with no workspace no split-K algorithm can be chosen, so what
changes with M is the kernel, a step function of M at tile multiples; PROBE_M covers both sides
of every power of two to 8192 (the engine's token budget) and PROBE_OFFSETS the alignments.
Unprobed, failed or biased shapes take the Triton kernel.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

#: rows probed: every power of two 1..8192 and its neighbours, plus sizes between (the engine's
#: decode batches, prefill chunks and token budgets all fall in these classes). To 8192, the engine's
#: default step budget: a step of 8192 tokens split at 4096 rows ran ~5% slower end to end (H100).
PROBE_M: tuple[int, ...] = tuple(sorted(
    {1, 3, 5, 6, 7, 100, 200, 300, 384, 640, 1000, 1536, 3000}
    | {v for p in range(1, 14) for v in (2**p - 1, 2**p, 2**p + 1) if v <= 8192}))
#: row offsets into the probe input (slices start at other pointer alignments).
PROBE_OFFSETS: tuple[int, ...] = (0, 1, 8)
#: the largest M the probe covers; steps above it are not proven.
PROBE_MAX_M = max(PROBE_M)
#: 3: rows to 8192 (2: to 4096, on cancelling rows; 1 was on random rows, which hide most order changes).
CACHE_VERSION = 3


@dataclass(frozen=True)
class Verdict:
    """The probe's result for one (dtype, N, K): row-invariant or the first rows counts that differ."""

    dtype: str
    n: int
    k: int
    invariant: bool
    differing_m: tuple[int, ...]
    probed_m: int

    def reason(self) -> str:
        if self.invariant:
            return f"probed row-invariant at {self.probed_m} row counts 1..{PROBE_MAX_M}"
        return f"probe found rows that differ at M={list(self.differing_m)[:6]}"


def cancelling_rows(weight: torch.Tensor, rows: int, seed: int) -> torch.Tensor:
    """[rows, K] in weight's dtype whose row r sums to exactly zero against weight row (7919 r +
    seed) mod N: pairs (i, j) hold x_i = w_j 2^e and x_j = -w_i 2^e, whose products are equal and
    opposite however they round. The result there is the rounding of the summation order alone, so
    any other order (another kernel, a split of K) changes it, where random data, rounded to 16
    bits at the end, hides most such changes."""
    n, k = weight.shape
    device = weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    columns = weight.detach()[(torch.arange(rows, device=device) * 7919 + seed) % n].float()
    order = torch.rand(rows, k - k % 2, generator=gen, device=device).argsort(dim=1)
    i, j = order[:, :k // 2], order[:, k // 2:]
    top = 17 if weight.dtype == torch.bfloat16 else 9  # fp16 tops out at 65504
    scale = torch.exp2(torch.randint(0, top, (rows, k // 2), generator=gen, device=device).to(torch.float32))
    x = torch.zeros(rows, k, device=device)
    x.scatter_(1, i, columns.gather(1, j) * scale)
    x.scatter_(1, j, -columns.gather(1, i) * scale)
    return x.to(weight.dtype)


def probe_rows(linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], dtype: torch.dtype, n: int,
               k: int, device: str | torch.device, *, seed: int = 0, max_m: int = PROBE_MAX_M) -> Verdict:
    """Whether linear(x[a:a+m], w) == linear(x, w)[a:a+m] bitwise for every m <= `max_m` in PROBE_M, a
    in PROBE_OFFSETS; w [n, k] random in `dtype` on `device`, x [max_m + max offset, k] its
    `cancelling_rows`."""
    g = torch.Generator(device=device).manual_seed(seed + 7 * n + k)
    rows = max_m + max(PROBE_OFFSETS)
    w = (torch.randn(n, k, generator=g, device=device) * k**-0.5).to(dtype)
    x = cancelling_rows(w, rows, seed)
    full = linear(x, w)
    ms = [m for m in PROBE_M if m <= max_m]
    differing = sorted({m for m in ms for a in PROBE_OFFSETS
                        if not torch.equal(linear(x[a:a + m], w), full[a:a + m])})
    return Verdict(dtype=str(dtype).removeprefix("torch."), n=n, k=k, invariant=not differing,
                   differing_m=tuple(differing), probed_m=len(ms))


def _cuda_driver_version() -> str:
    try:
        version = ctypes.c_int()
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
        return str(version.value)
    except (OSError, AttributeError):
        return "unknown"


def _cublaslt_version() -> str:
    """The version of the libcublasLt this process has loaded (read from the library itself)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    paths = sorted(set(re.findall(r"(/\S*libcublasLt\.so\S*)", maps)))
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
            lib.cublasLtGetVersion.restype = ctypes.c_size_t
            return f"{lib.cublasLtGetVersion()} ({Path(path).name})"
        except (OSError, AttributeError):
            continue
    return "unknown"


def fingerprint(device: torch.device, env: dict[str, str]) -> dict[str, str]:
    """What a verdict depends on besides the shape: the GPU, the inputs of cuBLASLt's kernel choice
    that one GPU name does not fix (SMs and L2 of a MIG slice or cut-down card: split-K and tile
    heuristics follow them; torch's reduced-precision reduction settings, which filter the kernels
    it may pick), its driver, the CUDA runtime, the cuBLASLt build, torch, and the workspace settings
    `env` names (read from this process). A key added here makes older cached entries miss: re-probed."""
    one = torch.zeros(16, 16, device=device, dtype=torch.bfloat16)
    one @ one  # loads cuBLAS/cuBLASLt, so their versions can be read
    props = torch.cuda.get_device_properties(device)
    matmul = torch.backends.cuda.matmul
    return {
        "gpu": torch.cuda.get_device_name(device),
        "capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
        "sms": str(props.multi_processor_count),
        "l2_cache": str(getattr(props, "L2_cache_size", "unknown")),
        "reduced_precision_reduction": f"bf16={matmul.allow_bf16_reduced_precision_reduction} "
                                       f"fp16={matmul.allow_fp16_reduced_precision_reduction}",
        "driver": _cuda_driver_version(),
        "cuda": str(torch.version.cuda),
        "cublaslt": _cublaslt_version(),
        "torch": torch.__version__,
        **{key: os.environ.get(key, "") for key in sorted(env)},
    }


def cache_path() -> Path:
    """`$PARITY_CACHE/kernels/matmul-probe.json`, else under `~/.cache/parity`."""
    root = os.environ.get("PARITY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "parity")
    return Path(root) / "kernels" / "matmul-probe.json"


class VerdictCache:
    """Verdicts by (fingerprint, dtype, N, K) in one JSON file; written atomically (rename), so
    concurrent processes at worst probe a shape twice."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def _read(self) -> dict[str, dict]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            return {}
        verdicts = data.get("verdicts")
        return verdicts if isinstance(verdicts, dict) else {}

    @staticmethod
    def key(fp: dict[str, str], dtype: torch.dtype, n: int, k: int) -> str:
        return json.dumps([fp, str(dtype).removeprefix("torch."), n, k], sort_keys=True)

    def get(self, fp: dict[str, str], dtype: torch.dtype, n: int, k: int) -> Verdict | None:
        entry = self._read().get(self.key(fp, dtype, n, k))
        return _stored_verdict(entry, n, k)

    def put(self, fp: dict[str, str], verdict: Verdict, dtype: torch.dtype) -> None:
        with self._lock:
            verdicts = self._read()
            verdicts[self.key(fp, dtype, verdict.n, verdict.k)] = asdict(verdict)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"version": CACHE_VERSION, "verdicts": verdicts}, indent=1))
            tmp.replace(self.path)


def _stored_verdict(entry: object, n: int, k: int) -> Verdict | None:
    """A cached entry as the Verdict `probe_rows` gave for weight [n, k] (its dtype is the entry's
    key), or None (probe again) where it is not exactly one: other fields or types (a string "false"
    would pass as invariant), another shape, or `invariant` contradicting `differing_m`."""
    if not isinstance(entry, dict) or set(entry) != {f.name for f in fields(Verdict)}:
        return None
    differing = entry["differing_m"]
    if not (isinstance(entry["invariant"], bool) and isinstance(differing, list)
            and all(type(m) is int for m in differing) and type(entry["probed_m"]) is int):
        return None
    if not isinstance(entry["dtype"], str) or (entry["n"], entry["k"]) != (n, k) \
            or entry["invariant"] == bool(differing):
        return None
    return Verdict(**{**entry, "differing_m": tuple(differing)})
