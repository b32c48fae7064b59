"""Round 14, rollouts on disk and scoring them: the scored rollouts' hash covers what makes two
reports differ, a report names the case it was scored under, top_k "off" is one rule for dumps and
trainer batches, the given sampling is checked once, and request ids are strings or integers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import parity
import parity.rollouts.dumps as dumps_module
import parity.scoring as scoring_module
from parity.core.errors import ConfigError, InputError
from parity.core.types import Request, Rollout, SamplingParams
from parity.integrations.batches import StepBatch, dump_step, sampling_of
from parity.rollouts.dumps import dump_rollouts, read_dump
from parity.rollouts.record import write_record
from parity.rollouts.row_sampling import check_given_sampling
from parity.scoring import Source, _rollouts_hash
from parity.workload.cases import Case

#: two requests; their sampling only matters for the provenance here (no forward runs).
TWO = Case(name="two", model="tiny-llama", requests=(
    Request((1, 2), SamplingParams(temperature=0.5, max_tokens=4, seed=1), request_id="0"),
    Request((3, 4), SamplingParams(temperature=1.5, max_tokens=4, seed=2), request_id="1")))


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _row(**changes: Any) -> dict[str, Any]:
    return {"request_id": "0", "prompt_ids": [1, 2], "response_ids": [5, 6], "rollout_logprobs": [-0.5, -1.0],
            "trainer_logprobs": [-0.5, -1.0], "logprobs_mode": "raw", **changes}


# --- 1. the hash of what was scored --------------------------------------------------------------


def _rollout(**changes: Any) -> Rollout:
    base = dict(request_id="a", sample_index=0, prompt_ids=(3, 4), token_ids=(5, 6), logprobs=(-0.5, -1.25),
                finish_reason="stop", backend="vllm")
    return Rollout(**{**base, **changes})


def test_rollouts_without_sampling_hash_apart_by_logprobs_mode() -> None:
    def digest(mode: str) -> str:
        return _rollouts_hash(Source(Path("d.jsonl"), "dump", (_rollout(logprobs_mode=mode),)))
    # was: one hash for raw and processed logprobs of the same tokens
    assert digest("raw") != digest("processed")


def test_dumps_differing_only_in_their_trainer_logprobs_hash_apart(tmp_path) -> None:
    same = parity.score(_write(tmp_path / "same.jsonl", [_row()]), trainer_logprobs="dump")
    off = parity.score(_write(tmp_path / "off.jsonl", [_row(trainer_logprobs=[-0.9, -2.0])]),
                       trainer_logprobs="dump")
    assert same.summary["max_abs_logprob_diff"] == 0.0 and off.summary["max_abs_logprob_diff"] == 1.0
    # was: both reports claimed one case_hash ("what was scored") for different numbers
    assert same.provenance["case_hash"] != off.provenance["case_hash"]


def test_the_forward_side_hash_does_not_move() -> None:
    source = Source(Path("d.jsonl"), "dump", (_rollout(logprobs_mode="raw"),))
    assert _rollouts_hash(source) == _rollouts_hash(source, None) == "a29d0aae8dbc3b26"


# --- 2. the report names its case ----------------------------------------------------------------


def test_score_with_a_case_names_the_case_not_the_dump_file(tmp_path) -> None:
    rows = [_row(request_id=str(i), prompt_ids=p, logprobs_mode="processed")
            for i, p in enumerate([[1, 2], [3, 4]])]
    report = parity.score(_write(tmp_path / "my_dump.jsonl", rows), trainer_logprobs="dump", case=TWO)
    assert report.provenance["case"] == "two"  # was "my_dump"
    assert "my_dump.jsonl" in report.provenance["rollout_logprobs"]  # the file is still named


def test_score_of_a_record_names_the_case_its_header_records(tmp_path) -> None:
    request = Request((1, 2), SamplingParams(temperature=0.5, max_tokens=4), request_id="0")
    rollout = Rollout("0", 0, (1, 2), (5, 6), (-0.5, -1.0), "stop", "reference", sampling=request.sampling)
    path = write_record(tmp_path / "run.jsonl", [request], [rollout], meta={"case": "smoke"})
    report = parity.score(path, trainer_logprobs=[[-0.5, -1.0]])
    assert report.provenance["case"] == "smoke"  # was "run"
    plain = write_record(tmp_path / "plain.jsonl", [request], [rollout])
    assert parity.score(plain, trainer_logprobs=[[-0.5, -1.0]]).provenance["case"] == "plain"


# --- 3. top_k "off": one rule for a dump row and a trainer's batch ---------------------------------


def _batch(top_k: Any) -> StepBatch:
    logprobs = np.array([[-0.5, -1.0]], np.float32)
    return StepBatch(rollout=logprobs, trainer=logprobs, mask=np.ones((1, 2), bool), lengths=np.array([2]),
                     responses=np.array([[5, 6]]), prompts=[np.array([1, 2])],
                     sampling=sampling_of({"temperature": 1.0, "top_k": top_k}, None))


@pytest.mark.parametrize("given", [-1, np.int64(-1), np.int32(-1)])
def test_top_k_minus_one_is_off_in_a_dump_and_a_batch_alike(tmp_path, given) -> None:
    assert sampling_of({"top_k": given}, None)["top_k"] == 0
    flat = read_dump(_write(tmp_path / "flat.jsonl", [_row(temperature=1.0, top_k=int(given))]))
    nested = read_dump(_write(tmp_path / "obj.jsonl", [_row(sampling={"top_k": int(given)})]))
    written = read_dump(dump_step(_batch(given), tmp_path / "step.jsonl"))
    assert flat.rollouts[0].sampling.top_k == nested.rollouts[0].sampling.top_k == 0
    assert written.rollouts[0].sampling.top_k == 0


@pytest.mark.parametrize("given", [-1.0, np.float32(-1.0), 50.0, 2.5])
def test_a_float_top_k_is_refused_in_a_dump_and_a_batch_alike(tmp_path, given) -> None:
    # top_k is an integer everywhere (SamplingParams, case files, a dump row); was: a trainer batch's
    # -1.0 was taken for "off" while the same -1.0 in a dump row was refused
    with pytest.raises(InputError, match="top_k"):
        read_dump(_write(tmp_path / "flat.jsonl", [_row(temperature=1.0, top_k=float(given))]))
    with pytest.raises(InputError, match="top_k"):
        read_dump(_write(tmp_path / "obj.jsonl", [_row(sampling={"top_k": float(given)})]))
    with pytest.raises(InputError, match="top_k"):
        dump_step(_batch(given), tmp_path / "step.jsonl")


# --- 4. the given sampling is checked once, records included ---------------------------------------


def test_the_given_sampling_is_checked_once_for_a_dump(tmp_path, monkeypatch) -> None:
    calls = []

    def counted(sampling: Any) -> None:
        calls.append(sampling)
        check_given_sampling(sampling)
    monkeypatch.setattr(scoring_module, "check_given_sampling", counted)
    monkeypatch.setattr(dumps_module, "check_given_sampling", counted)
    scoring_module.read_source(_write(tmp_path / "d.jsonl", [_row()]), sampling=SamplingParams())
    assert len(calls) == 1  # was 2


def test_a_record_still_refuses_a_sampling_dict_with_a_non_string_key(tmp_path) -> None:
    request = Request((1, 2), SamplingParams(temperature=0.5, max_tokens=4), request_id="0")
    rollout = Rollout("0", 0, (1, 2), (5, 6), (-0.5, -1.0), "stop", "reference", sampling=request.sampling)
    path = write_record(tmp_path / "run.jsonl", [request], [rollout])
    with pytest.raises(ConfigError, match="request ids are strings"):
        scoring_module.read_source(path, sampling={0: SamplingParams(temperature=0.5)})


# --- 5. request ids are strings or integers ------------------------------------------------------


@pytest.mark.parametrize("bad", [1.0, 0.5, True, [1]])
def test_a_request_id_that_is_no_string_or_integer_is_refused(tmp_path, bad) -> None:
    # was: 1.0 became request "1.0" (not "1", the id of the row beside it), True request "True"
    rows = [_row(request_id=1), _row(request_id=bad)]
    with pytest.raises(InputError, match=r"request_id .* is no request id"):
        read_dump(_write(tmp_path / "d.jsonl", rows))


def test_string_and_integer_request_ids_still_read(tmp_path) -> None:
    by_uid = {k: v for k, v in _row(uid="u-1").items() if k != "request_id"}
    dump = read_dump(_write(tmp_path / "d.jsonl", [_row(request_id=7), _row(request_id="7"), by_uid]))
    assert [r.key for r in dump.rollouts] == [("7", 0), ("7", 1), ("u-1", 0)]


# --- 6. a dump written by parity reads back as the rollouts it was written from ----------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_dump_rollouts_keeps_the_rollout_dtype_and_a_trailing_injected_token(tmp_path, suffix) -> None:
    rollouts = [Rollout("a", 0, (1, 2), (5, 6, 7), (-0.5, -0.25, 0.0), "stop", "vllm", logprobs_mode="raw",
                        meta={"dtype": "float16"}, response_mask=(1, 1, 0)),
                Rollout("b", 0, (1, 3), (5, 6), (-0.5, -0.25), "stop", "vllm", logprobs_mode="raw",
                        meta={"dtype": "float16"})]
    trainer = [[-0.5, -0.3, 0.0], [-0.5, -0.3]]
    path = dump_rollouts(tmp_path / f"d{suffix}", rollouts, trainer_logprobs=trainer)
    back = read_dump(path).rollouts
    # was: the last (injected) token read as padding and cut, and the float16 the rollouts record lost
    assert [(r.token_ids, r.response_mask, r.meta.get("dtype")) for r in back] == \
        [(r.token_ids, r.response_mask, "float16") for r in rollouts]
    scored = parity.score(path, trainer_logprobs="dump")
    direct = parity.score(rollouts, trainer_logprobs=trainer)
    # was: the dump was judged as bfloat16 rollouts (other limits, another training dtype)
    assert scored.provenance["rollout_dtype"] == direct.provenance["rollout_dtype"] == "float16"
    assert scored.provenance["dtype"] == direct.provenance["dtype"] == "float16"


# --- 7. a trainer batch's token ids are integers ---------------------------------------------------


@pytest.mark.parametrize("where", ["responses", "prompts"])
def test_dump_step_refuses_float_token_ids_instead_of_truncating_them(tmp_path, where) -> None:
    batch = _batch(0)
    float_ids = {"responses": {"responses": np.array([[5.7, 6.0]])},
                 "prompts": {"prompts": [np.array([1.9, 2.0], np.float32)]}}[where]
    # was: int() wrote token 5 for 5.7 (prompt 1 for 1.9), and the dump was scored on other tokens
    with pytest.raises(InputError, match=f"{where}.* must hold integer token ids"):
        dump_step(dataclasses.replace(batch, **float_ids), tmp_path / "step.jsonl")
    assert read_dump(dump_step(batch, tmp_path / "ok.jsonl")).rollouts[0].token_ids == (5, 6)
