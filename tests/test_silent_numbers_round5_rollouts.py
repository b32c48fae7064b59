"""No silent wrong numbers, round 5 (rollouts read from disk): each input below was accepted on the
old code and scored as something nobody wrote (a logprob list cut to fit, a column spelled twice of
which one was dropped, a mask rounded, a sample counted twice, a mixed-dtype batch judged by one
dtype's limits). Each is now refused with the field and the fix before any engine starts.
"""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from parity.core.errors import ConfigError, InputError
from parity.core.turns import Generate, Inject
from parity.core.types import Request, Rollout, SamplingParams
from parity.rollouts.dumps import read_dump
from parity.rollouts.record import read_record
from parity.scoring import score

GOOD = {"prompt_ids": [1, 2], "response_ids": [3, 4], "rollout_logprobs": [-0.1, -0.2], "temperature": 1.0}


def _dump(tmp_path, *rows, text: str | None = None):
    path = tmp_path / "dump.jsonl"
    path.write_text(text if text is not None else "".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- dumps: one column, one meaning ------------------------------------------------------------------


@pytest.mark.parametrize("extra, name", [
    ({"responses": [5, 6]}, "response_ids"),
    ({"prompts": [9, 9]}, "prompt_ids"),
    ({"logprobs": [-3.0, -4.0]}, "rollout_logprobs"),
    ({"request_id": "a", "uid": "b"}, "request_id"),
    ({"trainer_logprobs": [-0.1, -0.2], "old_log_probs": [-1.0, -2.0]}, "trainer_logprobs"),
    ({"top_k_ids": [[3], [4]], "topk_ids": [[4], [3]], "top_k_logprobs": [[-0.1], [-0.2]]}, "top_k_ids"),
])
def test_a_column_spelled_two_ways_with_different_values_is_refused(tmp_path, extra, name):
    with pytest.raises(InputError, match=rf"dump.jsonl:1: the row spells '{name}' twice with different "
                                         r"values: .*drop or rename one"):
        read_dump(_dump(tmp_path, {**GOOD, **extra}))


def test_a_column_spelled_two_ways_with_one_value_is_read(tmp_path):
    dump = read_dump(_dump(tmp_path, {**GOOD, "responses": [3, 4], "request_id": "a", "uid": "a"}))
    assert dump.rollouts[0].key == ("a", 0) and dump.rollouts[0].token_ids == (3, 4)


def test_a_key_twice_in_a_jsonl_object_or_a_parquet_column_twice_is_refused(tmp_path):
    text = ('{"prompt_ids": [1, 2], "response_ids": [3, 4], "response_ids": [7, 8], '
            '"rollout_logprobs": [-0.1, -0.2], "temperature": 1.0}\n')
    with pytest.raises(InputError, match=r"dump.jsonl:1: key 'response_ids' appears twice in one object"):
        read_dump(_dump(tmp_path, text=text))
    columns = [[[1, 2]], [[3, 4]], [[7, 8]], [[-0.1, -0.2]], [1.0]]
    table = pa.Table.from_arrays(
        [pa.array(c) for c in columns],
        names=["prompt_ids", "response_ids", "response_ids", "rollout_logprobs", "temperature"])
    pq.write_table(table, str(tmp_path / "dump.parquet"))
    with pytest.raises(InputError, match=r"column 'response_ids' appears more than once"):
        read_dump(tmp_path / "dump.parquet")


# -- dumps: values line up with the response ---------------------------------------------------------


@pytest.mark.parametrize("extra, match", [
    ({"rollout_logprobs": [-0.5, -0.1, -0.2]}, r"2 response ids but 3 rollout logprobs"),
    ({"old_log_probs": [-0.5, -0.1, -0.2]}, r"2 response ids but 3 old_log_probs"),
    ({"top_k_ids": [[9], [3], [4]], "top_k_logprobs": [[-0.05], [-0.1], [-0.2]]},
     r"2 response ids but 3 top_k_ids rows"),
])
def test_values_longer_than_the_response_are_refused_not_cut_to_fit(tmp_path, extra, match):
    """The old code kept the first len(response) values: a list shifted by one token was scored."""
    with pytest.raises(InputError, match=match + r"; give one .* per response token, aligned"):
        read_dump(_dump(tmp_path, {**GOOD, **extra}))


def test_padded_values_still_cover_the_padded_or_the_real_response(tmp_path):
    row = {**GOOD, "response_ids": [3, 4, 0], "attention_mask": [1, 1, 1, 1, 0]}
    for logprobs in ([-0.1, -0.2, 0.0], [-0.1, -0.2]):
        rollout = read_dump(_dump(tmp_path, {**row, "rollout_logprobs": logprobs})).rollouts[0]
        assert rollout.logprobs == (-0.1, -0.2)
    with pytest.raises(InputError, match=r"3 response ids \(2 without the padding\) but 4 rollout logprobs"):
        read_dump(_dump(tmp_path, {**row, "rollout_logprobs": [-0.1, -0.2, 0.0, 0.0]}))


def test_a_response_mask_that_counts_a_token_attention_mask_calls_padding_is_refused(tmp_path):
    row = {**GOOD, "response_ids": [3, 4, 5], "rollout_logprobs": [-0.1, -0.2, -0.3],
           "attention_mask": [1, 1, 1, 1, 0], "response_mask": [1, 1, 1]}
    with pytest.raises(InputError, match=r"response_mask marks response token 2 generated \(1\) but "
                                         r"attention_mask says it is padding"):
        read_dump(_dump(tmp_path, row))
    ok = read_dump(_dump(tmp_path, {**row, "response_mask": [1, 1, 0]})).rollouts[0]
    assert ok.token_ids == (3, 4)


# -- dumps: the row's own word on what its logprobs are ----------------------------------------------


def test_the_sampling_objects_logprobs_mode_is_the_rows_own(tmp_path):
    """The old code overrode a sampling object's "raw" with the reader's default "processed": raw
    logprobs at temperature 0.7 were scored as processed ones (false drift)."""
    base = {k: v for k, v in GOOD.items() if k != "temperature"}
    row = {**base, "sampling": {"temperature": 0.7, "logprobs_mode": "raw"}}
    rollout = read_dump(_dump(tmp_path, row)).rollouts[0]
    assert rollout.logprobs_mode == "raw" and rollout.sampling.temperature == 0.7
    with pytest.raises(InputError, match=r"logprobs_mode column says 'processed' but its sampling object "
                                         r"says logprobs_mode 'raw'.*drop one"):
        read_dump(_dump(tmp_path, {**row, "logprobs_mode": "processed"}))


@pytest.mark.parametrize("index", [1.7, "3", True])
def test_a_sample_index_that_is_no_integer_is_refused_not_rounded(tmp_path, index):
    with pytest.raises(InputError, match=r"dump.jsonl:1: sample_index must be an integer >= 0"):
        read_dump(_dump(tmp_path, {**GOOD, "sample_index": index}))


# -- records: rollouts their requests could have ------------------------------------------------------


REQUEST = Request((1, 2, 3), SamplingParams(temperature=0.7, max_tokens=8), "a")
ROLLOUT = Rollout("a", 0, (1, 2, 3), (4, 5), (-0.1, -0.2), "stop", "reference", sampling=REQUEST.sampling)


def _record(tmp_path, request: Request, rollout: dict):
    lines = [{"kind": "header", "format": "parity-record", "version": 1, "model": None, "meta": {}},
             {"kind": "request", **request.to_dict()}, {"kind": "rollout", **rollout}]
    path = tmp_path / "record.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.parametrize("mask", [[1, 0.5], [1.9, 1], ["1", 1]])
def test_a_response_mask_that_is_no_list_of_0s_and_1s_is_refused_not_rounded(tmp_path, mask):
    request = dataclasses.replace(REQUEST, turns=(Generate(1), Inject((5,))))
    with pytest.raises(InputError, match=r"record.jsonl:3: rollout 'a'/0: response_mask must be a list of "
                                         r"0s"):
        read_record(_record(tmp_path, request, {**ROLLOUT.to_dict(), "response_mask": mask}))


def test_a_rollout_recording_other_sampling_than_its_request_is_refused(tmp_path):
    other = {**ROLLOUT.to_dict(), "sampling": SamplingParams(temperature=1.0).to_dict()}
    with pytest.raises(InputError, match=r"records sampling temperature=1.0, .* but its request asked for "
                                         r"temperature=0.7"):
        read_record(_record(tmp_path, REQUEST, other))
    raw = {**ROLLOUT.to_dict(), "logprobs_mode": "raw", "sampling": REQUEST.sampling.replace(
        logprobs_mode="raw").to_dict()}
    with pytest.raises(InputError, match=r"logprobs_mode 'raw' but its request asked for 'processed'"):
        read_record(_record(tmp_path, REQUEST, raw))
    same = {**ROLLOUT.to_dict(), "sampling": REQUEST.sampling.replace(seed=3, max_tokens=9).to_dict()}
    assert read_record(_record(tmp_path, REQUEST, same)).rollouts["reference"][0].sampling.temperature == 0.7


def test_a_mask_that_disagrees_with_the_requests_turns_is_refused(tmp_path):
    """Without its mask a trajectory's injected tokens (logprob 0.0) were scored as sampled ones."""
    trajectory = dataclasses.replace(REQUEST, turns=(Generate(2), Inject((9, 9)), Generate(2)))
    rollout = {**ROLLOUT.to_dict(), "token_ids": [4, 5, 9, 9, 6], "logprobs": [-0.1, -0.2, 0.0, 0.0, -0.3]}
    with pytest.raises(InputError, match=r"without a response_mask, but the request's turns inject tokens"):
        read_record(_record(tmp_path, trajectory, rollout))
    masked = read_record(_record(tmp_path, trajectory, {**rollout, "response_mask": [1, 1, 0, 0, 1]}))
    assert masked.rollouts["reference"][0].response_mask == (1, 1, 0, 0, 1)
    with pytest.raises(InputError, match=r"marks a token injected \(0\), but the request injects nothing"):
        read_record(_record(tmp_path, REQUEST, {**ROLLOUT.to_dict(), "response_mask": [1, 0]}))


@pytest.mark.parametrize("turns, match", [
    ([{"generate": 2.9}], r"Generate.max_tokens must be an integer >= 1, got 2.9"),
    ([{"generate": 2}, {"inject": [9.7]}], r"Inject.token_ids must hold token ids .*got 9.7"),
    ([{"generate": 2}, {"inject": "12"}], r"Inject.token_ids must be a list of token ids .*got '12'"),
    ([{"generate": 2, "stop_token_ids": [3.5]}], r"Generate.stop_token_ids must hold token ids .*got 3.5"),
])
def test_a_recorded_turn_is_read_as_written_not_rounded_or_split(tmp_path, turns, match):
    """The old code read inject [9.7] as token 9 and inject "12" as tokens 1 and 2."""
    request = {**REQUEST.to_dict(), "turns": turns}
    lines = [{"kind": "header", "format": "parity-record", "version": 1}, {"kind": "request", **request}]
    path = tmp_path / "record.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(ConfigError, match=r"record.jsonl:2: " + match):
        read_record(path)


# -- score: what Python objects and mixed batches bring ----------------------------------------------


def _rollout(rid: str, logprobs=(-0.1, -0.2), **meta) -> Rollout:
    return Rollout(rid, 0, (1, 2, 3), (4, 5), logprobs, "stop", "external", sampling=SamplingParams(),
                   meta=meta)


TRAINER = [[-0.1, -0.2], [-0.3, -0.5]]


def test_score_refuses_a_rollout_given_twice_and_logprobs_that_are_not_logprobs():
    a, b = _rollout("a"), _rollout("b")
    with pytest.raises(InputError, match=r"rollout \('a', 0\) appears more than once"):
        score([a, a, b], trainer_logprobs=[TRAINER[0], *TRAINER])
    with pytest.raises(InputError, match=r"rollout 'a'/0: logprob 1 is 0.5 > .*not logprobs"):
        score([_rollout("a", (-0.1, 0.5)), b], trainer_logprobs=TRAINER)


def test_score_refuses_rollouts_of_several_dtypes():
    """The old code read a mixed batch as "no dtype recorded" and judged it by bfloat16's limits."""
    fp32, bf16, unnamed = _rollout("a", dtype="float32"), _rollout("b", dtype="bfloat16"), _rollout("b")
    with pytest.raises(InputError, match=r"several dtypes \['bfloat16', 'float32'\]"):
        score([fp32, bf16], trainer_logprobs=TRAINER)
    with pytest.raises(InputError, match=r"several dtypes"):
        score([fp32, bf16], trainer_logprobs=TRAINER, rollout_dtype="float32")
    with pytest.raises(InputError, match=r"some rollouts record dtype 'float32' and others none "
                                         r".*rollout_dtype"):
        score([fp32, unnamed], trainer_logprobs=TRAINER)
    with pytest.raises(ConfigError, match=r"contradicts the rollouts' record"):
        score([fp32, unnamed], trainer_logprobs=TRAINER, rollout_dtype="bfloat16")
    report = score([fp32, unnamed], trainer_logprobs=TRAINER, rollout_dtype="float32")
    assert report.summary["num_sequences"] == 2
