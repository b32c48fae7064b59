"""The MoE experts' grouped products on CUDA at the Qwen3-30B-A3B expert shape (E = 128, H = 2,048,
I = 768, k = 8, random routes): gate/up plus down per plan of `moe._GROUPED_PLAN`'s form, median us
under CUDA-graph replay, and the shipped plan's share of the card's bandwidth over the layer's weights.

    python3 -m benchmarks.gpu_grouped [--tokens 8 256 2048] [--bandwidth-tbs 3.03]
"""

from __future__ import annotations

import argparse

import torch

from parity.models.shaped import SHAPES

_SHAPE = SHAPES["qwen3-30b-a3b"][1]
EXPERTS, HIDDEN, INTER, TOP_K = (_SHAPE[f] for f in ("num_experts", "hidden_size", "moe_intermediate_size",
                                                      "num_experts_per_tok"))
#: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the shipped plan first, then the candidates measured
PLANS = [None, (64, 128, 64, 8, 3), (64, 256, 64, 8, 3), (32, 128, 64, 4, 4), (16, 128, 128, 4, 4)]


def timings(tokens: int, gate_up: torch.Tensor, down: torch.Tensor) -> list[float]:
    """Median us of gate/up + down for each of PLANS at `tokens` tokens' k slots."""
    from triton.testing import do_bench_cudagraph

    from parity.kernels.triton import moe

    g = torch.Generator(device="cuda").manual_seed(tokens)
    flat = torch.rand(tokens, EXPERTS, device="cuda", generator=g).topk(TOP_K, dim=-1).indices.reshape(-1)
    counts = torch.bincount(flat, minlength=EXPERTS)
    offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    x = torch.randn(flat.numel(), HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    a = torch.randn(flat.numel(), INTER, device="cuda", generator=g).to(torch.bfloat16)
    shipped = moe._GROUPED_PLAN[torch.bfloat16]
    out = []
    try:
        for plan in PLANS:
            moe._GROUPED_PLAN[torch.bfloat16] = plan or shipped
            tiles = moe.tile_plan(counts, flat.numel(), torch.bfloat16)

            def both(tiles: tuple[torch.Tensor, torch.Tensor] = tiles) -> None:
                moe.grouped_linear(x, gate_up, offsets, tiles)
                moe.grouped_linear(a, down, offsets, tiles)

            out.append(do_bench_cudagraph(both) * 1e3)
    finally:
        moe._GROUPED_PLAN[torch.bfloat16] = shipped
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 256, 2048])
    parser.add_argument("--bandwidth-tbs", type=float, default=3.03, help="the card's copy bandwidth, TB/s")
    args = parser.parse_args()
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda") * HIDDEN**-0.5).to(torch.bfloat16)
    down = (torch.randn(EXPERTS, HIDDEN, INTER, device="cuda") * INTER**-0.5).to(torch.bfloat16)
    gigabytes = (gate_up.numel() + down.numel()) * 2 / 1e9
    names = ["shipped"] + ["x".join(map(str, p[:3])) + f" w{p[3]} s{p[4]}" for p in PLANS[1:]]
    print(f"{torch.cuda.get_device_name()}, expert weights {gigabytes:.2f} GB a layer")
    print("| tokens | " + " | ".join(f"{n} us" for n in names) + " | shipped share of bandwidth |")
    print("| --- " * (len(names) + 2) + "|")
    for tokens in args.tokens:
        us = timings(tokens, gate_up, down)
        share = gigabytes / (us[0] * 1e-6) / (args.bandwidth_tbs * 1e3)
        print(f"| {tokens} | " + " | ".join(f"{t:.0f}" for t in us) + f" | {share:.0%} |")


if __name__ == "__main__":
    main()
