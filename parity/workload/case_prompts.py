"""The `[prompts]` table of a case file: token ids, text, chat messages, a dataset, or a seeded
generator (`random`, `shared_prefix`). Validated whole before any tokenizer loads: text,
messages and datasets are encoded only when `PromptTable.encode` is called."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from parity.core.errors import ParityError
from parity.models import ModelLimits
from parity.workload.case_fields import Fields
from parity.workload.prompts import Dataset, check_prompt, encode_prompts

GENERATOR_KINDS: tuple[str, ...] = ("random", "shared_prefix")
LENGTH_DISTRIBUTIONS: tuple[str, ...] = ("uniform", "lognormal")
#: generated prompts draw token ids from [low, high): the byte tokens of the built-in tokenizer.
DEFAULT_TOKEN_RANGE: tuple[int, int] = (3, 259)


_PROMPT_KEYS = ("token_ids", "text", "messages", "dataset", "generate")
_DATASET_KEYS = ("path", "column", "limit", "seed")


def load_prompt_table(f: Fields, table: dict[str, Any], model: str,
                      limits: ModelLimits) -> Callable[[], list[tuple[int, ...]]]:
    """The `[prompts]` table, validated now; returns what produces its prompt ids (lengths bounded by the
    context). Tokenizers load only when called, after every other field is checked.
    """
    given = [k for k in _PROMPT_KEYS if k in table]
    if len(given) != 1:
        raise f.error("prompts", f"give exactly one of {list(_PROMPT_KEYS)}, got {given}")
    f.only(table, "prompts.", _PROMPT_KEYS)
    key = given[0]
    if key == "generate":
        spec = f.get(table, "generate", dict, prefix="prompts.")
        generated = _generate_prompts(f, spec, limits.max_positions)
        return lambda: generated
    if key == "dataset":
        spec = f.get(table, "dataset", dict, prefix="prompts.")
        f.only(spec, "prompts.dataset.", _DATASET_KEYS)
        path = Path(f.get(spec, "path", str, prefix="prompts.dataset."))
        try:
            dataset = Dataset(path if path.is_absolute() else f.path.parent / path,
                              column=f.get(spec, "column", str, default="prompt", prefix="prompts.dataset."),
                              limit=f.get(spec, "limit", int, default=None, prefix="prompts.dataset."),
                              seed=f.get(spec, "seed", int, default=None, prefix="prompts.dataset."))
        except ParityError as exc:
            raise type(exc)(f"{f.path}: prompts.dataset: {exc}") from exc

        def encode_dataset() -> list[tuple[int, ...]]:
            try:
                return encode_prompts(model, dataset.rows())
            except ParityError as exc:
                raise type(exc)(f"{f.path}: prompts.dataset: {exc}") from exc
        return encode_dataset
    items = f.get(table, key, list, prefix="prompts.")
    if not items:
        raise f.error(f"prompts.{key}", "is empty; give at least one prompt")
    if key == "text" and not all(isinstance(t, str) and t for t in items):
        raise f.error("prompts.text", "must be a list of non-empty strings")
    if key == "messages" and not all(isinstance(m, list) and m and all(isinstance(x, dict) for x in m)
                                     for m in items):
        raise f.error("prompts.messages", "must be a list of prompts, each a non-empty list of "
                                          "{ role = ..., content = ... } tables")
    if key == "token_ids":
        for i, ids in enumerate(items):
            if not isinstance(ids, list) or not ids or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise f.error(f"prompts.token_ids[{i}]", "must be a non-empty list of token ids >= 0")
        ids = [tuple(ids) for ids in items]
        return lambda: ids
    try:
        checked = [(f"prompts.{key}[{i}]", check_prompt(item, f"prompts.{key}[{i}]"))
                   for i, item in enumerate(items)]
    except ParityError as exc:
        raise type(exc)(f"{f.path}: {exc}") from exc

    def encode() -> list[tuple[int, ...]]:
        try:
            return encode_prompts(model, checked)
        except ParityError as exc:
            raise type(exc)(f"{f.path}: {exc}") from exc
    return encode


_GEN_KEYS = {
    "random": ("kind", "seed", "count", "length", "token_range"),
    "shared_prefix": ("kind", "seed", "conversations", "turns", "prefix_length", "turn_length",
                      "token_range"),
}


def _generate_prompts(f: Fields, g: dict[str, Any], context: int | None) -> list[tuple[int, ...]]:
    """Seeded synthetic prompts: `random`, or `shared_prefix` (conversation c's turn t is the prefix
    plus c's first t+1 chunks, like multi-turn rollouts hitting a prefix cache).
    """
    p = "prompts.generate."
    kind = f.choice(g, "kind", GENERATOR_KINDS, prefix=p)
    f.only(g, p, _GEN_KEYS[kind])
    rng = np.random.Generator(np.random.PCG64(f.count(g, "seed", prefix=p, low=0, default=0)))
    token_range = f.get(g, "token_range", list, default=list(DEFAULT_TOKEN_RANGE), prefix=p)
    if len(token_range) != 2 or not all(isinstance(t, int) and not isinstance(t, bool) for t in token_range) \
            or not 0 <= token_range[0] < token_range[1]:
        raise f.error(p + "token_range", f"must be [low, high) with 0 <= low < high, got {token_range!r}")

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(token_range[0], token_range[1], size=n))

    if kind == "random":
        draw = _length_sampler(f, g, "length", rng, prefix=p, context=context)
        return [tokens(draw()) for _ in range(f.count(g, "count", prefix=p))]
    prefix_length = f.count(g, "prefix_length", prefix=p)
    if context is not None and prefix_length > context:
        raise f.error(p + "prefix_length", f"{prefix_length} is longer than the model's context of {context}")
    prefix = tokens(prefix_length)
    draw = _length_sampler(f, g, "turn_length", rng, prefix=p, context=context)
    turns = f.count(g, "turns", prefix=p)
    prompts = []
    for _ in range(f.count(g, "conversations", prefix=p)):
        history = prefix
        for _ in range(turns):
            history = history + tokens(draw())
            prompts.append(history)
    return prompts


def _length_sampler(f: Fields, g: dict[str, Any], key: str, rng: np.random.Generator, *,
                    prefix: str, context: int | None) -> Callable[[], int]:
    """A draw() for an int, {min, max} (uniform, inclusive) or a clipped lognormal length spec."""
    spec = f.get(g, key, (int, dict), prefix=prefix)
    field = prefix + key
    if isinstance(spec, int):
        if spec < 1 or (context is not None and spec > context):
            raise f.error(field, f"must be in [1, {context}] (the model's context), got {spec}")
        return lambda: spec
    dist = f.choice(spec, "distribution", LENGTH_DISTRIBUTIONS, default="uniform", prefix=field + ".")
    keys = ("distribution", "min", "max") + (("median", "sigma") if dist == "lognormal" else ())
    f.only(spec, field + ".", keys)
    low = f.count(spec, "min", prefix=field + ".")
    high = f.count(spec, "max", prefix=field + ".")
    if high < low:
        raise f.error(field, f"max ({high}) < min ({low})")
    if context is not None and high > context:
        raise f.error(field + ".max", f"{high} is longer than the model's context of {context}")
    if dist == "uniform":
        return lambda: int(rng.integers(low, high + 1))
    median = f.get(spec, "median", (int, float), prefix=field + ".")
    sigma = f.get(spec, "sigma", (int, float), prefix=field + ".")
    if not (math.isfinite(median) and math.isfinite(sigma)) or median <= 0 or sigma < 0:
        raise f.error(field, f"lognormal needs finite median > 0 and sigma >= 0, got {median}, {sigma}")
    if not low <= median <= high:  # else most draws are clipped to one length, and the median is not it
        raise f.error(field + ".median", f"{median} is outside [min, max] = [{low}, {high}]; give a median "
                                         "within them")
    # clipped before rounding: a wide lognormal can draw inf, which has no integer
    return lambda: round(float(np.clip(rng.lognormal(math.log(median), sigma), low, high)))
