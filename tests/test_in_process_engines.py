"""The test suite's in-process engine cores (tests/conftest.py): an offline vLLM engine an
`own_engines` test starts runs vLLM's core and model in the test process, one at a time, and leaves
the process as it found it (its thread setter, global generators and vLLM's reading of VLLM_*
variables)."""

import importlib.util
import multiprocessing
import random

import numpy as np
import pytest
import torch

from parity.backends import get_backend
from parity.core.types import Request, SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.own_engines, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
              pytest.mark.skipif(torch.cuda.is_available(), reason="CPU hosts only (see tests/conftest.py)")]

REQUEST = Request((3, 4, 5, 6), SamplingParams(max_tokens=4, seed=1), "r")


def engine_children() -> list[str]:
    return [p.name for p in multiprocessing.active_children()
            if p.name.startswith(("EngineCore", "VllmWorker"))]


def test_an_own_engine_runs_in_this_process_and_leaves_it_as_it_was(monkeypatch):
    set_num_threads = torch.set_num_threads
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    expected = random.random(), np.random.rand(), torch.rand(1)
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    with get_backend("vllm", "tiny-llama", dtype="bfloat16") as first:
        import vllm.envs

        assert engine_children() == []  # no engine core process: the core runs here
        assert torch.set_num_threads is set_num_threads  # vLLM's CPU worker had replaced it
        assert (random.random(), np.random.rand(), torch.rand(1)) == expected  # vLLM had seeded them
        # vLLM reads its variables afresh again (its core had cached them: a later engine here would
        # have started with this one's, its core in this process whatever the variable said)
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        assert vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING
        monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
        tokens = first.generate([REQUEST])[0].token_ids
    # the first closed: the next one runs here again, with the same numbers
    with get_backend("vllm", "tiny-llama", dtype="bfloat16") as again:
        assert engine_children() == []
        assert again.generate([REQUEST])[0].token_ids == tokens


@pytest.mark.own_engine(reason="starts a core in this process by hand, then counts the next one's processes")
def test_an_engine_reads_the_variables_afresh_after_one_ran_in_this_process(monkeypatch):
    """vLLM's engine core caches every VLLM_* variable of the process it starts in; parity's adapter
    reads them afresh for the next engine (else a `batch_invariant` parity sets would be ignored while
    its provenance says it is on). The variable that shows it: the second engine's core process (the
    cache lives while the first engine runs)."""
    set_num_threads = torch.set_num_threads
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with get_backend("vllm", "tiny-llama", dtype="bfloat16"):
        assert engine_children() == []
        assert torch.set_num_threads is set_num_threads  # the adapter gives back what vLLM replaced
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        with get_backend("vllm", "tiny-llama", dtype="bfloat16"):
            assert [name.split("_")[0] for name in engine_children()] == ["EngineCore"], engine_children()
