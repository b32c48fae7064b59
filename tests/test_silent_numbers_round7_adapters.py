"""Round 7, adapters and case-file paths: one spelling never silently means two adapters or two
checkpoints, and an empty --model never falls back to another model."""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path
from typing import Any

import pytest

from parity.attribute import command as attribute_command
from parity.core.errors import AdapterError, ConfigError
from parity.engine.engine import EngineConfig
from parity.models import builtin_path
from parity.models.lora import check_adapter, resolve_adapter
from parity.models.lora_builtins import builtin_adapter_path
from parity.workload.cases import load_case

lifecycle_command = importlib.import_module("parity.audit.lifecycle_command")  # parity.audit is a function

NAME = "tiny-llama-lora-r8"
PROMPTS = '[prompts]\ntoken_ids = [[5, 6, 7]]\n[sampling]\nmax_tokens = 4\n'


@pytest.fixture
def own_adapter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding ./tiny-llama-lora-r8: the user's adapter (rank 64, another one)."""
    builtin_adapter_path(NAME)
    shutil.copytree(builtin_adapter_path("tiny-llama-lora-r64"), tmp_path / NAME)
    monkeypatch.chdir(tmp_path)
    return tmp_path / NAME


def test_a_builtin_adapter_name_that_is_also_a_folder_here_is_refused(own_adapter: Path) -> None:
    with pytest.raises(AdapterError, match=r"both a built-in adapter's name and .*give '\./tiny-llama-lora"):
        resolve_adapter(NAME)  # was: the built-in rank-8 adapter, the user's folder ignored


def test_a_path_spelled_like_an_adapter_name_is_a_path(own_adapter: Path) -> None:
    for spelled in (Path(NAME), "./" + NAME):
        spec = check_adapter(spelled, "tiny-llama")
        assert spec.path.resolve() == own_adapter.resolve() and spec.rank == 64  # was: the built-in, r=8
        assert str(spec.path) != NAME  # its text, read again (engines, the loop), stays this path


def test_a_folder_that_is_no_adapter_does_not_shadow_the_name(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / NAME).mkdir()  # no adapter_config.json: nobody means it as an adapter
    monkeypatch.chdir(tmp_path)
    assert resolve_adapter(NAME) == builtin_adapter_path(NAME)
    monkeypatch.chdir(tmp_path / NAME)  # no ./tiny-llama-lora-r8 here
    with pytest.raises(AdapterError, match="give the string 'tiny-llama-lora-r8'"):
        resolve_adapter(Path(NAME))  # a Path never falls back to the built-in (it used to)


def test_an_empty_lora_is_not_the_working_directory(own_adapter: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(own_adapter)  # the working directory is an adapter: "" used to pick it
    with pytest.raises(AdapterError, match="lora is empty"):
        resolve_adapter("")
    assert resolve_adapter(".").resolve() == own_adapter.resolve()


def test_engine_config_keeps_a_path_lora_a_path(own_adapter: Path) -> None:
    assert EngineConfig(lora=Path(NAME)).lora == "./" + NAME  # was "tiny-llama-lora-r8": the built-in


def _case(folder: Path, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "c.toml").write_text(body + PROMPTS)
    return folder / "c.toml"


def test_case_lora_name_with_an_adapter_folder_beside_the_case_is_refused(tmp_path: Path) -> None:
    shutil.copytree(builtin_adapter_path("tiny-llama-lora-r64"), tmp_path / "cases" / NAME)
    path = _case(tmp_path / "cases", f'model = "tiny-llama"\nlora = "{NAME}"\n')
    with pytest.raises(ConfigError, match=r"lora: 'tiny-llama-lora-r8' is both .* beside the case file"):
        load_case(path)
    path.write_text(f'model = "tiny-llama"\nlora = "./{NAME}"\n' + PROMPTS)
    assert check_adapter(load_case(path).lora, "tiny-llama").rank == 64


def test_case_lora_dot_slash_in_the_working_directory_stays_the_folder(own_adapter: Path) -> None:
    _case(own_adapter.parent, f'model = "tiny-llama"\nlora = "./{NAME}"\n')
    case = load_case("c.toml")  # relative case path: its folder is "."
    assert case.lora != NAME  # was "tiny-llama-lora-r8": "./" lost, the built-in rank-8 adapter ran
    assert check_adapter(case.lora, "tiny-llama").rank == 64


def test_case_lora_empty_is_refused(tmp_path: Path) -> None:
    shutil.copytree(builtin_adapter_path(NAME), tmp_path / "cases")  # the case's folder is an adapter
    path = _case(tmp_path / "cases", 'model = "tiny-llama"\nlora = ""\n')
    with pytest.raises(ConfigError, match="lora: is empty"):
        load_case(path)  # was: the case file's own folder as the adapter


@pytest.fixture
def two_places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """cases/ckpt (tiny-llama's weights) beside the case file, run/ckpt (tiny-qwen2's) where it runs."""
    shutil.copytree(builtin_path("tiny-llama"), tmp_path / "cases" / "ckpt")
    shutil.copytree(builtin_path("tiny-qwen2"), tmp_path / "run" / "ckpt")
    monkeypatch.chdir(tmp_path / "run")
    return tmp_path / "cases", tmp_path / "run"


def test_case_model_relative_path_meaning_two_checkpoints_is_refused(two_places: tuple[Path, Path]) -> None:
    cases, _ = two_places
    path = _case(cases, 'model = "ckpt"\n')
    with pytest.raises(ConfigError, match=r"model: 'ckpt' is read from the working directory .*another "
                                          r"checkpoint .*absolute path .*\./"):
        load_case(path)  # was: run/ckpt silently, while lora and datasets read from cases/
    path.write_text('model = "./ckpt"\n' + PROMPTS)  # "./": the working directory's, explicitly
    assert load_case(path).model == "./ckpt"
    path.write_text(f'model = "{cases / "ckpt"}"\n' + PROMPTS)
    assert load_case(path).model == str(cases / "ckpt")


def test_case_model_same_checkpoint_in_both_places_is_accepted(two_places: tuple[Path, Path]) -> None:
    cases, run = two_places
    shutil.rmtree(run / "ckpt")
    shutil.copytree(cases / "ckpt", run / "ckpt")  # a copy: the same weights either way
    assert load_case(_case(cases, 'model = "ckpt"\n')).model == "ckpt"
    assert load_case(_case(run, 'model = "ckpt"\n')).model == "ckpt"  # the case's folder is the cwd


def test_case_model_name_with_a_checkpoint_folder_beside_the_case_is_refused(
        two_places: tuple[Path, Path]) -> None:
    cases, _ = two_places
    (cases / "ckpt").rename(cases / "tiny-qwen2")  # tiny-llama's weights, named like the built-in tiny-qwen2
    with pytest.raises(ConfigError, match="model: 'tiny-qwen2' is read from the working directory"):
        load_case(_case(cases, 'model = "tiny-qwen2"\n'))


def _no_engine(*args: Any, **kwargs: Any) -> None:
    raise AssertionError(f"an engine started with {args!r}")


@pytest.mark.parametrize("argv", [["--model", ""], ["--model", "", "--case", "smoke"],
                                  ["--model", "", "--backend", "vllm"]])
def test_attribute_refuses_an_empty_model(argv: list[str], monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("parity.engine.ReferenceEngine", _no_engine)
    monkeypatch.setattr("parity.attribute.probe.engine_diff", _no_engine)
    assert attribute_command.main(argv) == 2  # was: tiny-llama's ablation without --case
    assert "--model is empty" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--model", ""], ["--model", "", "--case", "smoke"]])
def test_lifecycle_refuses_an_empty_model(argv: list[str], monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(lifecycle_command, "get_backend", _no_engine)
    assert lifecycle_command.main(["--backend", "vllm", *argv]) == 2
    assert "--model is empty" in capsys.readouterr().err  # was: "needs --model" / "not model ''"
