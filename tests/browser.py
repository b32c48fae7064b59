"""Headless Chromium for the HTML tests: load a page, count decoded images, collect console errors.

Shared by the report page test and the nightly page test. Tests skip with `needs_chromium` where
Debian's chromium is not installed (`make test` installs it).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"),
                             shutil.which("google-chrome")) if p), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed "
                                    "(apt-get install -y chromium, or `make test` installs it)")

#: Chromium prints page console messages (console.*, uncaught exceptions) as ":CONSOLE" log lines
CONSOLE_LINE = re.compile(r":CONSOLE[:(]")
#: added to a copy of a page only (parity's pages have no scripts): after load, writes
#: "<decoded images>/<images>" into body's data-plots attribute, which --dump-dom shows
PROBE = ("<script>window.addEventListener('load', () => { const imgs = [...document.images]; "
         "document.body.dataset.plots = imgs.filter(i => i.complete && i.naturalWidth > 0).length "
         "+ '/' + imgs.length; });</script>")
PLOTS = re.compile(r'data-plots="(\d+)/(\d+)"')


def chromium(page: Path, tmp_path: Path, *args: str,
             timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run headless Chromium on `page` with a fresh profile under `tmp_path` (flags as root needs them)."""
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000",
           *args, page.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def console_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    """The page's console messages in a Chromium run's log."""
    return [line for line in result.stderr.splitlines() if CONSOLE_LINE.search(line)]


def decoded_images(page: Path, tmp_path: Path) -> tuple[int, int, list[str]]:
    """(decoded images, images, console lines) of `page`, loaded through a probed copy of it."""
    probe = tmp_path / f"probe-{page.name}"
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"), encoding="utf-8")
    dom = chromium(probe, tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    found = PLOTS.search(dom.stdout)
    assert found, "the probe did not run: no data-plots attribute in the DOM"
    return int(found[1]), int(found[2]), console_lines(dom)
