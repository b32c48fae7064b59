"""Shared test setup: a persistent checkpoint cache, hypothesis profiles sized for 2 CPU cores, and
the `one_thread` fixture."""

import os
from pathlib import Path

os.environ.setdefault("PARITY_CACHE", str(Path(__file__).resolve().parent.parent / ".venv" / "parity-cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
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


@pytest.fixture(scope="module")
def one_thread():
    """Run a module single-threaded (`pytestmark = pytest.mark.usefixtures("one_thread")`): the tiny
    models gain nothing from threads, and on a shared 2-core machine an OpenMP team waiting for a
    descheduled thread slows every op. Thread independence of the kernels has its own test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
