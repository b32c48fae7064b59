"""Backend adapters behind one contract, looked up by name: reference, hf, vllm, sglang, trtllm."""

from parity.backends.base import Backend
from parity.backends.registry import (
    BACKENDS,
    available_backends,
    backend_options,
    check_probe,
    check_requests,
    close_dead_backends,
    close_shared_backend,
    close_shared_backends,
    get_backend,
    lora_backends,
    lora_options,
    parse_option,
    parse_options,
    prefix_cache_backends,
    prefix_cache_options,
    route_capture_options,
    route_recording_backends,
    route_shared_backends,
    shared_backend,
    top_k_limit,
    weight_sync_missing,
)

__all__ = ["BACKENDS", "Backend", "available_backends", "backend_options", "check_probe", "check_requests",
           "close_dead_backends",
           "close_shared_backend", "close_shared_backends", "get_backend", "lora_backends",
           "lora_options", "parse_option", "parse_options",
           "prefix_cache_backends", "prefix_cache_options", "route_capture_options",
           "route_recording_backends", "route_shared_backends", "shared_backend", "top_k_limit",
           "weight_sync_missing"]
