"""What `parity.compare` samples: a case (a `Case`, a case file or a name in cases/), explicit
prompts with one `SamplingParams` (each prompt its own seed, `seed + i`; default
`DEFAULT_SAMPLING`, whose fields a dict overrides), or the model's default case; with `turns`,
every prompt becomes a multi-turn trajectory."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from parity.core.errors import ConfigError, ParityError
from parity.core.schema import LOGPROBS_MODES
from parity.core.strict import check_choice
from parity.core.turns import Turn, check_turns
from parity.core.types import Request, SamplingParams
from parity.models import resolve_model
from parity.models.checkpoints import model_text
from parity.workload.cases import Case, default_case, resolve_case
from parity.workload.prompts import Dataset, PromptSource, check_prompt, encode_prompts
from parity.workload.tools import bind_tools

#: the sampling of explicit prompts when `sampling` is None; a dict of fields overrides these.
DEFAULT_SAMPLING = SamplingParams(max_tokens=32)


def resolve_workload(model: str | os.PathLike[str] | None, case: Case | str | os.PathLike[str] | None,
                  prompts: Sequence[PromptSource] | Dataset | os.PathLike[str] | None,
                  sampling: SamplingParams | dict[str, Any] | None, turns: Sequence[Turn] = ()) -> Case:
    """The `Case` `compare` samples from its arguments; ConfigError for a combination that is ambiguous."""
    if case is not None and prompts is not None:
        raise ConfigError("give either case or prompts, not both (a case carries its own prompts)")
    if turns and prompts is None:
        raise ConfigError("turns apply to prompts; pass prompts=[...] with them (a case carries its own "
                          "turns)")
    if case is not None:
        if sampling is not None:
            raise ConfigError("sampling applies to prompts; a case carries its own sampling parameters")
        the_case = resolve_case(case)
        check_case_model(model, the_case)
        return the_case
    if model is None:
        raise ConfigError("model is required unless a case names it; "
                          "pass a built-in name or a checkpoint path")
    if prompts is None:
        if sampling is not None:
            raise ConfigError("sampling applies to prompts; pass prompts=[...] with it")
        return default_case(model_text(model))
    if isinstance(sampling, dict):  # over the default, as sampling=None: {"n": 2} keeps max_tokens 32
        sampling = SamplingParams.from_dict({**DEFAULT_SAMPLING.to_dict(), **sampling})
    elif sampling is None:
        sampling = DEFAULT_SAMPLING
    elif not isinstance(sampling, SamplingParams):
        raise ConfigError(f"sampling must be a parity.SamplingParams or a dict of its fields, "
                          f"got {type(sampling).__name__}")
    if isinstance(prompts, os.PathLike):
        prompts = Dataset(Path(prompts))
    if isinstance(prompts, Dataset):
        items = prompts.rows()
    elif isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)) and prompts:
        items = [(f"prompts[{i}]", check_prompt(p, f"prompts[{i}]")) for i, p in enumerate(prompts)]
    else:
        raise ConfigError("prompts must be a non-empty list of token-id lists, strings or chat-message "
                          "lists, or a dataset (a parity.workload.prompts.Dataset or a path)")
    ids = encode_prompts(model, items)
    bound = bind_tools(model, check_turns(turns, "turns")) if turns else ()
    requests = tuple(Request(p, sampling.replace(seed=sampling.seed + i), request_id=f"prompt-{i}",
                             turns=bound) for i, p in enumerate(ids))
    return Case(name="prompts", model=model_text(model), requests=requests,
                logprobs_mode=sampling.logprobs_mode, kind="trajectory" if bound else "compare")


def check_case_model(model: str | os.PathLike[str] | None, case: Case,
                     field: str = "model (--model)") -> None:
    """ConfigError unless `model` is None or names the checkpoint `case` names: the case's prompts were
    encoded, and its limits checked, with its own model's tokenizer."""
    if model is not None and not _same_model(model, case.model):
        shown = model_text(model) if isinstance(model, (str, os.PathLike)) else model
        raise ConfigError(f"case {case.name!r} names model {case.model!r}, not model {shown!r}; drop {field} "
                          "to run the case's, or copy the case file with model set to the one you mean")


def _same_model(model: str | os.PathLike[str], case_model: str) -> bool:
    """Whether `model` names the checkpoint `case_model` names (a built-in name and its directory alike;
    a pathlib.Path is a path even when spelled like a name)."""
    if not isinstance(model, (str, os.PathLike)):
        return False
    if model_text(model) == case_model:
        return True
    try:
        mine = resolve_model(model)
    except ParityError:
        return False
    return mine.resolve() == resolve_model(case_model).resolve()  # the case's own model: its error


def with_logprobs_mode(case: Case, mode: Any) -> Case:
    """`case` with every request in logprobs mode `mode`: a backend option's mode wins over the case's,
    as a command line wins over a file.
    """
    mode = check_choice(mode, LOGPROBS_MODES, "backend option logprobs_mode")
    requests = tuple(dataclasses.replace(r, sampling=r.sampling.replace(logprobs_mode=mode))
                     for r in case.requests)
    return dataclasses.replace(case, logprobs_mode=mode, requests=requests)
