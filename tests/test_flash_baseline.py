"""The stock CUDA attention (flash over the cache, the honest native baseline b') on a GPU: the same
attention as gathered SDPA for prefill, chunked prefill, decode and padded steps, captured by CUDA
graphs, and the engine's native rows on it. It makes no invariance claim, so outputs are compared
within bf16 tolerance, not bit for bit."""

from __future__ import annotations

import pytest
import torch

from parity.core.types import Request, SamplingParams
from parity.engine import ReferenceEngine
from parity.kernels import attention
from parity.kernels.attention import flash_over_cache, gathered_sdpa
from parity.models.shaped import save_random_model, shaped_config

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (CUDA not available)")]


def _step(runs: list[tuple[int, int, int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots and positions of runs (slot, first position, tokens), then `pad` pad tokens in slot 7."""
    slots = [s for s, _, n in runs for _ in range(n)] + [7] * pad
    positions = [p + i for _, p, n in runs for i in range(n)] + [0] * pad
    return torch.tensor(slots, device="cuda"), torch.tensor(positions, device="cuda")


@pytest.mark.parametrize("runs,pad", [([(s, 0, 200) for s in range(4)], 0),  # whole prefill
                                      ([(0, 100, 100), (3, 199, 1), (5, 37, 1)], 0),  # chunk + decode
                                      ([(s, 150 + s, 1) for s in range(7)], 9),  # decode, padded
                                      ([(2, 0, 1), (6, 63, 65)], 3)])
def test_flash_over_the_cache_is_stock_attention(runs, pad):
    g = torch.Generator("cuda").manual_seed(5)
    k, v = (torch.randn(8, 4, 256, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    slots, positions = _step(runs, pad)
    q = torch.randn(slots.shape[0], 16, 128, device="cuda", generator=g).to(torch.bfloat16)
    longest = max(n for _, _, n in runs)
    got = flash_over_cache(q, k, v, slots, positions, longest, 0.088)
    want = gathered_sdpa(q, k, v, slots, positions, 256, 0.088)
    real = slots.shape[0] - pad
    torch.testing.assert_close(got[:real], want[:real], rtol=2e-2, atol=2e-2)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        flash_over_cache(q, k, v, slots, positions, longest, 0.088)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flash_over_cache(q, k, v, slots, positions, longest, 0.088)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured[:real], got[:real], rtol=2e-2, atol=2e-2)


def test_a_step_past_one_launch_runs_in_slices_that_cut_runs(monkeypatch):
    """More tokens than one flash launch takes: slices of 150 tokens cut the 200-token runs, and each
    piece still sees its own causal keys."""
    monkeypatch.setattr(attention, "MAX_FLASH_ENTRIES", 150)
    g = torch.Generator("cuda").manual_seed(6)
    k, v = (torch.randn(8, 4, 256, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    slots, positions = _step([(s, 0, 200) for s in range(4)], 0)
    q = torch.randn(slots.shape[0], 16, 128, device="cuda", generator=g).to(torch.bfloat16)
    got = flash_over_cache(q, k, v, slots, positions, 200, 0.088)
    want = gathered_sdpa(q, k, v, slots, positions, 256, 0.088)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_native_engine_rows_run_on_flash_with_and_without_graphs(tmp_path):
    """The engine's native kernels on CUDA (b'): graphs on and off sample from the same model; the
    teacher-forced logprobs of the rollouts stay close to the rollouts' own."""
    path = save_random_model(shaped_config("qwen3-1024", 2, vocab_size=32000), tmp_path / "m")
    requests = [Request(tuple(range(3, 3 + n)), SamplingParams(n=2, max_tokens=24, seed=n, temperature=0.0),
                        request_id=str(n)) for n in (5, 40, 130, 300)]
    for graphs in (True, False):
        engine = ReferenceEngine(str(path), dtype="bfloat16", device="cuda", kernels="native", max_num_seqs=4,
                                 chunk_size=64, graphs=graphs)
        rollouts = engine.generate(requests)
        assert rollouts[0].meta["step_graphs"] == ("cuda graphs" if graphs else "off")
        scored = engine.score(rollouts)
        for rollout, logprobs in zip(rollouts, scored):
            assert (torch.tensor(rollout.logprobs) - logprobs).abs().max() < 0.1
