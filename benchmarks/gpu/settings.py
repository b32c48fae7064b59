"""Settings a measurement changes, restored when it ends, failed or not: the preferred BLAS library
and module constants (the attention kernel's tiles). A registered kernel is swapped with
`parity.kernels.switch.replaced`, which restores it the same way."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch


@contextmanager
def blas_library(name: str) -> Iterator[None]:
    """torch's preferred BLAS library set to `name` inside the block, the previous one restored."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


@contextmanager
def module_constants(module: ModuleType, **values: Any) -> Iterator[None]:
    """Module-level constants set to `values` inside the block, the previous values restored."""
    before = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(module, name, value)
