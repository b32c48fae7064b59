"""Round 11: values read from Parquet/JSONL tables, monitor ids, backend score rows, HF seeds.

Each test fails on the code before this round: a narrow Parquet type read as plain numbers, a negative
id shown as a token, a score row of the wrong length blamed on the user, a recorded seed that never
drew its sample.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import parity
from parity.backends.base import Backend, expand_samples
from parity.core.errors import BackendError, InputError
from parity.core.types import Request, SamplingParams
from parity.rollouts.dumps import read_dump

SAMPLING = SamplingParams(temperature=1.0)


def _parquet(path, **columns):
    pq.write_table(pa.table(columns), str(path))
    return path


def _base(ids_type=None, lp_type=None):
    return {"prompt_ids": pa.array([[1, 2, 3]], pa.list_(pa.int64())),
            "response_ids": pa.array([[44, 45, 46]], pa.list_(ids_type or pa.int64())),
            "rollout_logprobs": pa.array([[-0.1234567, -1.5, -7.9]], pa.list_(lp_type or pa.float64()))}


@pytest.mark.parametrize("kind", [pa.uint8(), pa.int8(), pa.uint16(), pa.int16()])
def test_parquet_token_ids_in_a_narrow_integer_type_are_refused(tmp_path, kind):
    # ids 300..302 written as uint8 read back as the valid-looking 44..46: the type is the only witness
    path = _parquet(tmp_path / "d.parquet", **_base(ids_type=kind))
    with pytest.raises(InputError, match=rf"column 'response_ids' stores token ids as {kind}.*int32 or"):
        read_dump(path, sampling=SAMPLING)


def test_parquet_top_k_ids_nested_narrow_type_is_refused(tmp_path):
    cols = {**_base(), "top_k_ids": pa.array([[[44, 9], [45, 9], [46, 9]]], pa.list_(pa.list_(pa.uint16()))),
            "top_k_logprobs": pa.array([[[-0.1234567, -3.0], [-1.5, -3.0], [-7.9, -8.0]]])}
    with pytest.raises(InputError, match="column 'top_k_ids' stores token ids as uint16"):
        read_dump(_parquet(tmp_path / "d.parquet", **cols), sampling=SAMPLING)


def test_parquet_float16_logprobs_are_refused(tmp_path):
    # float16 rounds -7.9 by ~4e-3 nats: read as drift between engine and trainer
    path = _parquet(tmp_path / "d.parquet", **_base(lp_type=pa.float16()))
    with pytest.raises(InputError, match=r"'rollout_logprobs' stores its values as halffloat.*float64"):
        read_dump(path, sampling=SAMPLING)
    cols = {**_base(), "old_log_probs": pa.array([[-0.1, -1.5, -7.9]], pa.list_(pa.float16()))}
    with pytest.raises(InputError, match="column 'old_log_probs' stores its values as halffloat"):
        read_dump(_parquet(tmp_path / "t.parquet", **cols), sampling=SAMPLING)


def test_parquet_wide_types_still_read(tmp_path):
    """int32/uint32 ids and float32 logprobs are what engines write: accepted; other narrow columns
    (a uint8 mask) are not ids and stay accepted."""
    cols = {**_base(ids_type=pa.int32(), lp_type=pa.float32()),
            "response_mask": pa.array([[1, 1, 1]], pa.list_(pa.uint8()))}
    rollout = read_dump(_parquet(tmp_path / "d.parquet", **cols), sampling=SAMPLING).rollouts[0]
    assert rollout.token_ids == (44, 45, 46)
    assert rollout.logprobs[1] == -1.5


@pytest.mark.parametrize("bad", [1.7, 2 ** 32 + 1])
def test_routed_experts_that_are_no_int32_ids_are_refused(tmp_path, bad):
    # before: 1.7 was cast to expert 1, and 2**32 + 1 wrapped to expert 1 in Rollout's int32
    row = {"prompt_ids": [1, 2], "response_ids": [5, 6], "rollout_logprobs": [-0.5, -0.6],
           "routed_experts": [[[bad]], [[2]], [[3]]]}
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(InputError, match=r"r.jsonl:1: routed_experts holds .*integer expert id"):
        read_dump(path, sampling=SAMPLING)
    ok = {**row, "routed_experts": [[[1]], [[2]], [[3]]]}
    path.write_text(json.dumps(ok) + "\n")
    assert read_dump(path, sampling=SAMPLING).rollouts[0].routed_experts.tolist() == [[[1]], [[2]], [[3]]]


def _log(monitor, **kw):
    lp = np.array([[-0.5, -0.7, -0.2], [-0.3, -0.9, -0.4]], dtype=np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 1]])
    return monitor.log(0, rollout_log_probs=lp, old_log_probs=lp - 0.01, response_mask=mask, **kw)


def test_monitor_refuses_negative_ids_at_real_tokens(tmp_path):
    with parity.Monitor(tmp_path, advice_every=0, render_every=0) as monitor:
        wrapped = np.array([[5, -56, 7], [8, 9, 10]], dtype=np.int8)  # 200 stored as int8
        with pytest.raises(InputError, match=r"responses\[0, 1\] is -56, a negative token id"):
            _log(monitor, responses=wrapped)
        with pytest.raises(InputError, match=r"prompts\[1\]\[1\] is -3"):
            _log(monitor, responses=np.array([[5, 6, 7], [8, 9, 10]]),
                 prompts=np.array([[-1, 1, 2], [1, -3, 2]]))
        # padding may hold anything: -1 in a masked-out response slot and as left prompt padding
        record = _log(monitor, responses=np.array([[5, 6, -1], [8, 9, 10]]),
                      prompts=np.array([[-1, 1, 2], [1, 4, 2]]))
    assert all(row["token_id"] >= 0 for row in record["worst_tokens"])


class _Short(Backend):
    """A backend whose score gives one logprob per sequence, whatever its length."""

    name = "short"

    def generate(self, requests):
        raise NotImplementedError

    def _score(self, pairs, sampling):
        import torch

        return [torch.zeros(min(len(r), 1)) for _, r in pairs]

    def close(self):
        pass


def test_score_rows_of_the_wrong_length_are_the_backends_error():
    backend = _Short("tiny-llama")
    with pytest.raises(BackendError, match=r"backend 'short' scored sequence 1 \(2 response tokens\) with a "
                                           r"tensor of shape \[1\]; expected \[2\]"):
        backend.score([([1], [4]), ([1], [4, 5])])


def test_score_row_count_is_checked():
    class _Dropping(_Short):
        name = "dropping"

        def _score(self, pairs, sampling):
            import torch

            return [torch.zeros(len(r)) for _, r in pairs[:-1]]

    with pytest.raises(BackendError, match="backend 'dropping' scored 1 sequences for the 2 given"):
        _Dropping("tiny-llama").score([([1], [4]), ([1], [4, 5])])


def test_hf_records_the_seed_that_drew_each_sample():
    """Every row of a padded HF batch is drawn from one generator seeded with the first sample's seed:
    the recorded seed is that one, with the batch that shared it (before: each row's own, unused)."""
    from parity.backends import shared_backend

    hf = shared_backend("hf", "tiny-llama", dtype="float32")
    reqs = [Request((1, 40, 41), SamplingParams(n=2, temperature=0.7, max_tokens=3, seed=5), "a"),
            Request((1, 70), SamplingParams(n=1, temperature=0.7, max_tokens=3, seed=9), "b")]
    rollouts = hf.generate(reqs)
    first = expand_samples(reqs)[0].seed
    assert [r.meta["sample_seed"] for r in rollouts] == [first] * 3
    # the batch is listed once, in its head's meta (round 15: a list per row was O(B^2))
    assert rollouts[0].meta["seed_batch"] == [["a", 0], ["a", 1], ["b", 0]]
    assert [(r.meta["seed_batch_head"], r.meta["seed_batch_row"]) for r in rollouts] == [(["a", 0], 0),
                                                                                          (["a", 0], 1),
                                                                                          (["a", 0], 2)]
    assert "seed_batch" in hf.meta["seeding"]


def test_parquet_prompt_dataset_ids_in_a_narrow_type_are_refused(tmp_path):
    from parity.workload.prompts import Dataset

    path = _parquet(tmp_path / "p.parquet", prompt=pa.array([[1, 44, 45]], pa.list_(pa.uint8())))
    with pytest.raises(InputError, match="column 'prompt' stores token ids as uint8"):
        Dataset(path).rows()
    wide = _parquet(tmp_path / "w.parquet", prompt=pa.array([[1, 300, 301]], pa.list_(pa.int32())))
    assert [list(p) for _, p in Dataset(wide).rows()] == [[1, 300, 301]]


def test_float32_sampling_columns_read_as_the_values_meant(tmp_path):
    # before: temperature 0.699999988079071, and the 0.7 given alongside was refused as a contradiction
    cols = {**_base(), "temperature": pa.array([0.7], pa.float32()), "top_p": pa.array([0.9], pa.float32())}
    path = _parquet(tmp_path / "s.parquet", **cols)
    want = SamplingParams(temperature=0.7, top_p=0.9)
    assert read_dump(path).rollouts[0].sampling == want
    assert read_dump(path, sampling=want).rollouts[0].sampling == want
    struct = pa.struct([("temperature", pa.float32()), ("top_p", pa.float32())])
    nested = {**_base(), "sampling": pa.array([{"temperature": 0.7, "top_p": 0.9}], struct)}
    assert read_dump(_parquet(tmp_path / "n.parquet", **nested)).rollouts[0].sampling == want
    half = {**_base(), "temperature": pa.array([0.7], pa.float16())}  # 0.7001953125: no float32 to undo
    with pytest.raises(InputError, match="column 'temperature' stores its values as halffloat"):
        read_dump(_parquet(tmp_path / "h.parquet", **half))
