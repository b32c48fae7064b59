"""Validation of what users hand the engine and the training forward, and the kernel-mode switch."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager

import torch

from parity import kernels as _kernels
from parity.core.errors import ConfigError, InputError
from parity.models.loading import LoadedModel

#: "invariant" (every family), "native" (none) or the families to switch on.
KernelMode = str | Iterable[str]


def kernel_families(mode: KernelMode) -> frozenset[str]:
    """The kernel families a `kernels=` argument switches on."""
    if mode == "invariant":
        return frozenset(_kernels.FAMILIES)
    if mode == "native":
        return frozenset()
    wrong = ConfigError(f"kernels must be 'invariant', 'native' or a collection of families "
                        f"{list(_kernels.FAMILIES)}, got {mode!r}")
    if isinstance(mode, str) or not isinstance(mode, Iterable):
        raise wrong
    try:
        families = frozenset(mode)
    except TypeError:  # an unhashable element (a list or dict among the names)
        raise wrong from None
    unknown = sorted(families - set(_kernels.FAMILIES), key=repr)
    if unknown:
        raise ConfigError(f"kernels: unknown families {unknown}; choose from {list(_kernels.FAMILIES)}")
    return families


def kernel_scope(mode: KernelMode) -> AbstractContextManager[frozenset[str]]:
    """The switch state for a `kernels=` argument, restored on exit."""
    return _kernels.invariant(families=kernel_families(mode))


def kernel_label(mode: KernelMode) -> str:
    """How a `kernels=` argument is recorded in rollout metadata."""
    return mode if isinstance(mode, str) else ",".join(sorted(kernel_families(mode)))


def check_token_ids(ids: Sequence[int], lm: LoadedModel, where: str) -> None:
    """Every id must index the model's vocabulary."""
    bad = [t for t in ids if not 0 <= t < lm.vocab_size]
    if bad:
        raise InputError(f"{where}: token id {bad[0]} is outside the vocabulary [0, {lm.vocab_size}) of "
                         f"{lm.name}; tokenize with the model's own tokenizer")


def check_length(length: int, lm: LoadedModel, where: str) -> None:
    """A sequence must fit the model's context (max_position_embeddings)."""
    if length > lm.max_len:
        raise InputError(f"{where}: {length} tokens exceed the context of {lm.name} "
                         f"({lm.max_len} positions); "
                         f"shorten the prompt or lower max_tokens")


def check_positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def device_tensor(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list as a tensor on `device` without a host sync (`to_device`)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device` without a host sync: staged through pinned memory, so the copy is
    asynchronous (a pageable copy waits for every queued kernel); itself on CPU."""
    if torch.device(device).type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
