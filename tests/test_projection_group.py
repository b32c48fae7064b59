"""q/k/v of one attention as one group: the first projection hands all three weights of its input to
the device's grouped op (`ops.linears`, one launch on CUDA), the other two take its outputs, and the
logprobs are those of three separate products. CPU has no grouped launch; a stand-in shows the wiring."""

import numpy as np
import torch

from parity.engine.train import train_forward
from parity.kernels import cpu
from parity.kernels.switch import replaced

PAIRS = [((1, 5, 9), (11, 4, 7)), ((2, 3), (8, 8, 1, 6))]


def _logprobs() -> list[np.ndarray]:
    return [np.asarray(lp) for lp in train_forward("tiny-qwen3", PAIRS, dtype="bfloat16").logprobs]


def test_the_group_runs_once_per_layer_and_keeps_the_logprobs() -> None:
    plain = _logprobs()
    calls: list[int] = []

    def grouped(x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        calls.append(len(weights))
        return [cpu.linear(x, w) for w in weights]

    with replaced("matmul", "linears", "cpu", grouped):
        got = _logprobs()
    assert calls and set(calls) == {3}
    assert all(np.array_equal(a, b) for a, b in zip(got, plain, strict=True))


def test_negative_control_k_and_v_take_the_groups_outputs() -> None:
    """A grouped op whose v output is off changes the logprobs: v_proj used the group's output."""
    plain = _logprobs()

    def v_off(x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        q, k, v = (cpu.linear(x, w) for w in weights)
        return [q, k, v * 2]

    with replaced("matmul", "linears", "cpu", v_off):
        assert not all(np.array_equal(a, b) for a, b in zip(_logprobs(), plain, strict=True))


def test_a_device_without_a_grouped_launch_takes_linear_per_weight(monkeypatch) -> None:
    """A device registered for "linear" alone (`kernels.register`): `ops.linears` declines, and the
    model runs its three products one by one with the same logprobs."""
    from parity.kernels import ops, switch

    plain = _logprobs()
    monkeypatch.delitem(switch._registry, ("matmul", "linears", "cpu"))
    x, w = torch.ones(2, 4), torch.ones(3, 4)
    assert ops.linears(x, (w, w, w)) is None
    assert all(np.array_equal(a, b) for a, b in zip(_logprobs(), plain, strict=True))
