"""One case resolver (`parity.workload.cases.resolve_case`): a bare name in cases/ is taken by
every command and function that takes one case; and one model cache default for `make` and a
plain `parity` run."""

import re
from pathlib import Path

import pytest

import parity
from parity.cli import main
from parity.core.errors import ConfigError
from parity.models.checkpoints import cache_dir
from parity.workload.cases import load_case, resolve_case
from parity.workload.resolve import resolve_workload

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)  # bare names are looked up in ./cases, as the commands do


def test_a_bare_name_is_the_file_in_cases(in_repo):
    by_name = resolve_case("smoke")
    assert (by_name.name, by_name.hash) == ("smoke", load_case(ROOT / "cases" / "smoke.toml").hash)
    assert resolve_case(Path("cases/smoke.toml")).hash == by_name.hash and resolve_case(by_name) is by_name
    assert resolve_workload(None, "smoke", None, None).hash == by_name.hash  # what compare and audit read


def test_an_unknown_name_lists_the_names(in_repo):
    with pytest.raises(ConfigError, match=r"--case 'smok' is neither a case file nor a case name in "
                                          r"'cases'; give a .toml path or one of \[.*'smoke'"):
        resolve_case("smok", what="--case")
    with pytest.raises(ConfigError, match="neither a case file"):
        resolve_case("cases")  # a directory is not one case
    with pytest.raises(ConfigError, match="must be a Case"):
        resolve_case(3)


def test_compare_takes_a_case_name_as_audit_does(in_repo, capsys):
    """Both reach the backend check with the case read (it used to be 'cannot read case file')."""
    with pytest.raises(ConfigError, match=r"unknown.*'no-such-backend'"):
        parity.compare(None, "no-such-backend", case="smoke")
    # audit checks a backend's name before it reads the case: a bad dtype is refused after the read
    with pytest.raises(ConfigError, match="float8"):
        parity.audit(None, "reference", case="smoke", dtype="float8")
    assert main(["compare", "--case", "smoke", "--backend", "no-such-backend"]) == 2
    assert "unknown backend 'no-such-backend'" in capsys.readouterr().err


def _sets_cache(makefile: str) -> list[str]:
    return re.findall(r"^\s*(?:export\s+)?PARITY_CACHE\s*[:?+]?=.*$", makefile, flags=re.M)


def test_make_and_parity_share_one_model_cache(monkeypatch):
    """The Makefile leaves PARITY_CACHE alone, so `make demo` and a later `parity` run use the same
    default, ~/.cache/parity (README). Control: the line the Makefile used to have is caught."""
    assert _sets_cache((ROOT / "Makefile").read_text()) == []
    assert _sets_cache("export PARITY_CACHE ?= $(CURDIR)/.venv/parity-cache\n")
    monkeypatch.delenv("PARITY_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == Path.home() / ".cache" / "parity" / "models"
    assert "default `~/.cache/parity`" in (ROOT / "README.md").read_text()
