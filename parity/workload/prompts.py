"""Prompts from where users keep them: token ids, text, chat messages and dataset files.

Text is encoded as the tokenizer encodes a completion prompt (special tokens included); messages
are rendered by the chat template with `add_generation_prompt=True` and encoded without adding
special tokens; a `Dataset` row (JSONL or Parquet; verl's "prompt" column by default) holds any
of them. Token ids and datasets need no torch; text loads the tokenizer (the documented exception).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from parity.core.errors import ConfigError, InputError, ParityError
from parity.core.tables import read_rows
from parity.models import resolve_model
from parity.models.checkpoints import files_stamp, model_text

#: a chat message: {"role": "user", "content": "..."} (other keys go to the template unchanged).
Message = Mapping[str, Any]
#: one prompt as a user gives it.
PromptSource = Sequence[int] | str | Sequence[Message]
#: the dataset column of verl's RL layout.
DEFAULT_COLUMN = "prompt"


class DatasetShortWarning(UserWarning):
    """A dataset's `limit` asks for more rows than the file holds: every row is used, and this says
    how many (printed on stderr by Python's default warning filter)."""


@dataclass(frozen=True)
class Dataset:
    """A JSONL or Parquet file with one prompt per row in `column` (messages, text or ids).

    limit: rows to use (None: all; more than the file holds warns `DatasetShortWarning`). seed: None
    keeps the first `limit` rows, an int draws them at random.
    """

    path: Path
    column: str = DEFAULT_COLUMN
    limit: int | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        if not isinstance(self.column, str) or not self.column:
            raise ConfigError(f"dataset column must be a non-empty string, got {self.column!r}")
        for name in ("limit", "seed"):
            value = getattr(self, name)
            low = 1 if name == "limit" else 0
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ConfigError(f"dataset {name} must be an integer >= {low} or None, got {value!r}")
        if self.seed is not None and self.limit is None:
            raise ConfigError("dataset seed draws `limit` rows at random; give limit with it")

    def rows(self) -> list[tuple[str, PromptSource]]:
        """(location, prompt) of every row used, checked; location is "<file>:<line>, column
        'prompt'" or "<file> row <n>, column 'prompt'"."""
        picked: list[tuple[str, Any]] = []
        for where, row in read_rows(self.path, id_columns=(self.column,)):  # ids stored wide enough
            if self.column not in row:
                raise InputError(f"{where}: no column {self.column!r} (columns: {sorted(row)}); "
                                 f"name the prompt column with `column`")
            picked.append((f"{where}, column {self.column!r}", row[self.column]))
            if self.seed is None and self.limit is not None and len(picked) == self.limit:
                break
        if not picked:
            raise InputError(f"{self.path}: the dataset holds no rows")
        if self.limit is not None and len(picked) < self.limit:
            warnings.warn(f"{self.path}: limit {self.limit} but the dataset holds {len(picked)} rows; all "
                          f"{len(picked)} are used", DatasetShortWarning, stacklevel=2)
        if self.seed is not None and self.limit is not None and self.limit < len(picked):
            rng = np.random.Generator(np.random.PCG64(self.seed))
            keep = sorted(int(i) for i in rng.choice(len(picked), size=self.limit, replace=False))
            picked = [picked[i] for i in keep]
        return [(where, check_prompt(value, where)) for where, value in picked]


def check_prompt(value: Any, where: str) -> PromptSource:
    """`value` as a prompt (token ids, text or chat messages), or InputError naming `where`."""
    if isinstance(value, str):
        if not value:
            raise InputError(f"{where}: the prompt text is empty")
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, Mapping) for m in value):
        for j, message in enumerate(value):
            for key in ("role", "content"):
                if not isinstance(message.get(key), str):
                    raise InputError(f"{where}: message {j} needs a string {key!r}, got "
                                     f"{message.get(key)!r}; a chat message is "
                                     "{'role': 'user', 'content': '...'}")
        return [dict(m) for m in value]
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0 for t in value):
        return [int(t) for t in value]
    raise InputError(f"{where}: a prompt is token ids, a string or a non-empty list of chat messages "
                     f"({{'role': ..., 'content': ...}}), got {_describe(value)}")


def encode_prompts(model: str | os.PathLike[str], prompts: Sequence[tuple[str, PromptSource]]
                   ) -> list[tuple[int, ...]]:
    """Token ids of each (location, prompt); text and messages through `model`'s tokenizer."""
    name = model_text(model)  # a pathlib.Path spelled like a model name stays a path
    out = []
    tok = None  # loaded (and its files stamped) once per call, not once per prompt
    for where, prompt in prompts:
        if isinstance(prompt, str):
            if tok is None:
                tok = tokenizer(name, where)
            ids = tok(prompt)["input_ids"]
            _check_one_bos(tok, prompt, ids, where)
        elif prompt and isinstance(prompt[0], Mapping):
            ids = _render_chat(name, prompt, where)
        else:
            ids = prompt
        if not ids:
            raise InputError(f"{where}: the prompt encodes to no tokens")
        out.append(tuple(int(t) for t in ids))
    return out


def _check_one_bos(tok: Any, text: str, ids: Sequence[int], where: str) -> None:
    """InputError when `text` starts with the BOS token and the tokenizer added another before it
    (a prompt rendered by a chat template, encoded again): two BOS tokens, another prompt."""
    bos, bos_id = getattr(tok, "bos_token", None), getattr(tok, "bos_token_id", None)
    if isinstance(bos, str) and bos and bos_id is not None and text.startswith(bos) \
            and list(ids[:2]) == [bos_id, bos_id]:
        raise InputError(f"{where}: the text starts with the BOS token {bos!r} and the tokenizer adds "
                         "another, so the prompt would start with two; drop it from the text, or give token "
                         "ids")


def _render_chat(model: str, messages: Sequence[Message], where: str) -> list[int]:
    tok = tokenizer(model, where)
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"{where}: chat messages need a chat template, and the tokenizer of model "
                          f"{model!r} has none (no chat_template in its tokenizer_config.json); give "
                          "the prompt as text or token ids, or use a checkpoint with a chat template")
    try:
        text = tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    except Exception as e:  # a template raises what its Jinja code raises (e.g. a role it refuses)
        raise InputError(f"{where}: the chat template of model {model!r} refused these messages ({e})") from e
    return list(tok(text, add_special_tokens=False)["input_ids"])


def tokenizer(model: str | os.PathLike[str], where: str = "prompt") -> Any:
    """The checkpoint's own tokenizer (local files only), or ConfigError naming `where`."""
    try:
        path = resolve_model(model).resolve()  # absolute: a relative path means another one after a chdir
        return _load_tokenizer(str(path), _tokenizer_stamp(path))
    except ParityError:
        raise
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: model {model!r} has no loadable tokenizer ({e}); give the prompt as "
                          "token ids instead") from e


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def _tokenizer_stamp(path: Path) -> tuple[tuple[str, int, int], ...]:
    """(name, size, mtime_ns) of the checkpoint's files other than weights: a tokenizer rewritten in
    place (a training run saving to the same directory) is loaded again, not served from the cache."""
    return files_stamp(path, lambda f: f.suffix not in _WEIGHT_SUFFIXES and f.is_file())


@lru_cache(maxsize=8)
def _load_tokenizer(path: str, stamp: tuple[tuple[str, int, int], ...] = ()) -> Any:
    # transformers (and torch) only for text and chat prompts: token ids and datasets of ids never load it
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"
