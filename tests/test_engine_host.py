"""Engine hosts (tests/engine_host.py): a proxy returns the engine's own bits and errors, and no host
outlives its session, however the session ends.

The bitwise tests compare a host's proxy with an engine of the same configuration in this process on
the same requests (rollout tokens and logprobs, scores: exact); the control is the same comparison on
requests with another seed, which must see a difference. The lifetime tests run a child pytest (this
directory's conftest as a plugin) that starts a host, then fails, is interrupted or is killed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import engine_host
import numpy as np
import psutil
import pytest
import torch
from procs import alive, cmdline

from parity.backends import Backend, get_backend, shared_backend
from parity.backends.weight_sync import checkpoint_weights
from parity.core.errors import ConfigError
from parity.core.types import Request, Rollout, SamplingParams

TESTS = Path(__file__).resolve().parent
PROMPTS = [[1, 150, 292, 92], [1, 45, 399, 173, 170, 291], [1, 314]]


def requests(seed: int) -> list[Request]:
    """Sampled (n=2) and greedy requests with per-request seeds from `seed`."""
    sampled = SamplingParams(temperature=1.0, max_tokens=12, n=2, seed=seed, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, seed=seed, ignore_eos=True)
    return [Request(request_id=f"r{i}", prompt_ids=tuple(p), sampling=sampled if i % 2 == 0 else greedy)
            for i, p in enumerate(PROMPTS)]


def same_bits(a: list[Rollout], b: list[Rollout]) -> bool:
    """Every rollout's ids, tokens and logprobs equal to the bit."""
    return len(a) == len(b) and all(
        (x.request_id, x.sample_index, x.token_ids) == (y.request_id, y.sample_index, y.token_ids)
        and np.array_equal(np.asarray(x.logprobs, dtype=np.float64), np.asarray(y.logprobs, dtype=np.float64))
        for x, y in zip(a, b))


def check_bits(proxy: Backend, local: Backend) -> None:
    want, got = local.generate(requests(7)), proxy.generate(requests(7))
    assert same_bits(got, want)
    assert not same_bits(proxy.generate(requests(8)), want)  # control: the check sees another seed's bits
    assert all(torch.equal(x, y) for x, y in zip(proxy.score(want), local.score(want)))


def test_a_reference_host_returns_the_engines_bits_and_errors():
    proxy = engine_host.proxy("reference", "tiny-llama", "float32")
    local = shared_backend("reference", "tiny-llama", dtype="float32")
    assert isinstance(proxy, Backend) and proxy.host[0] != os.getpid()
    assert (proxy.name, proxy.dtype, proxy.model_path) == (local.name, local.dtype, local.model_path)
    check_bits(proxy, local)
    with pytest.raises(ConfigError, match="logprobs_mode"):
        proxy.score(local.generate(requests(7)), logprobs_mode="bogus")
    with pytest.raises(ConfigError, match="shared by every worker"):
        proxy.update_weights([])
    # a module that owns the configuration pushes weights through `writable`; control: they change the bits
    assert engine_host.writable("reference", "tiny-llama", "float32") is proxy
    original = checkpoint_weights(proxy.model_path)["model.norm.weight"]
    proxy.update_weights([("model.norm.weight", original * 1.5)])
    assert not same_bits(proxy.generate(requests(7)), local.generate(requests(7)))
    proxy.update_weights([("model.norm.weight", original)])
    check_bits(proxy, local)
    with pytest.raises(AttributeError, match="not served by an engine host"):
        _ = proxy.llm
    assert engine_host.proxy("reference", "tiny-llama", "float32") is proxy
    # what a module whose options are its own calls at its end: the host goes, its engine with it
    process = psutil.Process(int(proxy.host[0]))
    assert engine_host.stop("reference", "tiny-llama", "float32") and not proxy.alive
    assert not alive(process)
    assert not engine_host.stop("reference", "tiny-llama", "float32")  # none runs now


def test_a_start_error_is_raised_in_the_caller_as_it_is():
    with pytest.raises(ConfigError, match="no-such"):
        engine_host.proxy("reference", "tiny-llama", "float32", device="no-such")


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_a_vllm_host_equals_the_engine_in_this_process_bitwise():
    """The host runs vLLM's engine core in its own process, this process's engine spawns it: same bits."""
    proxy = engine_host.proxy("vllm", "tiny-llama", "bfloat16")
    assert proxy.process[0] != os.getpid() and proxy.in_process_core
    check_bits(proxy, shared_backend("vllm", "tiny-llama"))


def test_an_engine_a_module_starts_itself_is_its_own():
    with get_backend("reference", "tiny-llama", dtype="float32") as engine:
        assert not isinstance(engine, engine_host.EngineProxy)


PROBE = """
import json, os, time
from pathlib import Path
import engine_host

def test_probe():
    proxy = engine_host.proxy("reference", "tiny-llama", "float32")
    Path(os.environ["PROBE_OUT"]).write_text(json.dumps({"host": proxy.host,
                                                         "dir": os.environ[engine_host.SESSION_ENV]}))
    if os.environ["PROBE_END"] == "fail":
        raise AssertionError("the probe fails on purpose")
    time.sleep(600)
"""


def wait_for_no_process_naming(text: str, timeout_s: float) -> list[str]:
    """The live processes whose command line holds `text`, once none is left or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [f"{p.pid} {line[:120]}" for p in psutil.process_iter() if text in (line := cmdline(p))]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("end", ["fail", "SIGINT", "SIGKILL"])
def test_no_host_outlives_its_session(end, tmp_path):
    """A child pytest owns a session and starts a host; it fails, gets Ctrl-C or is killed -9."""
    (tmp_path / "test_probe.py").write_text(textwrap.dedent(PROBE))
    out = tmp_path / "probe.json"
    env = {k: v for k, v in os.environ.items()
           if k != engine_host.SESSION_ENV and not k.startswith("PYTEST_")}
    env.update(PROBE_OUT=str(out), PROBE_END=end,
               PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS.parent), env.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:randomly",
                              "-p", "no:cacheprovider", str(tmp_path / "test_probe.py")],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not out.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert out.exists(), child.communicate(timeout=60)[0].decode()[-3000:]
        probe = json.loads(out.read_text())
        host = psutil.Process(int(probe["host"][0]))
        if end != "fail":
            child.send_signal(getattr(signal, end))
        child.wait(timeout=120)
        host.wait(timeout=30)  # psutil.TimeoutExpired: an orphan
        assert not psutil.pid_exists(host.pid) or host.status() == psutil.STATUS_ZOMBIE
        # nor the zygote that forked it (hosts and zygotes name the session directory on their command line)
        assert not wait_for_no_process_naming(probe["dir"], 30)
        if end != "SIGKILL":  # the owner's cleanup ran
            assert not Path(probe["dir"]).exists()
        shutil.rmtree(probe["dir"], ignore_errors=True)  # a killed owner leaves its (hostless) directory
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
