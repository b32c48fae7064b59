"""Shared test setup: a persistent checkpoint cache and hypothesis profiles sized for 2 CPU cores."""

import os
from pathlib import Path

os.environ.setdefault("PARITY_CACHE", str(Path(__file__).resolve().parent.parent / ".venv" / "parity-cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=25, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough", max_examples=300, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("PARITY_HYPOTHESIS_PROFILE", "ci"))
