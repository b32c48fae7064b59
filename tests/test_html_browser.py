"""The HTML report in a real browser: headless Chromium loads it without console errors, every
plot decodes, and a screenshot shows them. Skipped when Chromium is not installed.

The screenshot stays in pytest's tmp_path (the last runs are kept under
/tmp/pytest-of-$USER/), for a person to look at.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from test_report import make_report

CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"),
                             shutil.which("google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed "
                                "(apt-get install -y chromium, or `make test` installs it)")

#: Chromium prints page console messages (console.*, uncaught exceptions) as ":CONSOLE" log lines
CONSOLE_LINE = re.compile(r":CONSOLE[:(]")
#: added to a copy of the page only: the report itself has no scripts
PROBE = ("<script>window.addEventListener('load', () => { const imgs = [...document.images]; "
         "document.body.dataset.plots = imgs.filter(i => i.complete && i.naturalWidth > 0).length "
         "+ '/' + imgs.length; });</script>")


def chromium(page: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000",
           *args, page.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def console_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if CONSOLE_LINE.search(line)]


def test_console_detection_catches_a_broken_page(tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><script>undefinedFunction();</script></body></html>")
    assert console_lines(chromium(bad, tmp_path, "--dump-dom"))


def test_report_opens_without_console_errors_and_shows_its_plots(tmp_path):
    report = make_report(scale=0.3, rows=16, width=48)
    page = tmp_path / "report.html"
    page.write_text(report.to_html(), encoding="utf-8")

    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"), encoding="utf-8")
    dom = chromium(probe, tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'data-plots="3/3"' in dom.stdout, "not every plot image decoded"
    assert console_lines(dom) == []

    shot = tmp_path / "report.png"
    result = chromium(page, tmp_path, f"--screenshot={shot}", "--window-size=1500,1800",
                      "--hide-scrollbars")
    assert result.returncode == 0, result.stderr[-2000:]
    assert console_lines(result) == []
    from matplotlib.image import imread

    pixels = imread(str(shot))[..., :3]
    assert pixels.shape[:2] == (1800, 1500)
    # the histogram bars are the plots' blue (#1f77b4): a page whose images failed has none
    blue = np.all(np.abs(pixels - np.array([0x1F, 0x77, 0xB4]) / 255) < 0.08, axis=-1)
    assert blue.sum() > 2000
