"""The HTML report in a real browser: headless Chromium loads it without console errors, every
plot decodes, and a screenshot shows them. Skipped when Chromium is not installed.

The screenshot stays in pytest's tmp_path (the last runs are kept under
/tmp/pytest-of-$USER/), for a person to look at.
"""

from __future__ import annotations

import numpy as np
import pytest
from browser import chromium, console_lines, decoded_images, needs_chromium
from test_report import make_report

from parity.render import report_html

pytestmark = [needs_chromium, pytest.mark.slow]  # every test starts headless Chromium


def test_console_detection_catches_a_broken_page(tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><script>undefinedFunction();</script></body></html>")
    assert console_lines(chromium(bad, tmp_path, "--dump-dom"))


def test_report_opens_without_console_errors_and_shows_its_plots(tmp_path):
    report = make_report(scale=0.3, rows=16, width=48)
    page = tmp_path / "report.html"
    page.write_text(report_html(report), encoding="utf-8")

    loaded, total, console = decoded_images(page, tmp_path)
    assert (loaded, total) == (3, 3), "not every plot image decoded"
    assert console == []

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


def test_advice_section_opens_in_chromium(tmp_path):
    """The correction advisor's section (recommendation, reason, config to paste, candidates
    table) is in the DOM Chromium builds from the page, without console errors."""
    report = make_report(scale=0.3, rows=16, width=48)
    page = tmp_path / "report.html"
    page.write_text(report_html(report), encoding="utf-8")
    result = chromium(page, tmp_path, "--dump-dom")
    assert result.returncode == 0 and console_lines(result) == []
    dom = result.stdout
    name = report.extras["advice"]["recommendation"]["name"]
    assert 'id="advice"' in dom and f"Recommended: {name}" in dom
    assert "rollout_correction:" in dom and dom.count('class="chosen"') >= 1


def test_monitor_page_opens_without_console_errors_and_shows_its_charts(tmp_path):
    """A monitored run's page: every trend chart and the position chart decode, no console error."""
    import parity

    rng = np.random.default_rng(0)
    with parity.Monitor(tmp_path / "run", thresholds={"k3_kl": 1e-4}, render_every=0) as monitor:
        for step in range(4):
            rollout = np.log(rng.uniform(1e-3, 1.0, (8, 16))).astype(np.float32)
            trainer = np.minimum(rollout + rng.normal(0, 0.05, (8, 16)), 0).astype(np.float32)
            monitor.log(step, rollout_log_probs=rollout, old_log_probs=trainer,
                        response_mask=np.ones((8, 16)))
    page = parity.monitor.write_page(tmp_path / "run")
    loaded, total, console = decoded_images(page, tmp_path)
    assert total >= 8 and loaded == total and console == []
