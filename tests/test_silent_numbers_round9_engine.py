"""Round 9, the audit and the training-side assessment: checks that passed on nothing, a NaN that
crashed the audit, a control that blamed seeds for top_k=1, a gold interval of one sequence (each
test fails on the code before its fix)."""

from __future__ import annotations

import math
import sys
import types
from collections.abc import Sequence

import numpy as np
import pytest
import torch

import parity
from parity.assess.accuracy import gold_summary
from parity.audit.diff import Pair, compare_pairs
from parity.audit.lifecycle import run_lifecycle
from parity.backends.base import Backend, expand_samples
from parity.core.errors import ConfigError
from parity.core.types import Request, Rollout, SamplingParams
from parity.workload.cases import Case

MODEL = "tiny-llama"  # vocabulary 512, context 512


def _rollout(tokens: Sequence[int], logprobs: Sequence[float], request: str = "r",
             routes: np.ndarray | None = None) -> Rollout:
    return Rollout(request_id=request, sample_index=0, prompt_ids=(5, 6, 7), token_ids=tuple(tokens),
                   logprobs=tuple(logprobs), finish_reason="stop", backend="fake", routed_experts=routes)


class Empty(Backend):
    """A running backend whose every response is empty (an engine that stops at once); it takes weight
    updates (the weight-sync figures are planted by the test)."""

    name = "empty"

    def __init__(self, model: str = MODEL, *, dtype: str = "float32") -> None:
        super().__init__(model, dtype=dtype)

    def generate(self, requests: Sequence[Request]) -> list[Rollout]:
        return [self.rollout(job, [], [], "stop") for job in expand_samples(requests)]

    def _score(self, pairs, sampling):
        return [torch.full((len(response),), -1.0) for _, response in pairs]

    def update_weights(self, named_tensors) -> None:
        list(named_tensors)

    def close(self) -> None:
        pass


# -- 1. the audit's comparison over no token -----------------------------------------------------------


def test_two_empty_runs_are_no_identical_check():
    """Every sample empty in both runs read as 'identical (2 requests)': deterministic on no evidence."""
    empty = [Pair(_rollout((), (), r), _rollout((), (), r)) for r in ("a", "b")]
    result = compare_pairs(empty)
    assert result.skipped is not None and "nothing was compared" in result.skipped
    assert not result.identical and result.requests == 0
    # one token, or routes over the prompt, is something compared
    assert compare_pairs([*empty, Pair(_rollout((3,), (-1.0,), "c"), _rollout((3,), (-1.0,), "c"))]).identical
    routes = np.zeros((2, 1, 1), np.int32)
    assert compare_pairs([Pair(_rollout((), (), routes=routes), _rollout((), (), routes=routes))]).identical


def test_an_audit_of_an_engine_that_samples_nothing_says_not_checked():
    case = Case(name="e", model=MODEL, requests=(
        Request((5, 9, 13), SamplingParams(max_tokens=4, seed=1), "a"),
        Request((7, 8), SamplingParams(max_tokens=4, seed=2), "b")))
    result = parity.audit(MODEL, Empty(), case=case, dtype="float32", checks=["repeat", "order", "seed"])
    assert all(result.checks[c].skipped for c in ("repeat", "order", "seed"))
    assert not result.deterministic and "deterministic not checked" in result.summary_text()


# -- 2. a NaN on one side of a pair ------------------------------------------------------------------


def test_a_nan_logprob_in_one_run_is_an_infinite_difference_not_a_crash():
    """NaN against -2.0 summed the mean to NaN: CheckResult raised 'mean_abs_logprob_diff must be a
    number >= 0' instead of saying the runs differ (and Python's max had dropped it from the peak)."""
    result = compare_pairs([Pair(_rollout((3, 4), (-1.0, math.nan)), _rollout((3, 4), (-1.0, -2.0)))])
    assert not result.identical and result.differing_requests == 1
    assert result.max_abs_logprob_diff == math.inf and result.mean_abs_logprob_diff == math.inf
    assert result.first_difference["what"] == "logprobs" and result.first_difference["position"] == 1
    # NaN on both sides is still the same number
    same = compare_pairs([Pair(_rollout((3,), (math.nan,)), _rollout((3,), (math.nan,)))])
    assert same.identical and same.max_abs_logprob_diff == 0.0


# -- 3. the lifecycle over no token; the weight update's NaN and settings ------------------------------


def test_a_lifecycle_check_over_empty_runs_is_skipped_not_passed():
    """Two empty runs 'passed' as 'identical tokens and logprobs (2 samples)'."""
    requests = [Request((5, 9, 13), SamplingParams(n=2, max_tokens=4, seed=1), "a")]
    report = run_lifecycle(Empty(), requests, checks=("repeat",))
    (repeat,) = report.results
    assert repeat.status == "skip" and "nothing was compared" in repeat.detail


def test_a_nan_weight_push_names_its_violation(monkeypatch):
    """max_abs_diff_new NaN failed the check with no violation named (every `>` comparison is False)."""
    # the figures planted in a stand-in module (the real one loads transformers: seconds)
    planted = types.SimpleNamespace(max_abs_diff_new=math.nan, mean_shift=1.0, tolerance=0.15,
                                    max_abs_diff_restored=0.0, passed=False)
    monkeypatch.setitem(sys.modules, "parity.backends.weight_sync",
                        types.SimpleNamespace(check_weight_sync=lambda *a, **k: planted))
    (check,) = run_lifecycle(Empty(), [Request((5, 9), SamplingParams(max_tokens=2), "a")],
                             checks=("weight_update",)).results
    assert check.status == "fail" and check.violation is not None
    assert check.violation[0] == "max_abs_diff_new" and math.isnan(check.violation[1])


@pytest.mark.parametrize(("settings", "message"), [
    ({"weight_tolerance": math.nan}, "weight_tolerance .* must be a finite number"),
    ({"weight_tolerance": math.inf}, "weight_tolerance .* must be a finite number"),
    ({"weight_tolerance": -0.1}, r"must be > 0 nats"),
    ({"weight_scale": 0.0}, "weight_scale 0 leaves the weights"),
])
def test_weight_settings_that_decide_the_check_are_refused_before_it_runs(settings, message):
    """A tolerance of NaN, inf or <= 0 failed every push, a scale of 0 failed as 'did the push reach
    the engine?'; each ran the whole check first."""
    backend = Empty()
    backend.generate = None  # the refusal comes before the first run
    with pytest.raises(ConfigError, match=message):
        run_lifecycle(backend, [Request((5, 9), SamplingParams(max_tokens=2), "a")], **settings)


def test_the_command_refuses_a_nan_tolerance_before_the_backend_starts(monkeypatch, capsys):
    from parity.audit import lifecycle_command

    def started(*args, **kwargs):
        raise AssertionError("the backend started")

    monkeypatch.setattr(lifecycle_command, "get_backend", started)
    argv = ["--backend", "reference", "--model", MODEL, "--weight-tolerance", "nan"]
    assert lifecycle_command.main(argv) == 2
    assert "must be a finite number" in capsys.readouterr().err


# -- 4. the seed control on top_k=1 sampling ---------------------------------------------------------


def test_top_k_1_sampling_skips_the_seed_control_instead_of_failing_it():
    """top_k=1 keeps the argmax alone, so other seeds cannot change a sample: the control read
    'FAILED: are seeds ignored?' and the audit exited 1 on the reference engine."""
    case = Case(name="k1", model=MODEL, requests=(
        Request((5, 9, 13, 21), SamplingParams(max_tokens=3, temperature=0.8, top_k=1, seed=3), "a"),))
    result = parity.audit(MODEL, "reference", case=case, dtype="float32", checks=["seed"])
    assert result.checks["seed"].skipped is not None and "top_k 1" in result.checks["seed"].skipped
    assert result.control_held and "control FAILED" not in result.summary_text()


# -- 5. the gold ratio's interval over one sequence ---------------------------------------------------


def test_the_gold_interval_of_one_sequence_is_none_not_a_certainty():
    """One sequence resampled is itself: the interval was [1.5, 1.5] and the verdict said '1.5x farther
    (95% interval 1.5-1.5)', a certainty one sequence cannot give."""
    train = np.array([[-1.0, -1.5, -0.5]], np.float32)
    rollout = np.array([[-1.0, -2.0, -0.5]], np.float32)
    gold = np.array([[-1.0, -1.7, -0.5]])
    summary = gold_summary(train, rollout, gold, np.ones((1, 3), bool))
    assert summary["gold/rollout_to_train_error_ratio"] == pytest.approx(1.5)
    assert summary["gold/rollout_to_train_error_ratio_ci95"] == ["nan", "nan"]
    assert "interval" not in summary["gold/verdict"]
    # two sequences still give an interval
    two = gold_summary(np.repeat(train, 2, 0), np.repeat(rollout, 2, 0), np.repeat(gold, 2, 0),
                       np.ones((2, 3), bool))
    assert all(isinstance(v, float) for v in two["gold/rollout_to_train_error_ratio_ci95"])
