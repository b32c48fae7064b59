"""Strict checks of names users give: a mapping into a frozen dataclass (an unknown key is a
`ConfigError` listing the known ones, never a `TypeError` from `__init__`) and a value from a
fixed set of choices (a dtype, a logprobs mode), and token ids (integers, never rounded or parsed).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from parity.core.errors import ConfigError, InputError
from parity.core.schema import DTYPES

T = TypeVar("T")


def _known(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def _check_keys(cls: type, keys: Any, where: str, what: str) -> None:
    known = _known(cls)
    unknown = sorted(map(str, set(keys) - set(known)))
    if unknown:
        raise ConfigError(f"{where}: unknown {what}(s) {unknown}; the {what}s are {sorted(known)}")


def from_mapping(cls: type[T], d: Any, *, where: str, what: str = "field") -> T:
    """`cls(**d)` for a mapping `d` of `cls`'s fields."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{where} must be a table of {cls.__name__} {what}s, got {type(d).__name__}")
    _check_keys(cls, d, where, what)
    return cls(**d)


def replace_fields(obj: T, changes: Mapping[str, Any], *, where: str, what: str = "field") -> T:
    """`dataclasses.replace(obj, **changes)` (validated again by the dataclass)."""
    _check_keys(type(obj), changes, where, what)
    return dataclasses.replace(obj, **changes)


def check_choice(value: Any, allowed: tuple[str, ...], what: str) -> str:
    """`value` if it is one of `allowed`, else a ConfigError naming `what` and the choices."""
    if not isinstance(value, str) or value not in allowed:
        raise ConfigError(f"{what} must be one of {list(allowed)}, got {value!r}")
    return value


def check_dtype(dtype: Any, what: str = "dtype") -> str:
    """`dtype` if parity runs it (`parity.core.schema.DTYPES`), else a ConfigError naming the choices."""
    return check_choice(dtype, DTYPES, what)


def check_token_ids(values: Any, field: str, error: type[ConfigError] | type[InputError]) -> tuple[int, ...]:
    """A sequence of token ids (integers >= 0, NumPy's too) as a tuple of ints; a string, a bare
    number, a bool or a negative id is `error` naming `field`."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise error(f"{field} must be a list of token ids (integers >= 0), got {values!r:.80}")
    ids = tuple(values)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise error(f"{field} must hold token ids (integers >= 0), got {t!r}")
        if t < 0:
            raise error(f"{field} has a negative token id {t}; token ids are integers >= 0")
    return tuple(int(t) for t in ids)
