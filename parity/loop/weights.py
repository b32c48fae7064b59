"""Which weights the loop trains, and how they reach a backend: decided here and nowhere else.

`trained_weights(lm)`: `FullWeights` (every parameter, pushed by HF name) or `AdapterWeights`.
A half-precision model trains float32 masters (FSDP/Megatron's recipe) rounded into the model,
so small updates do not vanish below the ulp; the rounded weights are what runs and is pushed.
"""

from __future__ import annotations

import torch

from parity.backends import Backend
from parity.models.loading import LoadedModel


class FullWeights:
    """Every parameter of the training model, trained (float32 masters for half precision) and pushed
    as `(name, tensor)` in the model's dtype.
    """

    def __init__(self, lm: LoadedModel) -> None:
        self.lm = lm
        self._named = list(lm.model.named_parameters())
        for _, p in self._named:
            p.requires_grad_(True)
        half = lm.torch_dtype != torch.float32
        self._masters = ([torch.nn.Parameter(p.detach().to(torch.float32)) for _, p in self._named]
                         if half else None)

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._masters or [p for _, p in self._named]

    def gradients_to_masters(self) -> None:
        """After backward: the model's gradients become the masters' (float32)."""
        if self._masters is None:
            return
        for master, (_, p) in zip(self._masters, self._named):
            master.grad = None if p.grad is None else p.grad.to(torch.float32)

    def masters_to_model(self) -> None:
        """After the optimizer step: the model takes its masters' values, rounded to its dtype."""
        if self._masters is None:
            return
        with torch.no_grad():
            for master, (_, p) in zip(self._masters, self._named):
                p.copy_(master)

    def zero_grad(self) -> None:
        for _, p in self._named:
            p.grad = None
        for master in self._masters or ():
            master.grad = None

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, p.detach()) for name, p in self._named]

    def push(self, backend: Backend) -> None:
        """Send the trained weights to `backend` through its weight update."""
        backend.update_weights(self.named_tensors())

    def expected_checksums(self, backend: Backend) -> dict[str, str]:
        """The checksums `backend.weight_checksums()` must report once a push has landed."""
        return backend.expected_checksums(self.named_tensors())

    def stale_adapter(self, backend: Backend) -> str | None:
        """What a backend applies in place of the trained adapter: nothing to check here (no adapter)."""
        return None

    def describe(self) -> dict[str, object]:
        """What the record says about a push beyond the update's statistics: nothing more."""
        return {}


def trained_weights(lm: LoadedModel) -> FullWeights:
    """The weights the loop trains and pushes for the training model `lm` (every parameter)."""
    return FullWeights(lm)
