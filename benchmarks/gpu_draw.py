"""The sampler's passes over [N, V] logits on CUDA: the two ops (the bf16 logits cast to float32,
log-softmax, the Gumbel draw) against `log_softmax_draw` (one stats pass, the draw forming log-probs
in registers), median us under CUDA-graph replay, tokens and log-probs compared bit for bit.

    python3 -m benchmarks.gpu_draw [--vocab 151936] [--rows 1 64 256]
"""

from __future__ import annotations

import argparse

import torch


def row(n: int, vocab: int) -> str:
    """One table row: n rows of random bf16 logits, both paths timed and compared."""
    from triton.testing import do_bench_cudagraph

    from parity.kernels.sampling import log_softmax_then_draw
    from parity.kernels.triton import sampling, softmax

    g = torch.Generator(device="cuda").manual_seed(n)
    logits = (torch.randn(n, vocab, device="cuda", generator=g) * 3).to(torch.bfloat16)
    state = torch.randint(0, 2**32, (n,), device="cuda", generator=g)
    noisy = torch.ones(n, dtype=torch.bool, device="cuda")

    def two_ops() -> tuple[torch.Tensor, torch.Tensor]:
        return log_softmax_then_draw(logits, state, noisy, softmax.log_softmax, sampling.gumbel_argmax)

    def fused() -> tuple[torch.Tensor, torch.Tensor]:
        return sampling.log_softmax_draw(logits, state, noisy)

    (t2, l2), (tf, lf) = two_ops(), fused()
    us = [do_bench_cudagraph(fn) * 1e3 for fn in (two_ops, fused, lambda: softmax.row_stats(logits))]
    return (f"| {n} | {us[0]:.1f} | {us[1]:.1f} | {us[0] / us[1]:.2f} | {us[2]:.1f} | {torch.equal(t2, tf)} "
            f"| {torch.equal(l2, lf)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, logits [N, {args.vocab}] bf16")
    print("| rows | two ops us | fused us | two / fused | row stats us | same tokens | same log-probs |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n in args.rows:
        print(row(n, args.vocab))


if __name__ == "__main__":
    main()
