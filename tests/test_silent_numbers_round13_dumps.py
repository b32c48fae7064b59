"""Round 13, a dump row's sampling and OpenRLHF rows: vLLM's top_k = -1 ("off") inside a row's
`sampling` object (JSONL and Parquet struct) read as the flat column reads it, sampling given by
request id that matches no row warned about, and OpenRLHF rows whose action_mask is all 0 counted in
the step's notes. No engine starts."""

from __future__ import annotations

import types
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from parity.core.errors import InputError
from parity.core.tables import write_rows
from parity.core.types import SamplingParams
from parity.integrations import openrlhf
from parity.rollouts.dumps import read_dump

ROW = {"request_id": "a", "prompt_ids": [1, 2], "response_ids": [3, 4], "rollout_logprobs": [-0.5, -0.25]}


def test_top_k_minus_one_in_the_sampling_object_is_off_as_in_the_flat_column(tmp_path):
    # before: the object's -1 was refused ("sampling.top_k must be an integer >= 0") while the column's was 0
    flat = read_dump(write_rows(tmp_path / "f.jsonl", [{**ROW, "temperature": 0.7, "top_k": -1}]))
    own = {"temperature": 0.7, "top_k": -1}
    obj = read_dump(write_rows(tmp_path / "o.jsonl", [{**ROW, "sampling": own}]))
    both = read_dump(write_rows(tmp_path / "b.jsonl", [{**ROW, "sampling": {"temperature": 0.7, "top_k": -1},
                                                          "temperature": 0.7, "top_k": 0}]))
    assert flat.rollouts[0].sampling.definition == obj.rollouts[0].sampling.definition == (0.7, 0, 1.0)
    assert both.rollouts[0].sampling.top_k == 0


def test_top_k_minus_one_in_a_parquet_sampling_struct_is_off(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({
        "request_id": ["a"], "prompt_ids": pa.array([[1, 2]], pa.list_(pa.int64())),
        "response_ids": pa.array([[3, 4]], pa.list_(pa.int64())),
        "rollout_logprobs": pa.array([[-0.5, -0.25]], pa.list_(pa.float64())),
        "sampling": pa.array([{"temperature": 0.7, "top_k": -1}],
                             pa.struct([("temperature", pa.float64()), ("top_k", pa.int64())]))}), path)
    assert read_dump(path).rollouts[0].sampling.definition == (0.7, 0, 1.0)


def test_other_negative_or_non_integer_top_k_in_the_object_is_still_refused(tmp_path):
    for bad in (-2, True, 50.0):
        path = write_rows(tmp_path / "d.jsonl", [{**ROW, "sampling": {"temperature": 0.7, "top_k": bad}}])
        with pytest.raises(InputError, match="top_k"):
            read_dump(path)


def test_sampling_by_request_id_matching_no_row_warns(tmp_path):
    # before: the given 0.7 was silently unused and every row kept its own 1.0, unchecked against it
    path = write_rows(tmp_path / "d.jsonl", [{**ROW, "sampling": {"temperature": 1.0}},
                                             {**ROW, "request_id": "b", "sampling": {"temperature": 1.0}}])
    with pytest.warns(UserWarning, match=r"given by request id \('zzz'\) but no row has any of those ids"):
        dump = read_dump(path, sampling={"zzz": SamplingParams(temperature=0.7)})
    assert [r.sampling.temperature for r in dump.rollouts] == [1.0, 1.0]  # valid input: still read


def test_sampling_by_request_id_matching_some_row_does_not_warn(tmp_path):
    path = write_rows(tmp_path / "d.jsonl", [{**ROW, "sampling": {"temperature": 0.7}},
                                             {**ROW, "request_id": "b", "sampling": {"temperature": 1.0}}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dump = read_dump(path, sampling={"a": SamplingParams(temperature=0.7), "c": SamplingParams()})
    assert [r.sampling.temperature for r in dump.rollouts] == [0.7, 1.0]


def _experience(action: list[list[int]]) -> types.SimpleNamespace:
    batch, seq = len(action), len(action[0]) + 1
    return types.SimpleNamespace(
        sequences=np.arange(batch * seq).reshape(batch, seq) + 1,
        attention_mask=np.array([[1] * (seq - 1) + [0]] + [[1] * seq] * (batch - 1)),
        action_mask=np.array(action), rollout_log_probs=np.full((batch, seq - 1), -0.5),
        action_log_probs=np.full((batch, seq - 1), -0.4))


def test_openrlhf_rows_with_all_zero_action_mask_are_counted_in_the_notes():
    # before: notes None, the masked row vanished (length 0) without a trace in the step's meta
    step = openrlhf.read_batch(_experience([[0, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]),
                               sampling={"temperature": 1.0})
    assert step.notes == {openrlhf.MASKED: 2}
    assert step.lengths.tolist() == [2, 0, 0]


def test_openrlhf_notes_stay_empty_when_every_row_has_an_action():
    step = openrlhf.read_batch(_experience([[0, 1, 1, 0], [0, 0, 1, 1]]), sampling={"temperature": 1.0})
    assert step.notes is None
