"""Round 17, records and sampling: `temperature = -0.0` is the 0.0 (greedy) it means, so it writes
and hashes as 0.0 (it gave the same workload another case hash); a record header's version must be
the integer 1 (`true` and `1.0` read as version 1); `write_record` refuses what `read_record` would
refuse (a sample past its request's n, a rollout of no request, ...) before writing anything, by
the same check. No engine starts.
"""

from __future__ import annotations

import json
import math

import pytest

from parity.core.errors import ConfigError, InputError
from parity.core.types import Request, Rollout, SamplingParams
from parity.rollouts.record import read_record, write_record
from parity.workload.cases import Case

# -- 1. -0.0 is 0.0 ------------------------------------------------------------------------------


@pytest.mark.parametrize("build", [lambda: SamplingParams(temperature=-0.0),
                                   lambda: SamplingParams.from_dict({"temperature": -0.0}),
                                   lambda: SamplingParams().replace(temperature=-0.0)])
def test_a_negative_zero_temperature_writes_as_zero(build):
    sampling = build()
    assert math.copysign(1.0, sampling.temperature) == 1.0
    assert json.dumps(sampling.to_dict()["temperature"]) == "0.0"
    assert sampling.to_dict() == SamplingParams(temperature=0.0).to_dict()


def test_a_negative_zero_temperature_is_the_same_case_hash():
    def case(temperature: float) -> Case:
        request = Request((1, 2, 3), SamplingParams(temperature=temperature, max_tokens=4), "a")
        return Case(name="z", model="tiny-llama", requests=(request,))

    assert case(-0.0).hash == case(0.0).hash


def test_a_negative_zero_top_p_stays_refused():
    with pytest.raises(ConfigError, match=r"sampling\.top_p must be in \(0, 1\]"):
        SamplingParams(top_p=-0.0)


# -- 2. a header's version is the integer 1 ------------------------------------------------------


def _header_only(tmp_path, version) -> str:
    path = tmp_path / "rec.jsonl"
    path.write_text(json.dumps({"kind": "header", "format": "parity-record", "version": version,
                                "model": None, "meta": {}}) + "\n")
    return str(path)


@pytest.mark.parametrize("version", [True, 1.0, "1"])
def test_a_record_version_that_is_not_the_integer_1_is_refused(tmp_path, version):
    with pytest.raises(InputError, match=r"rec\.jsonl:1: not a parity-record v1 header: "
                                         r"format='parity-record' version="):
        read_record(_header_only(tmp_path, version))


def test_a_record_of_version_1_still_reads(tmp_path):
    assert read_record(_header_only(tmp_path, 1)).requests == ()
    written = write_record(tmp_path / "w.jsonl", [Request((1, 2), request_id="a")])
    assert json.loads(written.read_text().splitlines()[0])["version"] == 1
    assert read_record(written).requests == (Request((1, 2), request_id="a"),)


# -- 3. write_record refuses what read_record refuses ----------------------------------------------

REQUEST = Request((1, 2), SamplingParams(n=2), "a")


def _rollout(request_id: str = "a", index: int = 0, prompt: tuple[int, ...] = (1, 2)) -> Rollout:
    return Rollout(request_id, index, prompt, (5,), (-0.1,), "stop", "vllm")


@pytest.mark.parametrize(("rollouts", "match"), [
    ([_rollout(index=2)], r"rollout \('a', 2\) of backend 'vllm' has sample_index 2 but its request "
                          r"asks for n=2 samples"),
    ([_rollout("b")], r"rollout \('b', 0\) answers request_id 'b', which no request line of the "
                      r"record names"),
    ([_rollout(), _rollout()], r"rollout \('a', 0\) of backend 'vllm' appears more than once"),
    ([_rollout(prompt=(1, 3))], r"for a prompt of 2 tokens that is not the request's"),
])
def test_write_record_refuses_what_read_record_refuses_and_writes_nothing(tmp_path, rollouts, match):
    path = tmp_path / "rec.jsonl"
    with pytest.raises(InputError, match=match):
        write_record(path, [REQUEST], rollouts)
    assert not path.exists()
    path.write_text("an earlier record\n")  # and an existing file is left as it was
    with pytest.raises(InputError, match=match):
        write_record(path, [REQUEST], rollouts)
    assert path.read_text() == "an earlier record\n"


@pytest.mark.parametrize(("kwargs", "match"), [({"model": 3}, r"header model must be a string"),
                                               ({"meta": ["case"]}, r"header meta must be an object")])
def test_write_record_refuses_a_header_read_record_refuses(tmp_path, kwargs, match):
    with pytest.raises(InputError, match=match):
        write_record(tmp_path / "rec.jsonl", [REQUEST], **kwargs)
    assert not (tmp_path / "rec.jsonl").exists()


def test_a_good_record_still_writes_and_reads(tmp_path):
    path = write_record(tmp_path / "rec.jsonl", [REQUEST], [_rollout(index=0), _rollout(index=1)],
                        model="tiny-llama", meta={"case": "unit"})
    record = read_record(path)
    assert [r.key for r in record.rollouts["vllm"]] == [("a", 0), ("a", 1)]
    assert all(r.sampling == REQUEST.sampling for r in record.rollouts["vllm"])
