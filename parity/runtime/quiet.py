"""Quiet by default: the engines parity starts print errors only, unless the user chose otherwise.

Before an engine starts, `engine_logging()` sets VLLM_LOGGING_LEVEL=ERROR, TORCH_CPP_LOG_LEVEL=ERROR
and HF_HUB_DISABLE_PROGRESS_BARS=1 where unset, the `vllm` logger's level and a FutureWarning
filter; spawned engine processes re-apply it (`follow_parent`, via `PARITY_ENGINE_LOGS`). A user's
own `VLLM_LOGGING_LEVEL` or `VLLM_CONFIGURE_LOGGING=0` wins; `--verbose` shows INFO. Stdlib only.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Literal

#: the warning option quiet child processes get (`-W`, for the resource tracker's shutdown note).
CHILD_WARNING = "ignore:resource_tracker:UserWarning"
#: the environment variable recording parity's choice for this process and its children.
MARK = "PARITY_ENGINE_LOGS"
#: engine environment of each choice (only variables the user has not set are written).
ENVIRONMENT: dict[str, dict[str, str]] = {
    "quiet": {"VLLM_LOGGING_LEVEL": "ERROR", "TORCH_CPP_LOG_LEVEL": "ERROR",
              "HF_HUB_DISABLE_PROGRESS_BARS": "1"},
    "verbose": {"VLLM_LOGGING_LEVEL": "INFO"},
}

Choice = Literal["quiet", "verbose", "user"]


def engine_logging(verbose: bool | None = None) -> Choice:
    """Set how loud engines started from now on are (None: keep the earlier choice) and return the
    choice in force; "user" when the user configured vLLM's logging (nothing changed).
    """
    env = os.environ
    if env.get("VLLM_CONFIGURE_LOGGING") == "0" or ("VLLM_LOGGING_LEVEL" in env and MARK not in env):
        return "user"
    choice: Choice = "verbose" if verbose or (verbose is None and env.get(MARK) == "verbose") else "quiet"
    for name, value in ENVIRONMENT[choice].items():
        # VLLM_LOGGING_LEVEL is parity's here (checked above); the others only if unset
        if name == "VLLM_LOGGING_LEVEL" or name not in env:
            env[name] = value
    env[MARK] = choice
    if choice == "quiet" and CHILD_WARNING not in sys.warnoptions:
        sys.warnoptions.append(CHILD_WARNING)  # passed on as -W to the processes spawned from here
    follow_parent()
    return choice


def follow_parent() -> None:
    """Apply parity's recorded choice inside this process: the `vllm` logger's level (its
    import-time warnings come before vLLM configures logging) and vLLM's FutureWarnings."""
    choice = os.environ.get(MARK)
    if choice == "quiet":
        logging.getLogger("vllm").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", category=FutureWarning, module="vllm")
        # transformers reads HF_HUB_DISABLE_PROGRESS_BARS once, at its import: one imported before
        # this call still draws its "Loading weights" bar unless told here
        bars = sys.modules.get("transformers.utils.logging")
        if bars is not None and os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") == "1":
            bars.disable_progress_bar()
    elif choice == "verbose":
        logging.getLogger("vllm").setLevel(logging.NOTSET)
