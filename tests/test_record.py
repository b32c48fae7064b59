"""Record/replay and offline ingestion: round trips, replay through three backends, bad dumps."""

import importlib.util
import json

import numpy as np
import pytest

from parity.backends import close_shared_backends, shared_backend
from parity.errors import ConfigError, InputError
from parity.record import dump_rollouts, load_rollouts, read_record, replay, replay_main, write_record
from parity.types import Request, Rollout, SamplingParams

REQUESTS = [
    Request((1, 40, 41, 42), SamplingParams(n=2, temperature=0.7, top_p=0.9, max_tokens=6, seed=11), "a"),
    Request((1, 70, 71), SamplingParams(temperature=0, max_tokens=5, stop_token_ids=(9,)), "b"),
]


@pytest.fixture(scope="module")
def hf_record(tmp_path_factory):
    hf = shared_backend("hf", "tiny-llama", dtype="float32")
    path = tmp_path_factory.mktemp("rec") / "run.jsonl"
    write_record(path, REQUESTS, hf.generate(REQUESTS), model="tiny-llama", meta={"case": "unit"})
    return path


def test_record_round_trip(hf_record):
    record = read_record(hf_record)
    assert record.requests == tuple(REQUESTS)  # every sampling field and seed survives
    assert record.model == "tiny-llama" and record.meta == {"case": "unit"}
    assert [r.key for r in record.rollouts["hf"]] == [("a", 0), ("a", 1), ("b", 0)]


def keys_and_prompts(rollouts):
    return [(r.key, r.prompt_ids) for r in rollouts]


def test_replay_through_reference_and_hf_gives_identical_requests(hf_record):
    record = read_record(hf_record)
    want = keys_and_prompts(record.rollouts["hf"])
    for name in ("reference", "hf"):
        assert keys_and_prompts(replay(record, shared_backend(name, "tiny-llama", dtype="float32"))) == want


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_replay_through_vllm(hf_record):
    record = read_record(hf_record)
    vllm = shared_backend("vllm", "tiny-llama", dtype="bfloat16")
    rollouts = replay(record, vllm)
    assert keys_and_prompts(rollouts) == keys_and_prompts(record.rollouts["hf"])
    assert all(r.backend == "vllm" and r.meta["backend_version"] for r in rollouts)


def test_replay_main_writes_a_record_with_both_backends(hf_record, tmp_path):
    out = tmp_path / "run.hf32.jsonl"
    argv = [str(hf_record), "--backend", "hf", "--dtype", "float32", "--option", "batch_size=2",
            "--out", str(out)]
    assert replay_main(argv) == 0
    record = read_record(out)
    # the replayed backend's rollouts replace its old ones; the requests are unchanged
    assert record.requests == tuple(REQUESTS) and set(record.rollouts) == {"hf"}
    assert record.rollouts["hf"][0].meta["batch_size"] == 2


def test_replay_main_reports_errors(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind": "request"}\n')
    assert replay_main([str(bad), "--backend", "hf"]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_ingestion_round_trip(tmp_path, suffix):
    routes = np.arange(4 * 2 * 2, dtype=np.int32).reshape(4, 2, 2) % 8
    rollouts = [Rollout("p0", 0, (1, 5, 6), (7, 8), (-0.5, -1.25), "length", "trtllm",
                        routed_experts=routes),
                Rollout("p0", 1, (1, 5, 6), (9,), (-2.0,), "stop", "trtllm", logprobs_mode="raw")]
    loaded = load_rollouts(dump_rollouts(tmp_path / f"dump{suffix}", rollouts), backend="trtllm")
    for a, b in zip(rollouts, loaded):
        assert (a.key, a.prompt_ids, a.token_ids, a.logprobs, a.finish_reason, a.logprobs_mode) == \
            (b.key, b.prompt_ids, b.token_ids, b.logprobs, b.finish_reason, b.logprobs_mode)
    assert np.array_equal(loaded[0].routed_experts, routes) and loaded[1].routed_experts is None


def test_ingestion_accepts_verl_batch_names_and_padding(tmp_path):
    row = {"prompts": [1, 5], "responses": [7, 8, 0, 0], "rollout_log_probs": [-0.1, -0.2, 0.0, 0.0],
           "response_mask": [1, 1, 0, 0]}
    path = tmp_path / "verl.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (r,) = load_rollouts(path, backend="verl-vllm")
    assert r.token_ids == (7, 8) and r.logprobs == (-0.1, -0.2) and r.request_id == "0"


GOOD = {"prompt_ids": [1, 2], "response_ids": [3, 4], "rollout_logprobs": [-0.1, -0.2]}


@pytest.mark.parametrize("bad, match", [
    ({k: v for k, v in GOOD.items() if k != "response_ids"}, "missing field 'response_ids'"),
    ({**GOOD, "rollout_logprobs": [-0.1]}, "2 response ids but 1 rollout logprobs"),
    ({**GOOD, "rollout_logprobs": [-0.1, float("nan")]}, "logprob 1 is nan"),
    ({**GOOD, "rollout_logprobs": [-0.1, 3.5]}, "logits or probabilities"),
    ({**GOOD, "prompt_ids": [1, -2]}, "prompt_ids must be non-negative integers"),
    ({**GOOD, "routed_experts": [[[0, 1]]]}, "routed_experts has 1 positions"),
])
def test_bad_dump_names_the_line(tmp_path, bad, match):
    path = tmp_path / "dump.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps(bad) + "\n")  # NaN written as JSON NaN
    with pytest.raises(InputError, match=match) as info:
        load_rollouts(path)
    assert "dump.jsonl:3:" in str(info.value)


def test_bad_json_and_bad_record(tmp_path):
    path = tmp_path / "dump.jsonl"
    path.write_text(json.dumps(GOOD) + "\n{not json\n")
    with pytest.raises(InputError, match=r"dump.jsonl:2: invalid JSON"):
        load_rollouts(path)
    rec = tmp_path / "rec.jsonl"
    write_record(rec, REQUESTS)
    lines = rec.read_text().splitlines()
    rec.write_text("\n".join([lines[0], lines[1].replace('"seed": 11', '"seed": -1')]) + "\n")
    with pytest.raises(ConfigError, match=r"rec.jsonl:2: sampling.seed"):
        read_record(rec)
    with pytest.raises(InputError, match="header"):
        read_record(path)


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="pyarrow is not installed")
def test_bad_parquet_row_is_named(tmp_path):
    import pyarrow as pa  # optional dependency: present with the dev extra
    import pyarrow.parquet as pq

    rows = [GOOD, {**GOOD, "rollout_logprobs": [-0.1, float("nan")]}]
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "dump.parquet"))
    with pytest.raises(InputError, match=r"dump.parquet row 2: logprob 1 is nan"):
        load_rollouts(tmp_path / "dump.parquet")


@pytest.fixture(scope="session", autouse=True)
def _close_engines_before_exit():
    """Close engines while pytest's streams are open (vLLM logs on shutdown)."""
    yield
    close_shared_backends()
