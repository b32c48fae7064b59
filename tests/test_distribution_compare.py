"""`compare(..., top_k_logprobs=K)` end to end on CPU: the reference engine's top-k equals the
training forward's row bit for bit (every distribution drift exactly 0), HF's does not (the
negative control); refusals come before any engine starts."""

from __future__ import annotations

import pytest

from parity.compare import compare
from parity.core.schema import DISTRIBUTION_SUMMARY_KEYS
from parity.core.top_k import TopKError
from parity.render import report_html
from parity.report.document import ParityReport

PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]
SAMPLING = {"max_tokens": 6, "temperature": 0.9, "top_p": 0.95}


def run(backend: str, **kwargs) -> ParityReport:
    return compare("tiny-llama", backend, prompts=PROMPTS, sampling=SAMPLING, dtype="float32", gold=False,
                   top_k_logprobs=5, **kwargs)


@pytest.mark.slow
def test_reference_top_k_drift_is_exactly_zero_and_hf_is_not() -> None:
    report = run("reference")
    summary = report.summary
    assert all(key in summary for key in DISTRIBUTION_SUMMARY_KEYS)
    for key in ("kl_train_engine_max", "kl_engine_train_max", "tv_max"):
        assert summary[f"distribution/{key}"] == 0.0, key
    assert summary["distribution/argmax_agreement"] == 1.0
    worst = report.extras["distribution"]["worst"][0]
    assert worst["engine"] == worst["train"]  # both top-5s, side by side, bit for bit
    back = ParityReport.from_json(report.to_json())  # a stored report keeps the section
    assert back.summary["distribution/tv_max"] == 0.0 and back.extras["distribution"]["worst"]
    page = report_html(back)  # the stored report's page: chart and both top-5s, decoded
    assert "Beyond the sampled token" in page and "trainer top-5" in page
    hf = run("hf").summary  # negative control: another engine's numerics are seen
    assert hf["distribution/tv_max"] > 0.0 and hf["distribution/kl_train_engine_max"] > 0.0


@pytest.mark.parametrize("backend, k, message", [("trtllm", 5, "no top-k"), ("reference", 0, ">= 1"),
                                                 ("hf", True, ">= 1")])
def test_top_k_refusals_come_before_any_engine_starts(backend: str, k: int, message: str) -> None:
    with pytest.raises(TopKError, match=message):
        compare("tiny-llama", backend, prompts=PROMPTS, sampling=SAMPLING, top_k_logprobs=k)


def test_k_above_the_backends_maximum_is_refused_naming_it() -> None:
    from parity.compare import _with_top_k
    from parity.workload.cases import default_case

    class Capped:  # a running backend that returns at most 3 logprobs per position
        name = "capped"

        @classmethod
        def top_k_limit(cls, options: dict) -> int:
            return 3

    case = default_case("tiny-llama", num_prompts=1)
    assert _with_top_k(case, 3, Capped(), {}).requests[0].sampling.top_k_logprobs == 3  # the control
    with pytest.raises(TopKError, match="above the 3 logprobs"):
        _with_top_k(case, 4, Capped(), {})
