"""No silent wrong numbers (issue 40, items 3-7 and 13): each input below printed a number on the
old code that was not the one asked for (false drift, a diluted mean, a PASS that judged nothing,
a lost run, a correction recommended for broken data). Each is now refused with the field and the
fix, or said in the report.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import numpy as np
import pytest

import parity
from parity.assess.reporting import build_report
from parity.backends import Backend, get_backend
from parity.cli import main
from parity.core.errors import BackendError, InputError, OutputError
from parity.core.types import Request, Rollout, SamplingParams
from parity.drift.tolerance import Tolerance
from parity.engine import ReferenceEngine
from parity.report.document import ParityReport
from parity.rollouts.dumps import read_dump
from parity.rollouts.matching import match_requests
from parity.rollouts.record import read_record, write_record
from parity.scoring import score

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def rollouts() -> list[Rollout]:
    """Reference rollouts sampled at temperature 0.7: their logprobs are exact under the record."""
    requests = [
        Request(
            (5 + i, 9, 13, 21 + i, 30, 31),
            SamplingParams(max_tokens=16, temperature=0.7, seed=i, n=2),
            f"r{i}",
        )
        for i in range(6)
    ]
    return ReferenceEngine(MODEL, dtype="float32").generate(requests)


def _write(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# item 3: a row that contradicts itself ------------------------------------------------------------------


def test_a_row_whose_sampling_object_and_columns_disagree_is_refused(tmp_path) -> None:
    row = {
        "prompt_ids": [5, 6, 7],
        "response_ids": [8, 9],
        "rollout_logprobs": [-0.5, -1.0],
        "sampling": {"temperature": 0.7, "top_p": 1.0},
        "temperature": 1.0,
    }
    _write(tmp_path / "d.jsonl", [row])
    with pytest.raises(
        InputError, match=r"d.jsonl:1: .*sampling object says .*\(0.7, 0, 1.0\).*temperature=1.0"
    ):
        read_dump(tmp_path / "d.jsonl")
    _write(tmp_path / "ok.jsonl", [{**row, "temperature": 0.7}])  # the same setting twice is no contradiction
    assert read_dump(tmp_path / "ok.jsonl").rollouts[0].sampling.temperature == 0.7


# item 4: trainer-logprob scores that cannot judge -------------------------------------------------------


def test_unmasked_right_padding_is_refused(tmp_path) -> None:
    """verl pads `responses` with the pad id and `rollout_log_probs` with -1; without a mask those
    tokens would count (640 instead of 512 in the report that found it)."""
    padded = {
        "prompts": [5, 6, 7],
        "responses": [8, 9, 10, 0, 0, 0],
        "rollout_log_probs": [-0.5, -1.2, -0.3, -1.0, -1.0, -1.0],
        "old_log_probs": [-0.5, -1.1, -0.3, -4.2, -3.9, -4.0],
        "temperature": 1.0,
    }
    _write(tmp_path / "verl.jsonl", [padded])
    with pytest.raises(
        InputError,
        match=r"ends with 3 tokens of id 0 whose logprobs are all -1\.0: this looks like right padding",
    ):
        read_dump(tmp_path / "verl.jsonl")
    masked = {**padded, "response_mask": [1, 1, 1, 0, 0, 0]}
    _write(tmp_path / "masked.jsonl", [masked])
    assert read_dump(tmp_path / "masked.jsonl").rollouts[0].token_ids == (8, 9, 10)
    greedy = {**padded, "temperature": 0.0, "rollout_log_probs": [0.0] * 6, "old_log_probs": [0.0] * 6}
    _write(tmp_path / "greedy.jsonl", [greedy])  # greedy tokens repeat 0.0 legitimately
    assert len(read_dump(tmp_path / "greedy.jsonl").rollouts[0].token_ids) == 6


def test_trainer_logprob_scores_say_the_sampling_was_not_checked(tmp_path) -> None:
    row = {
        "prompts": [5, 6, 7],
        "responses": [8, 9],
        "rollout_log_probs": [-0.5, -1.0],
        "old_log_probs": [-0.5, -1.0],
        "temperature": 3.0,
    }
    _write(tmp_path / "d.jsonl", [row])
    report = score(tmp_path / "d.jsonl", trainer_logprobs="dump")
    assert report.provenance["sampling_checked"] is False
    assert "sampling columns were not checked" in report.summary_text()


# item 5: server answers and records checked like dumps ------------------------------------------------


class Answers(Backend):
    """A backend that answers with whatever rollouts the test gives it (an HTTP server parity cannot
    trust: the point is what parity does with the answer)."""

    name = "answers"

    def __init__(self, model, *, dtype="float32", edit=None) -> None:
        super().__init__(model, dtype=dtype)
        self.edit = edit

    def generate(self, requests):
        out = []
        for r in requests:
            for i in range(r.sampling.n):
                ro = Rollout(
                    r.request_id,
                    i,
                    r.prompt_ids,
                    (8, 9, 10),
                    (-0.5, -1.0, -0.7),
                    "length",
                    self.name,
                    sampling=r.sampling,
                )
                out.append(self.edit(ro) if self.edit else ro)
        return out

    def _score(self, pairs, sampling):
        raise NotImplementedError

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    "edit,match",
    [
        (
            lambda ro: dataclasses.replace(ro, logprobs=(-0.5, 2.5, -0.7)),
            r"request 'prompt-0' \(sample 0\): logprob 1 "
            r"is 2.5 > 0",
        ),
        (
            lambda ro: dataclasses.replace(ro, token_ids=(8, 9, 10, 11), logprobs=(-0.1,) * 4),
            "with 4 tokens, more than its max_tokens=3",
        ),
        (lambda ro: dataclasses.replace(ro, logprobs=(-0.5, math.nan, -0.7)), "logprob 1 is nan"),
        (
            lambda ro: dataclasses.replace(ro, token_ids=(8, 9, 600)),
            "token id 600, outside the vocabulary of 512",
        ),
        (
            lambda ro: dataclasses.replace(ro, prompt_ids=(1, 2)),
            "for a prompt of 2 tokens that is not the request's",
        ),
    ],
)
def test_a_backend_answer_that_is_no_answer_is_an_error_naming_the_request(edit, match) -> None:
    with pytest.raises(BackendError, match=match):
        parity.compare(
            MODEL, Answers(MODEL, edit=edit), prompts=[[3, 4, 5]], sampling={"max_tokens": 3}, dtype="float32"
        )


def test_records_refuse_rollouts_their_requests_cannot_have(tmp_path) -> None:
    request = Request((3, 4, 5), SamplingParams(max_tokens=2), "a")
    good = Rollout("a", 0, (3, 4, 5), (8, 9), (-0.5, -1.0), "length", "hf", sampling=request.sampling)
    for rollout, match in (
        (dataclasses.replace(good, request_id="ghost"), "which no request line"),
        (dataclasses.replace(good, prompt_ids=(3, 4)), "not the request's"),
        (dataclasses.replace(good, token_ids=(8, 9, 10), logprobs=(-1.0,) * 3), "more than its max_tokens=2"),
    ):
        with pytest.raises(InputError, match=match):  # refused by write_record now, as read_record would
            read_record(write_record(tmp_path / "r.jsonl", [request], [rollout]))


# item 6: -inf, one rule -------------------------------------------------------------------------------


def test_minus_inf_is_one_rule_everywhere_and_survives_records(tmp_path) -> None:
    """A -inf logprob (outside one side's support) is counted apart from every number, the
    per-request drift and token counts included, and written to records losslessly."""
    ro = Rollout(
        "a", 0, (3, 4), (5, 6, 7), (-0.5, -1.0, -9.0), "length", "vllm", sampling=SamplingParams(top_p=0.9)
    )
    train = [np.array([-0.5, -1.5, -np.inf], np.float32)]
    report = build_report([ro], train, tolerance=Tolerance())
    assert report.summary["num_tokens"] == 2 and report.summary["num_tokens_outside_support"] == 1
    (drift,) = report.request_drift()
    assert drift["tokens"] == 2 and drift["outside_support"] == 1 and drift["max_abs_logprob_diff"] == 0.5
    floor = dataclasses.replace(ro, logprobs=(-0.5, -math.inf, -1.0))  # vLLM's -9999 floor, read as -inf
    path = write_record(
        tmp_path / "r.jsonl", [Request((3, 4), SamplingParams(top_p=0.9, max_tokens=3), "a")], [floor]
    )
    assert '"-inf"' in path.read_text()
    (back,) = read_record(path).rollouts["vllm"]
    assert back.logprobs == floor.logprobs
    again = ParityReport.from_json(report.to_json())
    assert np.array_equal(again.train_logprobs, report.train_logprobs)


@pytest.mark.slow
def test_an_output_that_cannot_be_written_costs_no_other_output(tmp_path, capsys, monkeypatch) -> None:
    """The record's directory turns read-only after the checks (a full disk, a revoked mount): the
    comparison still finishes, --json and --html are written, the record's failure is named, exit 2."""
    compare_module = sys.modules["parity.compare"]
    real = compare_module.write_record

    def failing(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(compare_module, "write_record", failing)
    out = tmp_path / "r.json"
    code = main(
        [
            "compare",
            "--model",
            MODEL,
            "--backend",
            "reference",
            "--dtype",
            "float32",
            "--record",
            str(tmp_path / "rec.jsonl"),
            "--json",
            str(out),
            "--html",
            str(tmp_path / "r.html"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and out.exists() and (tmp_path / "r.html").exists()
    assert "record" in err and "could not be written (Permission denied)" in err
    assert real is not failing


def test_compare_raises_output_error_with_the_report(tmp_path, monkeypatch) -> None:
    compare_module = sys.modules["parity.compare"]
    monkeypatch.setattr(
        compare_module, "write_record", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "full"))
    )
    with pytest.raises(OutputError) as caught:
        parity.compare(
            MODEL,
            "reference",
            prompts=[[3, 4]],
            sampling={"max_tokens": 2},
            dtype="float32",
            record=tmp_path / "r.jsonl",
        )
    assert isinstance(caught.value.report, ParityReport) and caught.value.report.passed


# item 7: data bugs are not advised on ------------------------------------------------------------------


@pytest.mark.slow
def test_a_shifted_dump_is_a_data_bug_not_a_correction(rollouts) -> None:
    shifted = [dataclasses.replace(r, logprobs=r.logprobs[1:] + r.logprobs[-1:]) for r in rollouts]
    report = score(shifted, MODEL, dtype="float32")
    advice = report.extras["advice"]["recommendation"]
    assert report.summary["recommended_correction"] == "none (data bug)"
    assert "shifted by one token" in advice["data_bugs"][0] and "looks like a data bug" in advice["reason"]


@pytest.mark.parametrize(
    "wrong,found", [({"temperature": 1.0}, "temperature=0.7"), ({"top_p": 0.8}, "no truncation")]
)
@pytest.mark.slow
def test_a_wrong_sampling_record_is_a_data_bug_not_a_correction(rollouts, wrong, found) -> None:
    wrong_record = [dataclasses.replace(r, sampling=r.sampling.replace(**wrong)) for r in rollouts]
    report = score(wrong_record, MODEL, dtype="float32")
    assert report.summary["recommended_correction"] == "none (data bug)"
    assert any(found in bug for bug in report.extras["advice"]["recommendation"]["data_bugs"])


@pytest.mark.slow
def test_a_raw_vs_processed_mix_up_is_a_data_bug(rollouts) -> None:
    raw = [
        dataclasses.replace(r, logprobs_mode="raw", sampling=r.sampling.replace(logprobs_mode="raw"))
        for r in rollouts
    ]
    bugs = score(raw, MODEL, dtype="float32").extras["advice"]["recommendation"]["data_bugs"]
    assert any("processed logprobs at temperature=0.7" in bug for bug in bugs)


@pytest.mark.slow
def test_real_drift_is_still_advised_on() -> None:
    """The control: bf16 HF against the invariant trainer drifts for real; no data bug is found."""
    report = parity.compare(
        MODEL,
        "hf",
        prompts=[[5 + i, 9, 13, 21] for i in range(8)],
        sampling={"max_tokens": 24, "temperature": 0.7, "n": 2},
        dtype="bfloat16",
    )
    advice = report.extras["advice"]["recommendation"]
    assert advice["data_bugs"] == [] and report.summary["recommended_correction"] != "none (data bug)"


# item 13 --------------------------------------------------------------------------------------------------


def test_a_response_mask_without_ones_is_named(tmp_path) -> None:
    _write(
        tmp_path / "d.jsonl",
        [
            {
                "prompt_ids": [5, 6],
                "response_ids": [7, 8],
                "rollout_logprobs": [-1.0, -1.0],
                "response_mask": [0, 0],
                "temperature": 1.0,
            }
        ],
    )
    with pytest.raises(InputError, match="response_mask has no 1 over the response"):
        read_dump(tmp_path / "d.jsonl")


def test_match_requests_takes_the_model_limits() -> None:
    from parity.models import model_limits

    request = Request((3, 4), SamplingParams(max_tokens=2), "a")
    ro = Rollout("a", 0, (3, 4), (8, 700), (-0.5, -1.0), "length", "x")
    with pytest.raises(BackendError, match="outside the vocabulary"):
        match_requests([ro], [request], limits=model_limits(MODEL))
    assert get_backend  # the registry stays importable beside the fake backend above
