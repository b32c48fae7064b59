"""The house's unwritten rules as checks: every top-level entry of parity/ on exactly one layer of the top
import-linter contract, the light modules in the light contract, a reason beside every function-local
import, and the old module paths served (with one DeprecationWarning) by the modules at their new homes."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "parity"
CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
#: modules that import no torch today and must stay so (issue 45): the light contract lists them.
LIGHT = ("parity.workload.resolve", "parity.workload.tools", "parity.engine.scheduler",
         "parity.runtime.guard", "parity.backends.http", "parity.backends.vllm_settings",
         "parity.backends.turns", "parity.parallel.wire", "parity.kernels.switch")


def top_entries() -> set[str]:
    """Every module and package directly under parity/ but its __init__."""
    return {p.stem for p in PACKAGE.iterdir()
            if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}


def contract(name_start: str) -> dict:
    return next(c for c in CONTRACTS if c["name"].startswith(name_start))


def test_every_top_level_entry_is_on_exactly_one_layer():
    layers = contract("Layers point one way")["layers"]
    named = [m.strip() for layer in layers for m in layer.split("|")]
    assert sorted(named) == sorted(set(named)), "an entry is on two layers"
    assert set(named) == top_entries()


def test_the_entrance_hall_holds_at_most_28_entries():
    assert len(top_entries()) + 1 <= 28  # + __init__.py


def test_the_light_modules_are_in_the_light_contract():
    light = contract("Light modules never load an engine")["source_modules"]
    assert set(LIGHT) <= set(light)
    for module in light:  # every name in the contract exists (a moved module is not silently dropped)
        path = ROOT / Path(*module.split("."))
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), module


def _reasoned(lines: list[str], node: ast.stmt) -> bool:
    """A comment on the import's own lines, or on the run of comment / import / `try:` lines just above it."""
    if any("#" in line for line in lines[node.lineno - 1:node.end_lineno]):
        return True
    i = node.lineno - 2
    while i >= 0:
        text = lines[i].strip()
        if text.startswith("#") or "  # " in text:
            return True
        if text and not (text.startswith(("import ", "from ")) or text == "try:"):
            return False
        i -= 1
    return False


def function_local_imports_without_a_reason(paths: list[Path]) -> list[str]:
    missing = []
    for path in paths:
        source = path.read_text()
        lines = source.splitlines()
        for fn in ast.walk(ast.parse(source)):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                missing += [f"{path}:{node.lineno}" for node in ast.walk(fn)
                            if isinstance(node, ast.Import | ast.ImportFrom) and not _reasoned(lines, node)]
    return missing


def test_every_function_local_import_says_why():
    assert function_local_imports_without_a_reason(sorted(PACKAGE.rglob("*.py"))) == []


def test_the_reason_check_fails_on_an_import_without_one(tmp_path):
    """Negative control: the check finds a bare function-local import."""
    bare = tmp_path / "bare.py"
    bare.write_text("def f():\n    x = 1\n    import json\n    return json, x\n")
    reasoned = tmp_path / "reasoned.py"
    reasoned.write_text("def f():\n    import json  # only on this path\n    return json\n")
    assert function_local_imports_without_a_reason([bare, reasoned]) == [f"{bare}:3"]


@pytest.mark.parametrize(("old", "new"), [
    ("parity.types", "parity.core.types"), ("parity.tolerance", "parity.drift.tolerance"),
    ("parity.metrics", "parity.drift.metrics"), ("parity.dumps", "parity.rollouts.dumps"),
    ("parity.record", "parity.rollouts.record"), ("parity.cases", "parity.workload.cases"),
])
@pytest.mark.slow
def test_an_old_module_path_warns_once_and_is_the_new_module(old, new):
    code = (f"import warnings; warnings.simplefilter('always')\n"
            f"with warnings.catch_warnings(record=True) as seen:\n"
            f"    import {old} as a\n    import {old} as b\n    from {old} import __name__ as name\n"
            f"import {new} as c\n"
            f"assert a is b is c and name == {new!r}, (a, c)\n"
            f"moved = [w for w in seen if issubclass(w.category, DeprecationWarning)\n"
            f"         and {old!r} in str(w.message)]\n"
            f"assert len(moved) == 1 and {new!r} in str(moved[0].message), [str(w.message) for w in seen]\n"
            f"assert moved[0].filename == '<string>', moved[0].filename\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                            check=False)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_report_path_is_the_report_wing():
    from parity.report import ParityReport
    from parity.report.document import ParityReport as document_report

    assert ParityReport is document_report
