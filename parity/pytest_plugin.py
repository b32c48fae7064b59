"""pytest plugin (entry point `pytest11: parity`): the `parity` marker and fixtures.

`@pytest.mark.parity(model=..., backend=..., tolerance=...)` with `parity_report`; fixtures
`parity_backend`, `parity_compare`, `parity_report`; options `--parity-backend`, `--parity-model`,
`--parity-report-dir`, `--parity-verbose`. A missing backend package skips. Imported by every
pytest run of a project with parity installed, so only light layers (no torch, no matplotlib).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import pytest

from parity.backends import Backend, available_backends, close_shared_backends, shared_backend
from parity.compare import compare
from parity.core.errors import BackendUnavailableError
from parity.render import report_html
from parity.report.document import ParityReport
from parity.runtime.quiet import engine_logging
from parity.testing import failure_message

DEFAULT_BACKEND = "reference"
DEFAULT_MODEL = "tiny-llama"
DEFAULT_DTYPE = "bfloat16"

_REPORT_KEY = pytest.StashKey["ParityReport"]()
_HTML_KEY = pytest.StashKey[Path]()
_MARKER_ARGS = ("model", "backend", "case", "tolerance")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("parity", "train/infer logprob parity")
    group.addoption("--parity-backend", default=None, metavar="NAME",
                    help=f"backend for parity tests that name none (default: {DEFAULT_BACKEND})")
    group.addoption("--parity-model", default=None, metavar="MODEL",
                    help=f"model for parity tests that name none (default: {DEFAULT_MODEL})")
    group.addoption("--parity-report-dir", default=None, metavar="DIR",
                    help="write the HTML report of every parity comparison into DIR")
    group.addoption("--parity-verbose", action="store_true", default=False,
                    help="show the engines' log lines (vLLM's INFO); default: errors only")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("parity_verbose", default=False):
        engine_logging(verbose=True)  # quiet needs no call: the engine adapters default to it
    config.addinivalue_line(
        "markers",
        "parity(model=None, backend=None, case=None, tolerance=None, **options): compare the "
        "backend's rollout logprobs with the training forward's and fail the test when the "
        "tolerance does not hold; other keywords go to parity.compare",
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Close the session's shared engines while pytest's streams are open (at atexit vLLM logs into
    closed streams).
    """
    close_shared_backends()


def _defaults(config: pytest.Config) -> tuple[str, str]:
    backend = config.getoption("--parity-backend") or DEFAULT_BACKEND
    model = config.getoption("--parity-model") or DEFAULT_MODEL
    return backend, model


def _skip_if_unavailable(backend: str | Backend) -> None:
    if not isinstance(backend, str):
        return

    reason = available_backends().get(backend)
    if reason is not None:
        pytest.skip(f"parity: {reason}")


def _report_path(config: pytest.Config, nodeid: str) -> Path | None:
    """A fresh HTML path for `nodeid` under --parity-report-dir (None when the option is unset)."""
    root = config.getoption("--parity-report-dir")
    if not root:
        return None
    directory = Path(root)
    directory.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_") or "parity"
    path, n = directory / f"{stem}.html", 1
    while path.exists():
        n += 1
        path = directory / f"{stem}-{n}.html"
    return path


def _run(config: pytest.Config, nodeid: str, model: str | None, backend: str | Backend | None,
         **kwargs: Any) -> tuple[ParityReport, Path | None]:
    """Run `parity.compare` with the session defaults; returns the report and its HTML path."""

    default_backend, default_model = _defaults(config)
    backend = backend if backend is not None else default_backend
    _skip_if_unavailable(backend)
    if model is None and kwargs.get("case") is None:
        # a running backend already fixes the model; otherwise the session default applies
        model = default_model if isinstance(backend, str) else str(backend.model_path)
    try:
        report = compare(model, backend, **kwargs)
    except BackendUnavailableError as exc:
        pytest.skip(f"parity: {exc}")
    path = _report_path(config, nodeid)
    if path is not None:
        path.write_text(report_html(report), encoding="utf-8")
    return report, path


@pytest.fixture(scope="session")
def parity_backend(pytestconfig: pytest.Config) -> Backend:
    """The `--parity-backend` engine on `--parity-model` (bfloat16), started once per session."""
    name, model = _defaults(pytestconfig)
    _skip_if_unavailable(name)

    return shared_backend(name, model, dtype=DEFAULT_DTYPE)


@pytest.fixture
def parity_compare(request: pytest.FixtureRequest) -> Callable[..., ParityReport]:
    """`parity.compare(model=None, backend=None, **kwargs)` with the command-line defaults; writes the
    HTML report when asked, asserts nothing.
    """

    def run(model: str | None = None, backend: str | Backend | None = None, **kwargs: Any) -> ParityReport:
        return _run(request.config, request.node.nodeid, model, backend, **kwargs)[0]

    return run


@pytest.fixture(autouse=True)
def _parity_marker(request: pytest.FixtureRequest) -> None:
    """Runs the comparison of a `parity`-marked test during its setup (skips happen there)."""
    marker = request.node.get_closest_marker("parity")
    if marker is None:
        return
    if marker.args:
        raise pytest.UsageError(f"{request.node.nodeid}: the parity marker takes keywords only "
                                f"({', '.join(_MARKER_ARGS)}, ...), got positional {marker.args!r}")
    kwargs = dict(marker.kwargs)
    report, path = _run(request.config, request.node.nodeid, kwargs.pop("model", None),
                        kwargs.pop("backend", None), **kwargs)
    request.node.stash[_REPORT_KEY] = report
    if path is not None:
        request.node.stash[_HTML_KEY] = path


@pytest.fixture
def parity_report(request: pytest.FixtureRequest, _parity_marker: None) -> ParityReport:
    """The report of this test's `parity` marker."""
    if _REPORT_KEY not in request.node.stash:
        raise pytest.UsageError(f"{request.node.nodeid}: parity_report needs @pytest.mark.parity(...) "
                                "on the test; use parity_compare to run a comparison yourself")
    return request.node.stash[_REPORT_KEY]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """After a marked test's body, fail it when its comparison did not pass."""
    result = yield
    report = item.stash.get(_REPORT_KEY, None)
    if report is not None and not report.passed:

        message = failure_message(report, report.violations)
        if _HTML_KEY in item.stash:
            message += f"\nHTML report: {item.stash[_HTML_KEY]}"
        pytest.fail(message, pytrace=False)
    return result
