"""Start SGLang's HTTP server for the `sglang` backend (`launch_server=True`) on a loopback port.

The Python is `python=`, else PARITY_SGLANG_PYTHON, else this one: SGLang pins its own torch and
transformers, so it often lives in an environment of its own (`make sglang-check`'s .venv-sglang).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from parity.core.errors import ConfigError
from parity.runtime.processes import LOOPBACK, ServerProcess, free_loopback_port

#: flags parity sets itself; `server_args` may not repeat them.
MANAGED_FLAGS = ("--model-path", "--host", "--port", "--dtype", "--skip-tokenizer-init",
                 "--enable-return-routed-experts")
#: other names SGLang's parser gives the flags parity sets (0.5.23: `--model` is `--model-path`).
ALIASES = {"--model": "--model-path"}
#: the variable naming the Python that has SGLang installed.
PYTHON_ENV = "PARITY_SGLANG_PYTHON"


def managed_flag(word: str) -> str | None:
    """The flag of `MANAGED_FLAGS` an argv word sets as SGLang's parser (argparse) reads it, or None: an
    alias (`--model`), `--flag=value`, or a prefix of the whole flag (`--dtyp`, `--model-p`)."""
    name = word.split("=", 1)[0]
    if not name.startswith("--") or len(name) < 3:
        return None
    if name in MANAGED_FLAGS or name in ALIASES:
        return ALIASES.get(name, name)
    found = next((flag for flag in (*MANAGED_FLAGS, *ALIASES) if flag.startswith(name)), None)
    return None if found is None else ALIASES.get(found, found)


def split_server_args(server_args: str | Sequence[str]) -> tuple[str, ...]:
    """`server_args` as argv words; refuses the flags parity sets itself, in any spelling SGLang reads
    (they come after parity's, so they would win)."""
    words = tuple(shlex.split(server_args)) if isinstance(server_args, str) else tuple(map(str, server_args))
    for word in words:
        flag = managed_flag(word)
        if flag is not None:
            given = word.split("=", 1)[0]
            spelled = "" if given == flag else f" (spelled {given})"
            raise ConfigError(f"option server_args may not contain {flag}{spelled}: parity sets it "
                              "(model, dtype and return_routed_experts are options of their own)")
    return words


def server_python(python: str | None) -> str:
    """The interpreter that runs the server: `python`, else $PARITY_SGLANG_PYTHON, else this one."""
    chosen = python or os.environ.get(PYTHON_ENV) or sys.executable
    found = shutil.which(chosen) if os.sep not in chosen else (chosen if Path(chosen).is_file() else None)
    if found is None:
        raise ConfigError(f"the Python for the SGLang server, {chosen!r}, does not exist; set option python= "
                          f"or {PYTHON_ENV} to an interpreter with sglang installed")
    return found


def start_server(model_path: Path, *, dtype: str, logprob_env: str, routed_experts: bool,
                 words: tuple[str, ...], python: str | None, timeout_s: float) -> ServerProcess:
    """Launch `sglang.launch_server` on a free loopback port and wait up to `timeout_s` for /health."""
    port = free_loopback_port()
    argv = [server_python(python), "-m", "sglang.launch_server", "--model-path", str(model_path),
            "--host", LOOPBACK, "--port", str(port), "--dtype", dtype, "--skip-tokenizer-init",
            *(["--enable-return-routed-experts"] if routed_experts else []), *words]
    # TMPDIR: SGLang names its ZMQ sockets by tempfile, in /tmp, and leaves them there
    server = ServerProcess(argv, port=port, name="SGLang server",
                           env={"SGLANG_RETURN_ORIGINAL_LOGPROB": logprob_env}, folder_env="TMPDIR")
    server.start(timeout_s)
    return server
