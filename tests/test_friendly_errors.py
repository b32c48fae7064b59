"""Bad input gets a message, not an exception class name (issue 40, items 9-12): a binary file, a
directory, a wrong model type, a closed pipe, a URL with a query string, terminal escape codes in a
case, and a case with text prompts whose other fields are wrong (reported before the tokenizer
loads)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import parity
from parity.backends.http import Endpoint
from parity.cli import main
from parity.core.errors import ConfigError, InputError
from parity.core.types import Request
from parity.scoring import score
from parity.workload.cases import Case, load_case

ROOT = Path(__file__).resolve().parent.parent


def test_a_binary_file_given_to_score_is_named(tmp_path, capsys) -> None:
    path = tmp_path / "batch.jsonl"
    path.write_bytes(b"PAR1\x00\x15\xff\xfe\x80 binary")
    with pytest.raises(
        InputError, match=r"batch.jsonl:1: not UTF-8 text .* give a JSONL file, or a Parquet file"
    ):
        score(path, "tiny-llama")
    assert main(["score", str(path), "--model", "tiny-llama"]) == 2
    err = capsys.readouterr().err
    assert "UnicodeDecodeError" not in err and "not UTF-8 text" in err


def test_a_directory_given_to_score_is_called_a_directory(tmp_path) -> None:
    with pytest.raises(InputError, match="is a directory; give a JSONL or Parquet file"):
        score(tmp_path, "tiny-llama")


@pytest.mark.parametrize("model", [123, 4.5, ["tiny-llama"]])
def test_compare_with_a_model_that_is_no_name_or_path(model) -> None:
    with pytest.raises(ConfigError, match="model must be a built-in model name or a checkpoint path"):
        parity.compare(model, "reference")


@pytest.mark.slow
def test_a_closed_pipe_ends_the_command_quietly() -> None:
    """`parity models | head -1`: no BrokenPipeError traceback, the shell's SIGPIPE status. The
    child writes more than a pipe buffers, so the closed pipe is certain to be hit."""
    child = ("import sys; from parity.cli import main; "
             "codes = {main(['models']) for _ in range(3000)}; sys.exit(141 if 141 in codes else 0)")
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader goes away
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141 and "BrokenPipeError" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/?token=Q", "http://127.0.0.1:8000/v1#frag"])
def test_a_server_url_with_a_query_or_fragment_is_refused(url) -> None:
    with pytest.raises(ConfigError, match="has a query string or fragment; give the server's base URL"):
        Endpoint.parse(url)
    assert Endpoint.parse("http://user:pw@127.0.0.1:8000/base").public == "http://127.0.0.1:8000/base"


def test_control_characters_in_a_case_name_or_description_are_refused(tmp_path) -> None:
    text = (ROOT / "cases" / "smoke.toml").read_text()
    for field in ("name", "description"):
        path = tmp_path / f"{field}.toml"
        lines = [line for line in text.splitlines() if not line.startswith(f"{field} =")]
        path.write_text(f'{field} = "evil\\u001b[2J"\n' + "\n".join(lines) + "\n")
        with pytest.raises(ConfigError, match=rf"{field}: contains the control character '\\x1b'"):
            load_case(path)
    with pytest.raises(ConfigError, match="case name contains the control character"):
        Case(name="x\x1b[2J", model="tiny-llama", requests=(Request((3, 4), request_id="a"),))


def test_a_text_case_is_validated_whole_before_its_tokenizer_loads(tmp_path, monkeypatch) -> None:
    """A type error in [sampling] is reported without loading the tokenizer (3.8 s here, 11-14 s
    under load on the old code)."""
    import parity.workload.prompts

    def no_tokenizer(*args, **kwargs):
        raise AssertionError("the tokenizer was loaded before the case was validated")

    monkeypatch.setattr(parity.workload.prompts, "tokenizer", no_tokenizer)
    path = tmp_path / "text.toml"
    path.write_text(
        'model = "tiny-llama"\n[prompts]\ntext = ["Hello there"]\n[sampling]\ntemperature = "hot"\n'
    )
    with pytest.raises(ConfigError, match="sampling"):
        load_case(path)
    path.write_text('model = "tiny-llama"\n[prompts]\ntext = ["Hello there"]\n[tolerance]\nbogus = 1\n')
    with pytest.raises(ConfigError, match="bogus"):
        load_case(path)
