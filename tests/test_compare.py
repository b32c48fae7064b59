"""parity.compare and build_report: per-token arrays, support handling, argument checks, and
real comparisons on the tiny checkpoints (HF bf16 drifts; reference is exact)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import parity
from parity.assess.reporting import build_report
from parity.assess.training_side import score_rollouts
from parity.core.errors import ConfigError, InputError, ModelNotFoundError
from parity.core.types import Request, Rollout, SamplingParams
from parity.drift.tolerance import Tolerance
from parity.report.document import ParityReport
from parity.rollouts.matching import match_requests

SMALL = {"prompts": [[5, 6, 7, 8, 9], "hi there"], "sampling": {"max_tokens": 8, "n": 2}}


def rollout(rid: str, prompt: tuple[int, ...], tokens: tuple[int, ...], logprobs: tuple[float, ...],
            mode: str = "processed") -> Rollout:
    return Rollout(rid, 0, prompt, tokens, logprobs, "length", "fake", logprobs_mode=mode)


def test_build_report_lays_out_tokens_left_aligned():
    ros = [rollout("a", (1, 2, 3), (10, 11, 12), (-0.5, -1.0, -2.0)), rollout("b", (1,), (20,), (-0.25,))]
    train = [np.array([-0.5, -1.0, -2.5], np.float32), np.array([-0.25], np.float32)]
    report = build_report(ros, train, tolerance=Tolerance())
    assert report.mask.tolist() == [[True, True, True], [True, False, False]]
    assert report.positions[0].tolist() == [3, 4, 5] and report.positions[1, 0] == 1
    assert report.token_ids.tolist() == [[10, 11, 12], [20, 0, 0]]
    assert report.rollout_logprobs[0, 2] == np.float32(-2.0)
    assert report.train_logprobs[0, 2] == np.float32(-2.5)
    assert report.summary["max_abs_logprob_diff"] == pytest.approx(0.5)
    assert report.summary["num_tokens"] == 4 and report.summary["num_tokens_outside_support"] == 0
    assert report.sequences[0] == {"request_id": "a", "sample_index": 0, "prompt_len": 3, "response_len": 3,
                                   "finish_reason": "length"}
    assert all(k.startswith("rollout_corr/") for k in report.metrics) and report.metrics
    assert {"by_position", "by_probability"} == set(report.breakdowns)
    assert not report.passed and "mean_abs_logprob_diff" in [v.metric for v in report.violations]
    assert report.worst_tokens(1)[0]["position"] == 2
    assert ParityReport.from_json(report.to_json()) == report


def test_tokens_outside_the_trainers_support_are_counted_not_averaged():
    ros = [rollout("a", (1,), (10, 11, 12, 13), (-0.5, -1.0, -2.0, -0.1))]
    train = [np.array([-0.5, -1.0, -np.inf, -0.1], np.float32)]
    report = build_report(ros, train, tolerance=Tolerance(frac_tokens_outside_support_max=0.1))
    assert report.summary["num_tokens_outside_support"] == 1
    assert report.summary["frac_tokens_outside_support"] == 0.25
    assert report.summary["max_abs_logprob_diff"] == 0.0 and report.summary["num_tokens"] == 3
    assert [v.metric for v in report.violations] == ["frac_tokens_outside_support"]
    worst = report.worst_tokens(1)[0]
    assert worst["position"] == 2 and worst["ratio"] == 0.0 and math.isinf(worst["logprob_diff"])
    assert ParityReport.from_json(report.to_json()) == report


def test_build_report_rejects_mismatched_lengths():
    ros = [rollout("a", (1,), (10, 11), (-0.5, -1.0))]
    with pytest.raises(InputError, match="2 tokens but 1 train logprobs"):
        build_report(ros, [np.zeros(1)], tolerance=Tolerance())
    with pytest.raises(InputError, match="one per rollout"):
        build_report(ros, [], tolerance=Tolerance())


def test_rollouts_in_another_logprobs_mode_are_refused():
    request = Request((1, 2), SamplingParams(logprobs_mode="processed"), request_id="a")
    with pytest.raises(InputError, match="different quantities"):
        match_requests([rollout("a", (1, 2), (3,), (-1.0,), mode="raw")], [request])
    with pytest.raises(InputError, match="matches no request"):
        match_requests([rollout("b", (1, 2), (3,), (-1.0,))], [request])
    (matched,) = match_requests([rollout("a", (1, 2), (3,), (-1.0,))], [request])
    assert matched.sampling == request.sampling  # an adapter that does not record it gets the request's


def test_processed_rollouts_without_sampling_are_not_scored_at_a_guessed_temperature():
    with pytest.raises(InputError, match=r"rollout 'a'/0 has processed logprobs but no record of the "):
        score_rollouts("tiny-llama", [rollout("a", (1, 2), (3,), (-1.0,))], dtype="float32")
    raw = rollout("a", (1, 2), (3,), (-1.0,), mode="raw")
    assert len(score_rollouts("tiny-llama", [raw], dtype="float32")[0]) == 1


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"case": "x.toml", "prompts": [[1]]}, ConfigError, "either case or prompts"),
    ({"sampling": {"max_tokens": 4}}, ConfigError, "pass prompts"),
    ({"reference": "fast"}, ConfigError, "reference must be one of"),
    ({"prompts": "hello"}, ConfigError, "non-empty list"),
    ({"prompts": [[1, 2], 3.5]}, InputError, r"prompts\[1\]"),
    ({"prompts": [[1]], "sampling": 3}, ConfigError, "sampling must be"),
    ({"prompts": [[1]], "tolerance": 0.1}, ConfigError, "tolerance must be"),
    ({"prompts": [[1]], "dtype": "float64"}, ConfigError, "dtype must be one of"),
    ({"prompts": [[1]], "router_replay": "R9"}, ConfigError, "router_replay must be"),
])
def test_bad_arguments_raise_before_any_engine_starts(kwargs, error, match):
    with pytest.raises(error, match=match):
        parity.compare("tiny-llama", "no-such-backend", **kwargs)


def test_unknown_model_names_the_choices():
    with pytest.raises(ModelNotFoundError, match="tiny-llama"):
        parity.compare("no-such-model", "hf")


@pytest.fixture(scope="module")
def hf_report() -> ParityReport:
    return parity.compare("tiny-llama", "hf", **SMALL)


@pytest.mark.slow
def test_hf_bf16_drifts_from_the_invariant_trainer(hf_report):
    s = hf_report.summary
    assert s["max_abs_logprob_diff"] > 0.0 and s["num_sequences"] == 4 and s["num_tokens"] > 0
    assert hf_report.passed  # small drift, inside the default tolerance for non-reference backends
    assert hf_report.tolerance == Tolerance.for_backend("hf")
    prov = hf_report.provenance
    assert prov["backend"] == "hf" and prov["model"] == "tiny-llama" and prov["dtype"] == "bfloat16"
    assert prov["reference_kernels"] == "invariant" and prov["case"] == "prompts"
    assert len(prov["case_hash"]) == 16
    assert prov["seeds"] == [0, 1] and len(prov["model_hash"]) == 16
    assert {"parity", "torch", "transformers"} <= set(prov["versions"])
    assert prov["backend_meta"]["dtype"] == "bfloat16"
    assert [seq["request_id"] for seq in hf_report.sequences] == ["prompt-0"] * 2 + ["prompt-1"] * 2
    assert ParityReport.from_json(hf_report.to_json()) == hf_report


@pytest.mark.slow
def test_a_running_backend_is_reused(hf_report):
    from parity.backends import shared_backend

    engine = shared_backend("hf", "tiny-llama", dtype="bfloat16")
    again = parity.compare("tiny-llama", engine, **SMALL)
    np.testing.assert_array_equal(again.rollout_logprobs, hf_report.rollout_logprobs)
    with pytest.raises(ConfigError, match="uses dtype 'bfloat16'"):
        parity.compare("tiny-llama", engine, dtype="float32", **SMALL)
    with pytest.raises(ConfigError, match="not model 'tiny-qwen3'"):
        parity.compare("tiny-qwen3", engine, **SMALL)
    with pytest.raises(ConfigError, match="backend options"):
        parity.compare("tiny-llama", engine, enable_prefix_caching=True, **SMALL)


@pytest.mark.slow
def test_a_tolerance_dict_overrides_the_backend_default(hf_report):
    strict = parity.compare("tiny-llama", "hf", tolerance={"max_abs_logprob_diff": 0.0}, **SMALL)
    assert not strict.passed and [v.metric for v in strict.violations] == ["max_abs_logprob_diff"]
    assert strict.tolerance.k3_kl_max == Tolerance.for_backend("hf").k3_kl_max


@pytest.mark.slow
def test_router_replay_r3_replays_the_backends_routes():
    report = parity.compare("tiny-qwen3-moe", "reference", router_replay="R3", record_routes=True, **SMALL)
    assert report.passed and report.summary["max_abs_logprob_diff"] == 0.0
    assert report.provenance["router_replay"] == "R3"


@pytest.mark.slow
def test_reference_is_bitwise_equal_to_the_trainer():
    report = parity.compare("tiny-llama", "reference", **SMALL)
    assert report.passed and report.tolerance == Tolerance.exact()
    assert report.summary["max_abs_logprob_diff"] == 0.0
    np.testing.assert_array_equal(report.train_logprobs, report.rollout_logprobs)
