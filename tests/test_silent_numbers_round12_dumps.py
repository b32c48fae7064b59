"""Round 12, rollouts read from dumps and the sampling given for them: a sampling dict by request id
with non-string keys, a case whose request ids match none of a dump's, routes past int32 or
negative in a `Rollout` built in Python, and a Parquet `sampling` struct stored as float16 or
with null fields. No engine starts."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import parity
from parity.core.errors import ConfigError, InputError
from parity.core.tables import write_rows
from parity.core.types import Request, Rollout, SamplingParams
from parity.rollouts.dumps import read_dump
from parity.workload.cases import Case

ROWS = [{"request_id": str(i), "prompt_ids": [1, 2 + i], "response_ids": [3, 4],
         "rollout_logprobs": [-0.5, -0.25]} for i in range(2)]
TWO = Case(name="two", model="tiny-llama", requests=(
    Request((1, 2), SamplingParams(temperature=0.5, max_tokens=4, seed=1), request_id="0"),
    Request((1, 3), SamplingParams(temperature=1.5, max_tokens=4, seed=2), request_id="1")))


def test_a_sampling_dict_with_non_string_keys_is_refused_naming_string_ids(tmp_path):
    # before: {0: ...} matched no row: rows failed as "no sampling parameters" without naming the key
    path = write_rows(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ConfigError, match=r"request ids are strings: its key 0 \(int\).*give it as '0'"):
        read_dump(path, sampling={0: SamplingParams(temperature=0.7), 1: SamplingParams(temperature=0.7)})
    rollouts = read_dump(path, sampling={"0": SamplingParams(temperature=0.7),
                                         "1": SamplingParams(temperature=0.7)}).rollouts
    assert [r.sampling.temperature for r in rollouts] == [0.7, 0.7]


def test_a_non_string_key_does_not_leave_a_contradicting_row_unchecked(tmp_path):
    # before: the row's own temperature 1.0 was kept silently; with the key "0" it is a contradiction
    path = write_rows(tmp_path / "d.jsonl", [{**row, "temperature": 1.0} for row in ROWS])
    with pytest.raises(ConfigError, match="request ids are strings"):
        read_dump(path, sampling={0: SamplingParams(temperature=0.7)})
    with pytest.raises(InputError, match="was given; drop one of them"):
        read_dump(path, sampling={"0": SamplingParams(temperature=0.7)})
    with pytest.raises(ConfigError, match="request ids are strings"):  # score's read_source, records too
        parity.score(str(path), "tiny-llama", sampling={0: SamplingParams(temperature=0.7)})


def test_a_sampling_dict_of_plain_dicts_is_a_config_error(tmp_path):
    # before: AttributeError ('dict' object has no attribute 'replace'), no ParityError
    path = write_rows(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ConfigError, match=r"sampling\['0'\] must be a SamplingParams, got dict"):
        read_dump(path, sampling={"0": {"temperature": 0.7}, "1": {"temperature": 0.7}})


def test_a_case_whose_ids_match_no_dump_row_names_both_ids(tmp_path):
    # before: "processed logprobs but no sampling parameters ... give --temperature", no word on ids
    rows = [{k: v for k, v in row.items() if k != "request_id"} | {"uid": f"uid-{i}"}
            for i, row in enumerate(ROWS)]
    path = write_rows(tmp_path / "verl.jsonl", rows)
    with pytest.raises(InputError, match=r"verl.jsonl:1: .*given by request id \('0', '1'; --case.* "
                                         r"this row's id 'uid-0' \(from its 'uid' column\) is none of them"):
        parity.score(str(path), "tiny-llama", case=TWO)
    given = {f"r{i}": SamplingParams(temperature=0.7) for i in range(7)}
    bare = write_rows(tmp_path / "bare.jsonl", [{k: v for k, v in row.items() if k != "request_id"}
                                                for row in ROWS])
    with pytest.raises(InputError, match=r"'r0', 'r1', 'r2', 'r3', 'r4', \.\.\.; .*id '0' \(from row order"):
        read_dump(bare, sampling=given)


def _routes(bad):
    return np.array([[[bad, 1]], [[2, 3]]], dtype=np.int64)


@pytest.mark.parametrize("bad", [2 ** 32 + 1, 2 ** 31, -1])
def test_rollout_routes_outside_int32_expert_ids_are_refused(bad):
    # before: 2**32 + 1 was stored as expert 1 (int32 wrap), 2**31 as -2**31, and -1 kept as an expert
    with pytest.raises(InputError, match=f"routed_experts holds expert id {bad};"):
        Rollout("a", 0, (1, 2), (3,), (-0.1,), "stop", "x", routed_experts=_routes(bad))
    ok = Rollout("a", 0, (1, 2), (3,), (-0.1,), "stop", "x", routed_experts=_routes(0).astype(np.uint8))
    assert ok.routed_experts.dtype == np.int32 and ok.routed_experts.tolist() == [[[0, 1]], [[2, 3]]]


def test_a_dump_row_with_a_negative_expert_id_is_refused(tmp_path):
    row = {**ROWS[0], "temperature": 0.7, "routed_experts": [[[-1]], [[2]], [[3]]]}
    (tmp_path / "r.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(InputError, match=r"r.jsonl:1: .*expert id -1"):
        read_dump(tmp_path / "r.jsonl")


def _struct_dump(path, kind, values):
    struct = pa.struct([("temperature", kind), ("top_p", kind)])
    pq.write_table(pa.table({"prompt_ids": [[1, 2]] * len(values), "response_ids": [[3, 4]] * len(values),
                             "rollout_logprobs": [[-0.5, -0.25]] * len(values),
                             "request_id": [str(i) for i in range(len(values))],
                             "sampling": pa.array(values, struct)}), str(path))
    return path


def test_a_float16_sampling_struct_is_refused(tmp_path):
    # before: temperature 0.7 stored as float16 read as 0.7001953 and was scored so
    path = _struct_dump(tmp_path / "h.parquet", pa.float16(), [{"temperature": 0.7, "top_p": 0.9}])
    with pytest.raises(InputError, match=r"column 'sampling.temperature' stores its values as halffloat"):
        read_dump(path)
    path = _struct_dump(tmp_path / "f.parquet", pa.float32(), [{"temperature": 0.7, "top_p": 0.9}])
    sampling = read_dump(path).rollouts[0].sampling
    assert (sampling.temperature, sampling.top_p) == (0.7, 0.9)


def test_null_fields_of_a_parquet_sampling_struct_are_absent(tmp_path):
    # before: a field one row lacks is null in Parquet: "sampling.top_p must be ... got None" (JSONL read it)
    path = _struct_dump(tmp_path / "n.parquet", pa.float64(), [{"temperature": 0.7}, {"top_p": 0.9}])
    got = [(r.sampling.temperature, r.sampling.top_p) for r in read_dump(path).rollouts]
    assert got == [(0.7, 1.0), (1.0, 0.9)]
