"""Round 7, model and workload resolution: one spelling never silently means two checkpoints,
tokenizers, cases or sampling settings."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from parity.core.errors import ConfigError, ModelNotFoundError, ParityError
from parity.models import builtin_path, check_sampled_with, model_hash, resolve_model
from parity.report.provenance import provenance
from parity.workload.cases import default_case, load_case, load_cases, resolve_case
from parity.workload.prompts import tokenizer
from parity.workload.resolve import check_case_model, resolve_workload

CASE = 'model = "tiny-llama"\n[prompts]\ntoken_ids = [[5, 6, 7]]\n[sampling]\nmax_tokens = {}\n'


@pytest.fixture
def shadow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding ./tiny-llama: a complete checkpoint with other weights (tiny-qwen2's)."""
    builtin_path("tiny-llama")
    shutil.copytree(builtin_path("tiny-qwen2"), tmp_path / "tiny-llama")
    monkeypatch.chdir(tmp_path)
    return tmp_path / "tiny-llama"


def test_a_name_that_is_also_a_checkpoint_directory_here_is_refused(shadow: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"both a model name and .*give '\./tiny-llama'"):
        resolve_model("tiny-llama")
    # a path says the directory: "./name" or any os.PathLike
    assert resolve_model("./tiny-llama").resolve() == shadow.resolve()
    assert resolve_model(Path("tiny-llama")).resolve() == shadow.resolve()
    assert model_hash(resolve_model(Path("tiny-llama"))) != model_hash(builtin_path("tiny-llama"))


def test_a_directory_that_is_the_builtin_itself_is_no_ambiguity(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tiny-llama").symlink_to(builtin_path("tiny-llama"), target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("tiny-llama").resolve() == builtin_path("tiny-llama").resolve()


def test_a_path_spelled_like_a_name_is_a_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no ./tiny-llama here: a Path must not fall back to the built-in
    with pytest.raises(ModelNotFoundError, match="give the string 'tiny-llama'"):
        resolve_model(Path("tiny-llama"))
    assert resolve_model("tiny-llama") == builtin_path("tiny-llama")


def test_an_empty_model_is_not_the_working_directory(shadow: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(shadow)  # the working directory is a checkpoint: "" used to pick it
    with pytest.raises(ModelNotFoundError, match="model is empty"):
        resolve_model("")
    assert resolve_model(".").resolve() == shadow.resolve()


def test_a_case_file_naming_a_shadowed_model_is_refused_at_its_field(shadow: Path) -> None:
    path = shadow.parent / "mine.toml"
    path.write_text(CASE.format(8))
    with pytest.raises(ConfigError, match=r"mine\.toml: model: .*both a model name.*'\./tiny-llama'"):
        load_case(path)


def test_a_path_workload_keeps_its_path(shadow: Path) -> None:
    case = resolve_workload(Path("tiny-llama"), None, [[5, 6, 7]], None)
    assert case.model == os.path.join(os.curdir, "tiny-llama")  # not "tiny-llama": the built-in's name
    assert resolve_model(case.model).resolve() == shadow.resolve()
    assert default_case_model(Path("tiny-llama")) == case.model


def default_case_model(model: Path) -> str:
    return resolve_workload(model, None, None, None).model


def test_a_path_is_not_the_case_named_by_the_same_spelling(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    builtin = default_case("tiny-llama")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"names model 'tiny-llama', not model '\./tiny-llama'"):
        check_case_model(Path("tiny-llama"), builtin)
    check_case_model(str(builtin_path("tiny-llama")), builtin)  # the built-in's own directory is it
    shutil.copytree(builtin_path("tiny-qwen2"), tmp_path / "tiny-llama")
    for model in (Path("tiny-llama"), str(builtin_path("tiny-llama"))):  # the case's name is ambiguous here
        with pytest.raises(ModelNotFoundError, match="both a model name"):
            check_case_model(model, builtin)


def test_rollouts_of_the_builtin_are_not_scored_with_a_directory_of_its_name(shadow: Path) -> None:
    with pytest.raises(ConfigError, match="is not the model the rollouts were sampled with"):
        check_sampled_with(Path("tiny-llama"), name="tiny-llama")
    with pytest.raises(ConfigError, match="is not the model the rollouts were sampled with"):
        check_sampled_with("./tiny-llama", name="tiny-llama")
    check_sampled_with(Path("tiny-llama"), name="./tiny-llama")


def test_provenance_writes_a_directory_spelled_like_a_name_as_a_path(shadow: Path) -> None:
    prov = provenance("./tiny-llama", backend="reference", backend_meta={}, dtype="float32", device="cpu",
                      reference="invariant", router_replay=None, seeds=[0], case="c", case_hash="h",
                      rollout_logprobs="r")
    assert prov["model"] == os.path.join(os.curdir, "tiny-llama")  # read back, "tiny-llama" is the built-in
    assert prov["model_hash"] == model_hash(shadow)


def test_a_sampling_dict_overrides_the_same_defaults_as_no_sampling() -> None:
    ids = [[5, 6, 7]]
    none = resolve_workload("tiny-llama", None, ids, None).requests[0].sampling
    given = resolve_workload("tiny-llama", None, ids, {"n": 2}).requests[0].sampling
    assert (none.max_tokens, given.max_tokens, given.n) == (32, 32, 2)
    assert resolve_workload("tiny-llama", None, ids, {"max_tokens": 8}).requests[0].sampling.max_tokens == 8
    with pytest.raises(ParityError, match="bogus"):
        resolve_workload("tiny-llama", None, ids, {"bogus": 1})


def _other_tokenizer(where: Path) -> None:
    """A copy of the built-in tokenizer with the ids of "H" and "e" swapped."""
    where.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin_path("tiny-llama") / name, where / name)
    (where / "model.safetensors").write_bytes(b"")
    data = json.loads((where / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab["H"], vocab["e"] = vocab["e"], vocab["H"]
    (where / "tokenizer.json").write_text(json.dumps(data))


def test_a_relative_tokenizer_path_is_not_served_from_another_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a").mkdir()
    shutil.copytree(builtin_path("tiny-llama"), tmp_path / "a" / "ck")
    _other_tokenizer(tmp_path / "b" / "ck")
    monkeypatch.chdir(tmp_path / "a")
    first = tokenizer("ck")("He")["input_ids"]
    monkeypatch.chdir(tmp_path / "b")
    second = tokenizer("ck")("He")["input_ids"]
    assert second == first[::-1]  # b's tokenizer, not a's from the cache


def test_a_tokenizer_rewritten_in_place_is_read_again(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(builtin_path("tiny-llama"), ck)
    first = tokenizer(str(ck))("He")["input_ids"]
    shutil.rmtree(ck)
    _other_tokenizer(ck)
    os.utime(ck / "tokenizer.json", ns=(1, 1))  # a new mtime even on a coarse clock
    assert tokenizer(str(ck))("He")["input_ids"] == first[::-1]


@pytest.fixture
def cases_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "cases").mkdir()
    (tmp_path / "cases" / "smoke.toml").write_text(CASE.format(8))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_case_name_that_is_also_a_directory_here_is_refused(cases_here: Path) -> None:
    (cases_here / "smoke").mkdir()
    (cases_here / "smoke" / "other.toml").write_text(CASE.format(99))
    with pytest.raises(ConfigError, match=r"--cases 'smoke' is both the case name of .*'\./smoke'"):
        load_cases("smoke")
    assert [c.requests[0].sampling.max_tokens for c in load_cases("./smoke")] == [99]
    assert [c.requests[0].sampling.max_tokens for c in load_cases("cases/smoke.toml")] == [8]
    assert resolve_case("smoke").requests[0].sampling.max_tokens == 8  # one case: a directory is none


def test_a_case_name_that_is_also_a_file_here_is_refused(cases_here: Path) -> None:
    (cases_here / "smoke").write_text(CASE.format(99))
    with pytest.raises(ConfigError, match=r"case 'smoke' is both the case name of .*'\./smoke'"):
        resolve_case("smoke")
    assert resolve_case("./smoke").requests[0].sampling.max_tokens == 99
    assert resolve_case(Path("smoke")).requests[0].sampling.max_tokens == 99  # a Path is a path
