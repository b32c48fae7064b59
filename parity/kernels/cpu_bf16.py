"""bf16 GEMM tiles on AMX or AVX-512 BF16, each weight shape proven row-invariant before it is used.

On a CPU with AMX tiles or AVX-512 BF16 dot products, oneDNN multiplies bf16 exactly and sums in
float32, ~4x (AMX) or 2.2-3.5x (AVX-512 BF16, one thread, docs/PERF.md) the float32 tiles of
`cpu_gemm` on the same core (two kernels: the report names which ran). Row-invariance comes from
the same idea as there: every product is one fixed shape, [TILE, K] x packed [K, N], so the batch
does not change a row's bits. That a fixed shape is enough is not assumed but proven, once per (weight shape,
bias), on the weight itself: rows moved to other places of the tile and neighbours replaced must
give the same bits, on wide-valued tiles and on tiles whose rows cancel exactly (the result is
then the summation order's rounding alone: `row_invariant`); a shape that fails takes the float32
tiles. oneDNN splits some products over threads by K, which would make the bits follow the
thread count: a shape runs on the process's threads only once `threads_agree` has shown, for that
thread count, the same bits as on one thread; else each of its products runs on one thread.
`PARITY_CPU_BF16_GEMM=float32` turns this path off.
"""

from __future__ import annotations

import functools
import os

import torch
from torch.utils.weak import WeakIdKeyDictionary

from parity.core.errors import ConfigError
from parity.kernels.cpu_gemm import TILE, per_version
from parity.kernels.probe import cancelling_rows

#: the environment variable that picks the bf16 GEMM: "bf16" (the default: oneDNN's bf16 products
#: where the CPU has them; "amx", its first spelling, means the same) or "float32".
CHOICE_ENV = "PARITY_CPU_BF16_GEMM"

#: weight -> ((version, data pointer), weight packed for oneDNN's bf16 kernel).
_packed: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: (K, N, bias present) -> whether the shape passed `row_invariant`.
_proven: dict[tuple[int, int, bool], bool] = {}
#: (K, N, bias present, threads) -> whether the shape passed `threads_agree` at that thread count.
_thread_free: dict[tuple[int, int, bool, int], bool] = {}
#: weight -> ((version, data pointer, bias dtype, CHOICE_ENV's value), packed weight or None where
#: `usable` said no): `linear`'s one look-up per call.
_routes: WeakIdKeyDictionary = WeakIdKeyDictionary()


#: each bf16 hardware (`bf16_hardware`): its route label, and its words in `route`'s reason
HARDWARE = {"amx": ("amx-bf16", "AMX tiles"), "avx512-bf16": ("avx512-bf16", "AVX-512 BF16 products")}


@functools.cache
def bf16_hardware() -> str | None:
    """"amx" (AMX tiles; this process asks Linux for them once) or "avx512-bf16" (AVX-512 BF16 dot
    products): oneDNN's bf16 products on this CPU; None where it has neither (oneDNN would emulate)."""
    if not torch.backends.mkldnn.is_available():
        return None
    if torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx():
        return "amx"
    return "avx512-bf16" if torch.cpu._is_avx512_bf16_supported() else None


def choice() -> str:
    """The bf16 GEMM this process uses on CPU: "amx", "avx512-bf16" or "float32" (`CHOICE_ENV`, else
    the CPU's bf16 hardware where it has some)."""
    wanted = os.environ.get(CHOICE_ENV, "").strip().lower()
    if wanted not in ("", "bf16", "amx", "float32"):
        raise ConfigError(f"{CHOICE_ENV}={wanted!r}: set it to 'bf16' (oneDNN's bf16 products where the CPU "
                          "has AMX or AVX-512 BF16; 'amx' means the same) or 'float32' (float32 tiles "
                          "everywhere), or unset it")
    hardware = bf16_hardware()
    return hardware if wanted != "float32" and hardware is not None else "float32"


def _product(tile: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
             threads: int = 1) -> torch.Tensor:
    """One oneDNN product tile [TILE, K] x packed [K, N] (+ bias) -> [TILE, N] bf16: float32 sums
    (bias included), rounded once, on `threads` threads."""
    before = torch.get_num_threads()
    if before == threads:
        return torch.ops.mkldnn._linear_pointwise(tile, packed, bias, "none", [], "")
    # oneDNN splits some products over threads by K (on the AMX host [32, 4096] x [4096, 8] differs
    # between one and two threads): a shape not proven free of that runs on one thread. A fixed
    # team of two instead oversubscribes a process given one core (a Ray worker, a TP rank, a test
    # worker beside another): tests/test_engine.py and 18 other modules took 245 s instead of 75 s.
    torch.set_num_threads(threads)
    try:
        return torch.ops.mkldnn._linear_pointwise(tile, packed, bias, "none", [], "")
    finally:
        torch.set_num_threads(before)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight in oneDNN's blocked layout for TILE-row products, cached per weight version."""
    reorder = torch.ops.mkldnn._reorder_linear_weight
    return per_version(_packed, weight, lambda: reorder(weight.detach().contiguous(), TILE))


def _tile(seed: int, k: int) -> torch.Tensor:
    """A seeded bf16 [TILE, k] tile whose values spread over 2^-12 .. 2^12, so that a sum taken in
    another order rounds differently in many places."""
    gen = torch.Generator().manual_seed(seed)
    spread = torch.exp2(torch.randint(-12, 13, (TILE, k), generator=gen).to(torch.float32))
    return (torch.randn(TILE, k, generator=gen) * spread).to(torch.bfloat16)


def threads_agree(weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, threads: int,
                  product=_product) -> bool:
    """Whether `product` on `threads` threads gives the same bits as on one for two cancelling
    tiles (`probe.cancelling_rows`): a product split by K differs there in nearly every row. A bias
    is replaced by zeros (the same primitive), which would otherwise round the residue away."""
    bias = None if bias is None else torch.zeros_like(bias)
    for seed in (0, 1):
        tile = cancelling_rows(weight, TILE, seed)
        if not torch.equal(product(tile, packed, bias, threads), product(tile, packed, bias, 1)):
            return False
    return True


def _threads(weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> int:
    """The threads this weight's products run on: the process's count where `threads_agree`
    proved it for the shape, else one."""
    threads = torch.get_num_threads()
    if threads == 1:
        return 1
    n, k = weight.shape
    key = (k, n, bias is not None, threads)
    if key not in _thread_free:
        torch.set_num_threads(1)
        settable = torch.get_num_threads() == 1
        torch.set_num_threads(threads)
        if not settable:  # an in-process vLLM-CPU engine makes set_num_threads a no-op: nothing to prove
            return 1
        _thread_free[key] = threads_agree(weight, packed, bias, threads)
    return threads if _thread_free[key] else 1


def _moves_agree(a: torch.Tensor, other: torch.Tensor, run) -> bool:
    """Whether `run` gives tile a's rows the same bits reversed, rolled by one and by half a tile,
    with the other half replaced by `other`'s, and alone among zeros."""
    base = run(a)
    places = torch.arange(TILE)
    for order in (places.flip(0), places.roll(1), places.roll(TILE // 2)):
        if not torch.equal(run(a[order].contiguous()), base[order]):
            return False
    half = a.clone()
    half[TILE // 2:] = other[TILE // 2:]
    if not torch.equal(run(half)[:TILE // 2], base[:TILE // 2]):
        return False
    alone = torch.zeros_like(a)
    alone[TILE - 1] = a[0]
    return torch.equal(run(alone)[TILE - 1], base[0])


def row_invariant(weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  product=_product) -> bool:
    """Whether `product` gives every row of a [TILE, K] tile the same bits wherever it sits in the
    tile and whatever its neighbours hold (`_moves_agree`), on wide-valued tiles with the bias and
    on cancelling tiles (`probe.cancelling_rows`, zeros for the bias), where any change of summation
    order shows."""
    k = weight.shape[1]
    zeros = None if bias is None else torch.zeros_like(bias)
    return (_moves_agree(_tile(k, k), _tile(k + 1, k), lambda a: product(a, packed, bias))
            and _moves_agree(cancelling_rows(weight, TILE, 0), cancelling_rows(weight, TILE, 1),
                             lambda a: product(a, packed, zeros)))


def _bf16(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return weight.dtype == torch.bfloat16 and (bias is None or bias.dtype == torch.bfloat16)


def usable(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether x @ weight.T (+ bias) in bf16 runs on the proven bf16 tiles."""
    if not _bf16(weight, bias) or weight.device.type != "cpu" or choice() == "float32":
        return False
    n, k = weight.shape
    key = (k, n, bias is not None)
    if key not in _proven:
        try:
            packed = _pack(weight)
            _proven[key] = row_invariant(weight, packed, bias)
        except RuntimeError:  # a shape oneDNN will not pack or multiply: the float32 tiles take it
            _proven[key] = False
    return _proven[key]


def route(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[str, str]:
    """(route, why) of the CPU invariant linear for this weight: "amx-bf16", "avx512-bf16" or
    "float32" tiles."""
    if usable(weight, bias):
        label, words = HARDWARE[choice()]
        return label, f"oneDNN {words} of [{TILE}, K], proven row-invariant"
    if not _bf16(weight, bias):
        why = f"{str(weight.dtype).removeprefix('torch.')} weight"
    elif choice() == "float32":
        why = f"{CHOICE_ENV}=float32" if bf16_hardware() else "no AMX or AVX-512 BF16 on this CPU"
    else:
        why = "this shape failed the row-invariance proof"
    return "float32", f"fixed float32 [{TILE}, K] tiles ({why})"


def matmul(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """rows [M, K] bf16 @ weight [N, K].T (+ bias) -> [M, N] bf16, one [TILE, K] product per TILE rows
    (zero-padded); call only where `usable(weight, bias)`."""
    m, k = rows.shape
    packed = _pack(weight)
    tiles = -(-m // TILE)
    padded = rows
    if m % TILE or not rows.is_contiguous() or rows.data_ptr() % 64:
        padded = rows.new_zeros(tiles * TILE, k)
        padded[:m] = rows
    threads = _threads(weight, packed, bias)
    if tiles == 1:
        out = _product(padded, packed, bias, threads)
    else:
        out = torch.cat([_product(tile, packed, bias, threads) for tile in padded.split(TILE)])
    return out if tiles * TILE == m else out[:m]


def _route_key(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """What `linear`'s route for a weight depends on: its version and storage, the bias's dtype, the
    choice's environment variable."""
    bias_dtype = None if bias is None else bias.dtype
    return weight._version, weight.data_ptr(), bias_dtype, os.environ.get(CHOICE_ENV)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., K] bf16 @ weight [N, K].T (+ bias) -> [..., N] as `matmul`, or None where the bf16 tiles do
    not serve (`usable`); a whole contiguous tile of rows goes to its one product as it is."""
    key = _route_key(weight, bias)
    route = _routes.get(weight)
    if route is None or route[0] != key:
        route = (key, _pack(weight) if usable(weight, bias) else None)
        _routes[weight] = route
    packed = route[1]
    if packed is None:
        return None
    if x.numel() == TILE * x.shape[-1] and x.is_contiguous() and x.data_ptr() % 64 == 0:
        return _product(x, packed, bias, _threads(weight, packed, bias))
    return matmul(x.reshape(-1, x.shape[-1]), weight, bias).reshape(*x.shape[:-1], weight.shape[0])
