"""Rollout dumps: round trips with sampling and trainer logprobs, verl's batch layout, sampling
from columns or given, and bad rows named by line or row."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from parity.core.errors import InputError
from parity.core.types import Rollout, SamplingParams
from parity.rollouts.dumps import dump_rollouts, load_rollouts, read_dump

T07 = SamplingParams(n=2, temperature=0.7, top_p=0.9, max_tokens=6, seed=11)
RAW = SamplingParams(logprobs_mode="raw")
GOOD = {"prompt_ids": [1, 2], "response_ids": [3, 4], "rollout_logprobs": [-0.1, -0.2]}


def write_jsonl(path, *rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_round_trip_keeps_sampling_routes_and_trainer_logprobs(tmp_path, suffix):
    routes = np.arange(4 * 2 * 2, dtype=np.int32).reshape(4, 2, 2) % 8
    rollouts = [Rollout("p0", 0, (1, 5, 6), (7, 8), (-0.5, -1.25), "length", "trtllm",
                        routed_experts=routes, sampling=T07),
                Rollout("p0", 1, (1, 5, 6), (9,), (-2.0,), "stop", "trtllm", logprobs_mode="raw",
                        sampling=RAW)]
    dump = read_dump(dump_rollouts(tmp_path / f"dump{suffix}", rollouts, [[-0.5, -1.0], [-2.5]]),
                     backend="trtllm")
    for a, b in zip(rollouts, dump.rollouts):
        assert (a.key, a.prompt_ids, a.token_ids, a.logprobs, a.finish_reason, a.logprobs_mode, a.sampling) \
            == (b.key, b.prompt_ids, b.token_ids, b.logprobs, b.finish_reason, b.logprobs_mode, b.sampling)
    assert np.array_equal(dump.rollouts[0].routed_experts, routes) and dump.rollouts[1].routed_experts is None
    assert dump.trainer_logprobs == ((-0.5, -1.0), (-2.5,)) and dump.trainer_column == "trainer_logprobs"
    assert read_dump(dump_rollouts(tmp_path / f"plain{suffix}", rollouts)).trainer_logprobs is None


def test_processed_rows_without_sampling_are_refused_naming_the_fix(tmp_path):
    path = write_jsonl(tmp_path / "dump.jsonl", {**GOOD, "temperature": 0.7}, GOOD)
    with pytest.raises(InputError, match=r"dump.jsonl:2: processed logprobs but no sampling.*--temperature"):
        load_rollouts(path)
    raw = load_rollouts(path, logprobs_mode="raw")  # raw logprobs do not depend on sampling
    assert raw[0].sampling == SamplingParams(temperature=0.7, logprobs_mode="raw") and raw[1].sampling is None


def test_sampling_from_flat_columns_from_the_caller_or_per_request(tmp_path):
    path = write_jsonl(tmp_path / "dump.jsonl", {**GOOD, "temperature": 0.6, "top_k": -1},
                       {**GOOD, "request_id": "b"})
    with pytest.raises(InputError, match=":2: processed logprobs but no sampling"):
        load_rollouts(path)
    given = SamplingParams(temperature=0.6, top_p=0.9)
    first, second = load_rollouts(path, sampling={"0": SamplingParams(temperature=0.6), "b": given})
    # top_k -1 is vLLM's and verl's "off": parity's 0
    assert (first.sampling.temperature, first.sampling.top_k, first.sampling.top_p) == (0.6, 0, 1.0)
    assert second.sampling == given
    with pytest.raises(InputError, match=r":1: the row's sampling .* = \(0.6, 0, 1.0\) but "
                                         r"\(0.6, 0, 0.9\) was given; drop one"):
        load_rollouts(path, sampling=given)


def test_verl_batch_layout_left_padded_prompts_uid_groups_and_old_log_probs(tmp_path):
    """verl's batch: prompts left-padded, responses right-padded, one attention_mask over both;
    `uid` names a prompt group whose samples get indices 0, 1, ...; `old_log_probs` is the trainer's."""
    rows = [{"prompts": [0, 0, 1, 5], "responses": [7, 8, 0], "attention_mask": [0, 0, 1, 1, 1, 1, 0],
             "response_mask": [1, 1, 0], "rollout_log_probs": [-0.1, -0.2, 0.0],
             "old_log_probs": [-0.15, -0.25, 0.0], "uid": "g0"},
            {"prompts": [0, 0, 1, 5], "responses": [9, 0, 0], "attention_mask": [0, 0, 1, 1, 1, 0, 0],
             "response_mask": [1, 0, 0], "rollout_log_probs": [-0.3, 0.0, 0.0],
             "old_log_probs": [-0.35, 0.0, 0.0], "uid": "g0"}]
    path = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    dump = read_dump(path, backend="verl-vllm", sampling=SamplingParams(temperature=1.0))
    assert [(r.key, r.prompt_ids, r.token_ids, r.logprobs) for r in dump.rollouts] == [
        (("g0", 0), (1, 5), (7, 8), (-0.1, -0.2)), (("g0", 1), (1, 5), (9,), (-0.3,))]
    assert dump.trainer_logprobs == ((-0.15, -0.25), (-0.35,)) and dump.trainer_column == "old_log_probs"


@pytest.mark.parametrize("bad, match", [
    ({k: v for k, v in GOOD.items() if k != "response_ids"}, "missing field 'response_ids'"),
    ({**GOOD, "rollout_logprobs": [-0.1]}, "2 response ids but 1 rollout logprobs"),
    ({**GOOD, "rollout_logprobs": [-0.1, float("nan")]}, "logprob 1 is nan"),
    ({**GOOD, "rollout_logprobs": [-0.1, 3.5]}, "looks like probabilities/logits, not logprobs"),
    ({**GOOD, "prompt_ids": [1, -2]}, "prompt_ids must be non-negative integers"),
    ({**GOOD, "routed_experts": [[[0, 1]]]}, "routed_experts has 1 positions"),
    ({**GOOD, "old_log_probs": [-0.1]}, "2 response ids but 1 old_log_probs"),
    ({**GOOD, "response_mask": [2, 1]}, "response_mask values must be 0 or 1"),
    ({**GOOD, "attention_mask": [1, 0, 1, 1]}, "prompt must be 0s then 1s"),
    ({**GOOD, "attention_mask": [1, 1, 1]}, "attention_mask has 3 entries for 2 prompt \\+ 2 response"),
    ({**GOOD, "temperature": "hot"}, "temperature must be a number"),
    ({**GOOD, "top_p": 1.5}, "sampling.top_p must be in"),
    ({**GOOD, "logprobs_mode": "logits"}, "logprobs_mode 'logits'"),
])
def test_bad_dump_names_the_line(tmp_path, bad, match):
    path = tmp_path / "dump.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps(bad) + "\n")  # NaN written as JSON NaN
    with pytest.raises(InputError, match=match) as info:
        load_rollouts(path, sampling=SamplingParams())
    assert "dump.jsonl:3:" in str(info.value)


def test_trainer_logprobs_on_some_rows_only_and_unreadable_files(tmp_path):
    path = write_jsonl(tmp_path / "dump.jsonl", {**GOOD, "old_log_probs": [-0.1, -0.2]}, GOOD)
    with pytest.raises(InputError, match=r"trainer logprobs must be in one column on every row; rows \[2\]"):
        read_dump(path, logprobs_mode="raw")
    path.write_text(json.dumps(GOOD) + "\n{not json\n")
    with pytest.raises(InputError, match=r"dump.jsonl:2: invalid JSON"):
        load_rollouts(path, logprobs_mode="raw")
    with pytest.raises(InputError, match="no such file"):
        load_rollouts(tmp_path / "missing.parquet")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(InputError, match=r"junk\.parquet: not a readable Parquet file"):
        load_rollouts(tmp_path / "junk.parquet")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(InputError, match="holds no rows"):
        load_rollouts(tmp_path / "empty.jsonl")


def test_bad_parquet_row_is_named(tmp_path):
    rows = [GOOD, {**GOOD, "rollout_logprobs": [-0.1, float("nan")]}]
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "dump.parquet"))
    with pytest.raises(InputError, match=r"dump.parquet row 2: logprob 1 is nan"):
        load_rollouts(tmp_path / "dump.parquet", logprobs_mode="raw")
