"""A dump row's sampling: its own `sampling` object or flat columns, else what the caller gave, the
two checked against each other (processed logprobs depend on them: `SamplingParams.definition`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from parity.core.errors import ConfigError, InputError
from parity.core.types import SamplingParams, float32_meant, top_k_off

#: the flat sampling columns; a row with any of them has sampling, the missing ones off.
SAMPLING_COLUMNS: tuple[str, ...] = ("temperature", "top_p", "top_k")
#: the float sampling fields, which a float32 column stores as the float32 nearest the value meant.
SAMPLING_FLOATS: tuple[str, ...] = ("temperature", "top_p")


def check_given_sampling(sampling: Any) -> None:
    """ConfigError unless `sampling` is None, a SamplingParams or a dict of them by request id (a string:
    a key 0 would match no rollout, whose own sampling would then go unchecked)."""
    if sampling is None or isinstance(sampling, SamplingParams):
        return
    if not isinstance(sampling, Mapping):
        raise ConfigError(f"sampling must be a parity.SamplingParams, a dict of them by request id, or None; "
                          f"got {type(sampling).__name__}")
    for key, value in sampling.items():
        if not isinstance(key, str):
            raise ConfigError(f"sampling is a dict by request id, and request ids are strings: its key "
                              f"{key!r} ({type(key).__name__}) matches no rollout; give it as {str(key)!r} "
                              "(`{str(k): s for k, s in sampling.items()}`)")
        if not isinstance(value, SamplingParams):
            raise ConfigError(f"sampling[{key!r}] must be a SamplingParams, got {type(value).__name__}")


def row_sampling(row: dict[str, Any], mode: str, given: SamplingParams | None,
              unmatched: str | None = None) -> SamplingParams | None:
    """The row's sampling: its own columns, else what was given; both must agree when both exist.
    unmatched: why nothing was given for this row (a dict by request id without its id), for the error."""
    own = flat = None
    try:
        if row.get("sampling") is not None:
            if not isinstance(row["sampling"], Mapping):
                raise InputError(f"sampling must be an object of SamplingParams fields, "
                                 f"got {row['sampling']!r}")
            # a Parquet struct holds null for a field the row lacks: absent, as a null flat column
            fields = {k: v for k, v in row["sampling"].items() if v is not None}
            if "top_k" in fields:
                fields["top_k"] = top_k_off(fields["top_k"])  # one rule for the object and the column
            own = SamplingParams.from_dict({**fields, "logprobs_mode": mode,
                                            **{k: float32_meant(fields[k]) for k in SAMPLING_FLOATS
                                               if k in fields}})
        if any(row.get(c) is not None for c in SAMPLING_COLUMNS):
            flat = SamplingParams(temperature=_number(row, "temperature", 1.0),
                                  top_p=_number(row, "top_p", 1.0), top_k=_top_k(row), logprobs_mode=mode)
    except ConfigError as e:
        raise InputError(str(e)) from e  # a bad value in the data, not in parity's configuration
    if own is not None and flat is not None and own.definition != flat.definition:
        present = ", ".join(f"{c}={row[c]!r}" for c in SAMPLING_COLUMNS if row.get(c) is not None)
        raise InputError(f"the row's sampling object says (temperature, top_k, top_p) = "
                         f"{own.definition} but its columns say {present}; the row contradicts itself: "
                         "drop one of them")
    own = own or flat
    if given is not None:
        given = given.replace(logprobs_mode=mode)
        if own is not None and own.definition != given.definition:
            raise InputError(f"the row's sampling (temperature, top_k, top_p) = {own.definition} but "
                             f"{given.definition} was given; drop one of them")
    chosen = own or given
    if chosen is None and mode == "processed":
        raise InputError(f"processed logprobs but no sampling parameters: {unmatched or ''}add "
                         "temperature/top_p/top_k columns, or give them (`parity score --temperature T "
                         "--top-p P --top-k K`, `sampling=SamplingParams(...)` in Python); or read the dump "
                         "as raw logprobs")
    return chosen


def _number(row: dict[str, Any], name: str, default: float) -> float:
    value = row.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{name} must be a number, got {value!r}")
    return float(float32_meant(value))


def _top_k(row: dict[str, Any]) -> int:
    value = top_k_off(row.get("top_k"))
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool):
        raise InputError(f"top_k must be an integer, got {row['top_k']!r}")
    return value
