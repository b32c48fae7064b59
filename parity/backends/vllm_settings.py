"""What decides a vLLM server's numbers, as a report records it (`meta["server_settings"]`).

Two servers of one model and version started differently drift differently (measured: vLLM's
defaults up to 0.789 nats, parity's start 0.288, other tokens on 5 of 16 sequences), so every report
records the settings: all from `/server_info` (dev mode), else what probes, `/metrics` and
`/v1/models` show, None for the rest. Standard library only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: the settings every report of a vLLM server records, None where the server does not show them.
SETTINGS: tuple[str, ...] = (
    "logprobs_mode", "dtype", "batch_invariant", "enable_chunked_prefill", "enable_prefix_caching",
    "block_size", "enforce_eager", "cudagraph_mode", "max_num_seqs", "max_num_batched_tokens",
    "max_model_len", "attention_backend", "tensor_parallel_size", "seed", "speculative_config",
    "kv_cache_dtype", "quantization",
)
#: vLLM's `CUDAGraphMode` values (an int, or a pair for separate decode and mixed modes) by name.
CUDAGRAPH_MODES: dict[Any, str] = {0: "NONE", 1: "PIECEWISE", 2: "FULL", (2, 0): "FULL_DECODE_ONLY",
                                   (2, 1): "FULL_AND_PIECEWISE"}
SERVER_INFO = "server_info"
#: how `from_probes` knows what it knows.
PROBES = ("probes: logprobs mode from two requests, prefix caching, block size and KV cache dtype from "
          "/metrics (vllm:cache_config_info), max_model_len from /v1/models; the others need /server_info "
          "(VLLM_SERVER_DEV_MODE=1)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
#: vLLM's flag naming a YAML file of more flags (`FlexibleArgumentParser`: the exact word, then the path).
CONFIG_FLAG = "--config"


def cudagraph_mode(value: Any) -> str | None:
    """A `CUDAGraphMode` as vLLM's JSON writes it (0, [2, 1], "FULL", ...) -> its name."""
    if value is None:
        return None
    key = tuple(value) if isinstance(value, list) else value
    return CUDAGRAPH_MODES.get(key, str(value))


def speculative(config: Any) -> dict[str, Any] | None:
    """A server's `speculative_config` (None: off) as its method, draft model and draft tokens."""
    if not config:
        return None
    if not isinstance(config, dict):
        return {"config": str(config)}
    return {key: config.get(key) for key in ("method", "model", "num_speculative_tokens")}


def _flag(value: Any) -> bool | None:
    """A flag from JSON or an environment value ("1", "True", true) -> bool; None when absent."""
    if value is None:
        return None
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes")
    return bool(value)


def from_server_info(info: dict[str, Any]) -> dict[str, Any]:
    """`SETTINGS` from a `/server_info?config_format=json` answer (its "vllm_config" and "vllm_env")."""
    config = info["vllm_config"]
    model, cache = config.get("model_config") or {}, config.get("cache_config") or {}
    scheduler, compilation = config.get("scheduler_config") or {}, config.get("compilation_config") or {}
    env = info.get("vllm_env") or {}
    return {
        "logprobs_mode": model.get("logprobs_mode"),
        "dtype": str(model["dtype"]).removeprefix("torch.") if model.get("dtype") else None,
        # an unset VLLM_BATCH_INVARIANT is off: vLLM reports only the variables it has a value for
        "batch_invariant": bool(_flag(env.get("VLLM_BATCH_INVARIANT"))),
        "enable_chunked_prefill": _flag(scheduler.get("enable_chunked_prefill")),
        "enable_prefix_caching": _flag(cache.get("enable_prefix_caching")),
        "block_size": cache.get("block_size"),
        "enforce_eager": _flag(model.get("enforce_eager")),
        "cudagraph_mode": cudagraph_mode(compilation.get("cudagraph_mode")),
        "max_num_seqs": scheduler.get("max_num_seqs"),
        "max_num_batched_tokens": scheduler.get("max_num_batched_tokens"),
        "max_model_len": model.get("max_model_len"),
        "attention_backend": str((config.get("attention_config") or {}).get("backend") or "auto"),
        "tensor_parallel_size": (config.get("parallel_config") or {}).get("tensor_parallel_size"),
        "seed": model.get("seed"),
        "speculative_config": speculative(config.get("speculative_config")),
        # the KV cache's dtype ("auto": the model's) and the weights' quantization ("none": unquantized)
        "kv_cache_dtype": cache.get("cache_dtype"),
        "quantization": str(model["quantization"] or "none") if "quantization" in model else None,
        "source": SERVER_INFO,
    }


def cache_config_info(metrics: str) -> dict[str, str]:
    """The labels of the `vllm:cache_config_info` gauge on a Prometheus `/metrics` page ({} if absent)."""
    for line in metrics.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            return dict(_LABEL.findall(line))
    return {}


def from_probes(logprobs_mode: str, metrics: str | None, models: dict[str, Any]) -> dict[str, Any]:
    """`SETTINGS` from what a server without /server_info shows (`metrics`: None where not served)."""
    cache = cache_config_info(metrics or "")
    block = cache.get("block_size")
    served = (models.get("data") or [{}])[0]
    settings: dict[str, Any] = dict.fromkeys(SETTINGS)
    settings.update({
        "logprobs_mode": logprobs_mode,
        "enable_prefix_caching": _flag(cache.get("enable_prefix_caching")),
        "block_size": int(block) if block and block.isdigit() else None,
        "max_model_len": served.get("max_model_len"),
        "kv_cache_dtype": cache.get("cache_dtype"),
        "source": PROBES,
    })
    return settings


def config_file(words: Sequence[str]) -> dict[str, Any]:
    """{"config_file": {"path", "text"}} for the `--config` YAML among server flags `words` (vLLM reads
    its flags from it), {} without one: its text is recorded, as the flags are, since /server_info may
    be off and /metrics shows few of the settings it can set."""
    if CONFIG_FLAG not in words or words.index(CONFIG_FLAG) + 1 >= len(words):
        return {}
    path = Path(words[words.index(CONFIG_FLAG) + 1])
    try:
        text: str | None = path.read_text()
    except OSError:
        text = None
    return {"config_file": {"path": str(path.resolve()), "text": text}}
