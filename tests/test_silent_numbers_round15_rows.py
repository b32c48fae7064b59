"""Round 15, rows and ids: a dump row without a request_id whose row index is the id another row
names is refused ("3" on row 0 and row 3 without one became one request of two samples); a record's
rollout past its request's n is refused; top_k -1 is "off" (0) in dumps, trainer batches and the
monitor alike, a float -1.0 refused by all three (`parity.core.types.top_k_off`, one rule); a
float16 or bfloat16 scalar given to the monitor reads as the decimal its dtype stands for (0.7, not
0.69921875: `scalar_meant`, by the dtype only); a 0-d array given to `token_arrays` is named by its
own shape. No engine starts.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from parity.core.errors import InputError
from parity.core.types import Request, Rollout, SamplingParams, scalar_meant, top_k_off
from parity.drift.metrics import summarize
from parity.drift.token_arrays import token_arrays
from parity.integrations.batches import sampling_of
from parity.monitor import Monitor
from parity.monitor.core import checked_sampling
from parity.monitor.thresholds import sampling_key
from parity.rollouts import row_sampling
from parity.rollouts.dumps import read_dump
from parity.rollouts.record import read_record, write_record

QUIET = {"render_every": 0, "advice_every": 0, "background": "thread", "advice_in_background": False}
GREEDY = SamplingParams(temperature=0.0)


pytestmark = pytest.mark.usefixtures("quiet_monitor_log")


def _row(response: list[int], **extra) -> dict:
    return {"prompt_ids": [1, 2], "response_ids": response, "rollout_logprobs": [-0.1] * len(response),
            **extra}


def _jsonl(path, rows) -> str:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


# -- 1. a row index as id never joins a request another row names --------------------------------------


def test_an_explicit_id_and_a_row_index_never_merge_into_one_request(tmp_path):
    # old: rows 0 and 3 became request "3" with samples 0 and 1, a group of two from two sources
    rows = [_row([5, 6], request_id="3"), _row([7, 8]), _row([7, 9]), _row([7, 6])]
    with pytest.raises(InputError, match=r"d\.jsonl:4: this row has no request_id, so its row index '3' is "
                                         r"its id; .*d\.jsonl:1 names it: the two would be one request of "
                                         r"two samples; give every row a request_id \(or none\)"):
        read_dump(_jsonl(tmp_path / "d.jsonl", rows), sampling=GREEDY)


def test_the_collision_is_refused_in_either_order(tmp_path):
    rows = [_row([7, 8]), _row([5, 6], uid=0)]  # an integer id names request "0" too
    with pytest.raises(InputError, match=r"d\.jsonl:2: request_id '0' is also the id of .*d\.jsonl:1, a row "
                                         r"without one"):
        read_dump(_jsonl(tmp_path / "d.jsonl", rows), sampling=GREEDY)


def test_ids_from_one_source_or_a_mix_without_collision_still_read(tmp_path):
    none = read_dump(_jsonl(tmp_path / "a.jsonl", [_row([5, 6]), _row([7, 8])]), sampling=GREEDY)
    assert [r.key for r in none.rollouts] == [("0", 0), ("1", 0)]
    rows = [_row([5, 6], uid="g"), _row([7, 8], uid="g"), _row([7, 9], request_id=3)]
    given = read_dump(_jsonl(tmp_path / "b.jsonl", rows), sampling=GREEDY)
    assert [r.key for r in given.rollouts] == [("g", 0), ("g", 1), ("3", 0)]
    mixed = read_dump(_jsonl(tmp_path / "c.jsonl", [_row([5, 6]), _row([7, 8], request_id="b")]),
                      sampling=GREEDY)
    assert [r.key for r in mixed.rollouts] == [("0", 0), ("b", 0)]


# -- 2. a recorded sample its request never asked for ---------------------------------------------------


def _record(tmp_path, indices: tuple[int, ...], n: int = 2) -> str:
    request = Request(prompt_ids=(1, 2), sampling=SamplingParams(n=n), request_id="a")
    rollouts = [Rollout("a", i, (1, 2), (5,), (-0.1,), "stop", "vllm") for i in indices]
    path = write_record(tmp_path / "rec.jsonl", [request])  # write_record refuses the bad ones itself
    with open(path, "a") as f:
        f.writelines(json.dumps({"kind": "rollout", **r.to_dict()}) + "\n" for r in rollouts)
    return str(path)


def test_a_record_rollout_past_its_requests_n_is_refused(tmp_path):
    with pytest.raises(InputError, match=r"rec\.jsonl:4: rollout \('a', 2\) of backend 'vllm' has "
                                         r"sample_index 2 but its request asks for n=2 samples "
                                         r"\(indices 0 to 1\)"):
        read_record(_record(tmp_path, (0, 2)))


def test_a_record_within_n_still_reads(tmp_path):
    assert [r.key for r in read_record(_record(tmp_path, (0, 1))).rollouts["vllm"]] == [("a", 0), ("a", 1)]


# -- 3. top_k -1 is "off" everywhere; a float is refused everywhere ------------------------------------


@pytest.mark.parametrize("minus_one", [-1, np.int64(-1), torch.tensor(-1)])
def test_top_k_minus_one_is_off_in_dumps_batches_and_the_monitor(tmp_path, minus_one):
    assert checked_sampling({"top_k": minus_one, "temperature": 0.7}) == {"top_k": 0, "temperature": 0.7}
    assert sampling_of({"top_k": minus_one}, None) == {"top_k": 0}
    if not isinstance(minus_one, torch.Tensor):  # a dump row holds numbers (JSON, Parquet)
        row = _row([5, 6], top_k=int(minus_one), temperature=0.7)
        dump = read_dump(_jsonl(tmp_path / "d.jsonl", [row]))
        assert dump.rollouts[0].sampling.top_k == 0
    with Monitor(tmp_path / "m", **QUIET) as m:
        logged = m.log(0, sampling={"top_k": minus_one}, rollout_log_probs=np.full((1, 2), -0.5),
                       old_log_probs=np.full((1, 2), -0.5), response_mask=np.ones((1, 2), np.int64))
    assert logged["sampling"] == {"top_k": 0}


def test_a_float_top_k_is_refused_everywhere(tmp_path):
    with pytest.raises(InputError, match=r"top_k must be an integer >= 0 .*got -1\.0"):
        checked_sampling({"top_k": -1.0})
    with pytest.raises(InputError, match=r"top_k must be an integer >= 0 .*got -1\.0"):
        checked_sampling(sampling_of({"top_k": -1.0}, None))  # what the integrations hand the monitor
    with pytest.raises(InputError, match=r"top_k must be an integer, got -1\.0"):
        read_dump(_jsonl(tmp_path / "d.jsonl", [_row([5, 6], top_k=-1.0, temperature=0.7)]))
    with pytest.raises(InputError, match=r"top_k must be an integer >= 0"):
        read_dump(_jsonl(tmp_path / "e.jsonl", [_row([5, 6], sampling={"top_k": -1.0})]))


def test_top_k_off_is_the_one_rule():
    assert row_sampling.top_k_off is top_k_off
    assert top_k_off(-1) == 0 and top_k_off(np.int32(40)) == 40 and type(top_k_off(np.int32(40))) is int
    assert top_k_off(-1.0) == -1.0 and top_k_off(True) is True


# -- 4. narrow float scalars as the decimal their dtype stands for ----------------------------------------


NARROW_07 = [torch.tensor(0.7, dtype=torch.bfloat16), np.float16(0.7), torch.tensor(0.7, dtype=torch.float16),
             np.float32(0.7), torch.tensor(0.7)]


@pytest.mark.parametrize("value", NARROW_07)
def test_a_narrow_temperature_is_stored_and_keyed_as_the_decimal(tmp_path, value):
    # old: a bfloat16 0.7 was stored and keyed 0.69921875, a float16's 0.7001953125
    assert checked_sampling({"temperature": value, "top_p": value}) == {"temperature": 0.7, "top_p": 0.7}
    assert sampling_key(checked_sampling({"temperature": value})) == sampling_key({"temperature": 0.7})
    assert sampling_of({"temperature": value}, None) == {"temperature": 0.7}


def test_a_bfloat16_step_shares_its_jump_baseline_with_the_decimal(tmp_path):
    arrays = {"old_log_probs": np.full((2, 4), -0.5), "response_mask": np.ones((2, 4), np.int64)}
    with Monitor(tmp_path, jumps={"mean_abs_logprob_diff": 5.0}, **QUIET) as m:
        for step in range(5):
            m.log(step, sampling={"temperature": 0.7}, rollout_log_probs=np.full((2, 4), -0.51), **arrays)
        drifted = np.full((2, 4), -0.5)
        drifted[1, 1] = -1.5
        record = m.log(5, sampling={"temperature": torch.tensor(0.7, dtype=torch.bfloat16)},
                       rollout_log_probs=drifted, **arrays)
    assert record["sampling"] == {"temperature": 0.7}
    assert [a["key"] for a in record["alerts"]] == ["mean_abs_logprob_diff"]


def test_the_narrow_rule_goes_by_the_dtype_only():
    # a Python or float64 0.69921875 is no bfloat16: nothing says digits were dropped, so it stays
    assert scalar_meant(0.69921875) == 0.69921875 and scalar_meant(np.float64(0.69921875)) == 0.69921875
    assert checked_sampling({"temperature": 0.69921875}) == {"temperature": 0.69921875}
    # distinct bfloat16 values stay distinct, and each reads back as itself
    up = torch.nextafter(torch.tensor(0.7, dtype=torch.bfloat16), torch.tensor(1.0, dtype=torch.bfloat16))
    assert scalar_meant(up) != 0.7 and torch.tensor(scalar_meant(up), dtype=torch.bfloat16) == up
    assert scalar_meant(torch.tensor(0.95, dtype=torch.bfloat16)) == 0.95
    assert scalar_meant(np.float16(1.5)) == 1.5 and scalar_meant(torch.tensor(3)) == 3
    assert scalar_meant(np.float16(np.inf)) == np.inf


# -- 5. a 0-d array named by its own shape --------------------------------------------------------------


@pytest.mark.parametrize("scalar", [np.array(-0.5), np.float64(-0.5)])
def test_a_0d_input_is_named_by_its_shape(scalar):
    with pytest.raises(InputError, match=r"train_logprobs must be 2-D \[batch, seq\], got shape \(\)$"):
        token_arrays(scalar, scalar, np.array(1))
    with pytest.raises(InputError, match=r"and mask \(\) must have the same"):
        token_arrays(np.zeros((1, 2)), np.zeros((1, 2)), np.array(1))


def test_non_contiguous_arrays_still_read():
    tok = token_arrays(np.zeros((2, 4))[:, ::2], np.zeros((2, 2)), np.ones((2, 2))[::-1])
    assert tok.shape == (2, 2) and tok.total == 4


# -- 6. more of the kind: unsigned masks and arrays torch cannot read -------------------------------------


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.uint64])
def test_an_unsigned_mask_is_read_like_any_integer_mask(dtype):
    # old: NotImplementedError ("aminmax_cpu" not implemented for 'UInt32'), no ParityError
    mask = np.array([[1, 1, 0], [1, 0, 0]], dtype)
    summary = summarize(np.full((2, 3), -0.4), np.full((2, 3), -0.5), mask)
    assert summary["mean_abs_logprob_diff"] == pytest.approx(0.1)
    with pytest.raises(InputError, match="mask must be bool or hold only 0 and 1"):
        token_arrays(np.zeros((1, 2)), np.zeros((1, 2)), np.array([[1, 2]], dtype))


@pytest.mark.parametrize("given, got", [(np.zeros((1, 2), np.longdouble), "an array of dtype float128"),
                                        (np.zeros((1, 2), object), "an array of dtype object"),
                                        ([[-0.5, -0.5], [-0.5]], "list")])
def test_an_unreadable_array_is_named_as_given(given, got):
    # old: "must be a torch tensor or NumPy array of shape [batch, seq]" for a NumPy array of that shape
    with pytest.raises(InputError, match=rf"train_logprobs must be a torch tensor or NumPy array of numbers, "
                                         rf"\[batch, seq\], got {got} \("):
        token_arrays(given, np.zeros((1, 2)), np.ones((1, 2)))
