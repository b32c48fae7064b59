"""`python3 -m benchmarks.loop --option`: a backend option reaches the loop's backend (here a
refusal that comes before any engine starts)."""

import pytest

from benchmarks.loop import main
from parity.core.errors import ConfigError


def test_an_option_without_its_backend_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--option", "weight_transfer=ipc"])
    assert "expected BACKEND.KEY=VALUE" in capsys.readouterr().err


def test_a_vllm_option_reaches_the_vllm_backend():
    pytest.importorskip("vllm")
    # weight_transfer="ipc" is refused on the CPU build before its engine starts: the refusal proves
    # the option arrived (without it this loop would start vLLM-CPU and run)
    with pytest.raises(ConfigError, match=r"weight_transfer='ipc'.*on CPU use weight_transfer='reload'"):
        main(["--model", "tiny-llama", "--backends", "reference,vllm", "--steps", "1", "--prompts", "1",
              "--n", "2", "--max-tokens", "2", "--option", "vllm.weight_transfer=ipc"])
