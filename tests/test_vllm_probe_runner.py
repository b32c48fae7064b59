"""The probe's engine starts on vLLM's V1 model runner (issue 48.4: on the H200 vLLM 0.23 took its V2
runner for the dense Qwen3 shapes, whose input batch the probe cannot read). No engine starts here."""

import os

import pytest

from parity.backends.vllm_probe import V2_RUNNER, v1_runner
from parity.core.errors import ConfigError


def test_the_v1_runner_is_asked_for_during_the_start_and_the_variable_restored(monkeypatch):
    monkeypatch.delenv(V2_RUNNER, raising=False)
    with v1_runner():
        assert os.environ[V2_RUNNER] == "0"
    assert V2_RUNNER not in os.environ
    monkeypatch.setenv(V2_RUNNER, "0")
    with v1_runner():
        assert os.environ[V2_RUNNER] == "0"
    assert os.environ[V2_RUNNER] == "0"


def test_a_user_asking_for_v2_is_refused_naming_the_variable(monkeypatch):
    """Negative control: the variable is not overwritten when the user set V2."""
    monkeypatch.setenv(V2_RUNNER, "1")
    with pytest.raises(ConfigError, match=f"{V2_RUNNER}=1"), v1_runner():
        pass
    assert os.environ[V2_RUNNER] == "1"


def test_the_variable_is_restored_when_the_start_fails(monkeypatch):
    monkeypatch.setenv(V2_RUNNER, "false")
    with pytest.raises(RuntimeError), v1_runner():
        assert os.environ[V2_RUNNER] == "0"
        raise RuntimeError("engine failed")
    assert os.environ[V2_RUNNER] == "false"
