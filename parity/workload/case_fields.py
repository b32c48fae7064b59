"""Typed access to a parsed case file (TOML): every error names the file and the dotted field."""

from __future__ import annotations

import dataclasses
import os
import unicodedata
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parity.core.errors import ConfigError, ParityError
from parity.models.checkpoints import model_hash, resolve_model
from parity.models.lora import adapter_text, check_adapter, shadowing_adapter
from parity.models.lora_builtins import builtin_adapter_dir, is_builtin_adapter

if TYPE_CHECKING:
    from parity.core.types import Request


class Fields:
    """Typed access to a parsed TOML table whose errors name the file and the dotted field."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def error(self, field: str, message: str) -> ConfigError:
        return ConfigError(f"{self.path}: {field}: {message}")

    def only(self, table: dict[str, Any], prefix: str, allowed: Iterable[str]) -> None:
        allowed = tuple(allowed)
        for key in table:
            if key not in allowed:
                raise self.error(prefix + key, f"unknown field; allowed: {list(allowed)}")

    def get(self, table: dict[str, Any], key: str, kind: type | tuple[type, ...], *,
            default: Any = dataclasses.MISSING, prefix: str = "") -> Any:
        if key not in table:
            if default is dataclasses.MISSING:
                raise self.error(prefix + key, "required field is missing")
            return default
        value = table[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # TOML booleans are Python ints; never accept one where a number is meant.
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise self.error(prefix + key, f"must be {names}, got {value!r}")
        return value

    def choice(self, table: dict[str, Any], key: str, allowed: tuple[str, ...], *,
               default: Any = dataclasses.MISSING, prefix: str = "") -> Any:
        value = self.get(table, key, str, default=default, prefix=prefix)
        if value not in allowed:
            raise self.error(prefix + key, f"{value!r} is not allowed; allowed: {list(allowed)}")
        return value

    def choices(self, table: dict[str, Any], key: str, allowed: tuple[str, ...], *,
                default: Any = dataclasses.MISSING, nonempty: bool = False) -> list[str]:
        values = self.get(table, key, list, default=default)
        bad = [v for v in values if v not in allowed]
        if bad or (nonempty and not values) or len(set(values)) != len(values):
            raise self.error(key, f"got {values!r}; give distinct values from {list(allowed)}")
        return values

    def count(self, table: dict[str, Any], key: str, *, prefix: str, low: int = 1,
              default: Any = dataclasses.MISSING) -> int:
        value = self.get(table, key, int, default=default, prefix=prefix)
        if value < low:
            raise self.error(prefix + key, f"must be an integer >= {low}, got {value!r}")
        return value


def control_character(text: str) -> str | None:
    """The first control character of `text` (a terminal escape code starts with one), or None;
    a tab is allowed."""
    return next((c for c in text if unicodedata.category(c) == "Cc" and c != "\t"), None)


def printable_field(f: Fields, table: dict[str, Any], key: str, *, default: str) -> str:
    """A string field that is printed as it is (a case's name and description reach the terminal,
    summary.md and HTML): control characters, a terminal escape code among them, are refused."""
    value = f.get(table, key, str, default=default)
    bad = control_character(value)
    if bad is not None:
        raise f.error(key, f"contains the control character {bad!r}; give printable text")
    return value


def check_unshadowed(part: str, cases_dir: str | Path, what: str) -> None:
    """ConfigError when bare case name `part` (no directory, no .toml) is also a file or directory here:
    it would run that instead of `<cases_dir>/<part>.toml`, another workload, without a word."""
    named, path = Path(cases_dir) / f"{part}.toml", Path(part)
    if "/" in part or os.sep in part or path.suffix == ".toml" or not path.exists() or not named.is_file() \
            or path.resolve() == named.resolve():
        return
    kind = "directory" if path.is_dir() else "file"
    raise ConfigError(f"{what} {part!r} is both the case name of {str(named)!r} and the {kind} "
                      f"{str(path.resolve())!r}; give {str(named)!r} for the case or "
                      f"{os.path.join(os.curdir, part)!r} for the {kind}")


def case_adapter(f: Fields, lora: str) -> str:
    """A case file's `lora` as the string `resolve_adapter` reads from any working directory: a built-in
    adapter's name, or a path relative to the case file's folder joined to it (spelled like a name, with
    "./"). A name that is also an adapter directory beside the case file is refused, as is an empty one."""
    if not lora:
        raise f.error("lora", "is empty; give a built-in adapter's name or a peft adapter directory "
                              "(relative to the case file's folder)")
    if is_builtin_adapter(lora):
        folder = shadowing_adapter(lora, f.path.parent / lora)
        if folder is not None:
            raise f.error("lora", f"{lora!r} is both a built-in adapter's name and the adapter directory "
                                  f"{str(folder)!r} beside the case file; write "
                                  f"{os.path.join(os.curdir, lora)!r} for the directory, or for the "
                                  "built-in adapter its directory "
                                  f"{str(builtin_adapter_dir(lora))!r}")
        return lora
    return lora if Path(lora).expanduser().is_absolute() else adapter_text(f.path.parent / lora)


def check_model_place(f: Fields, model: str) -> None:
    """ConfigError when a case file's relative `model` (read from the working directory) also names a
    checkpoint directory beside the case file (where `lora` and dataset paths are read) holding other
    weights: the case would score other weights depending on where it runs. "./" means the working
    directory and is not checked."""
    path = Path(model).expanduser()
    there = f.path.parent / path
    if not model or path.is_absolute() or model.startswith(os.curdir + os.sep) \
            or not (there / "config.json").is_file():
        return
    try:
        here = resolve_model(model)
    except ParityError:
        return  # model_limits names what is wrong with it
    if here.resolve() == there.resolve() or model_hash(here) == model_hash(there):
        return
    raise f.error("model", f"{model!r} is read from the working directory ({str(here.resolve())!r}), but "
                           f"the case file's folder holds another checkpoint of that name "
                           f"({str(there.resolve())!r}); give the absolute path of the one you mean, or a "
                           "path starting with ./ from where you run")


def load_lora(f: Fields, data: dict[str, Any], model: str) -> str | None:
    """A case file's `lora` (`case_adapter`), checked against its `model`; None without one."""
    lora = f.get(data, "lora", str, default=None)
    if lora is None:
        return None
    lora = case_adapter(f, lora)
    try:
        check_adapter(lora, model)
    except ParityError as exc:
        raise f.error("lora", str(exc)) from exc
    return lora


def check_requests_agree(where: str, requests: tuple[Request, ...], mode: str) -> None:
    """ConfigError for a request in another logprobs mode than the case's (which the hash and reports
    say), or two requests that are one (the same tokens sampled, counted twice)."""
    seen: dict[tuple[Any, ...], str] = {}
    for r in requests:
        if r.sampling.logprobs_mode != mode:
            raise ConfigError(f"{where}: logprobs_mode is {mode!r} but request {r.request_id!r} samples "
                              f"{r.sampling.logprobs_mode!r}; give its SamplingParams logprobs_mode={mode!r} "
                              "(parity.workload.resolve.with_logprobs_mode sets every request's)")
        twin = seen.setdefault((r.prompt_ids, r.sampling, r.turns), r.request_id)
        if twin != r.request_id:
            raise ConfigError(f"{where}: requests {twin!r} and {r.request_id!r} have the same prompt, "
                              "sampling and seed: the same tokens, counted twice; give one another seed or "
                              "drop it")
