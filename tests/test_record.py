"""Record/replay: round trips, replay through three backends, old records, bad records."""

import importlib.util
import json

import pytest

from parity.backends import close_shared_backends, shared_backend
from parity.core.errors import ConfigError, InputError
from parity.core.types import Request, SamplingParams
from parity.rollouts.command import main as replay_main
from parity.rollouts.record import read_record, replay, write_record

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
@pytest.mark.engine_host
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


def test_bad_record_names_the_line(tmp_path):
    rec = tmp_path / "rec.jsonl"
    write_record(rec, REQUESTS)
    lines = rec.read_text().splitlines()
    rec.write_text("\n".join([lines[0], lines[1].replace('"seed": 11', '"seed": -1')]) + "\n")
    with pytest.raises(ConfigError, match=r"rec.jsonl:2: sampling.seed"):
        read_record(rec)
    dump = tmp_path / "dump.jsonl"
    dump.write_text(json.dumps({"prompt_ids": [1], "response_ids": [3], "rollout_logprobs": [-0.1]}) + "\n")
    with pytest.raises(InputError, match="header"):
        read_record(dump)


def test_old_records_take_each_rollouts_sampling_from_its_request(hf_record, tmp_path):
    """Records written before rollouts carried their sampling still load: the request has it."""
    lines = [json.loads(line) for line in hf_record.read_text().splitlines()]
    assert all("sampling" in line for line in lines if line["kind"] == "rollout")
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps({k: v for k, v in line.items() if not (k == "sampling" and
                                       line["kind"] == "rollout")}) + "\n" for line in lines))
    assert "sampling" not in old.read_text().splitlines()[-1]
    by_id = {r.request_id: r.sampling for r in REQUESTS}
    assert [r.sampling for r in read_record(old).rollouts["hf"]] == [by_id["a"], by_id["a"], by_id["b"]]
    assert read_record(old).rollouts == read_record(hf_record).rollouts


@pytest.fixture(scope="session", autouse=True)
def _close_engines_before_exit():
    """Close engines while pytest's streams are open (vLLM logs on shutdown)."""
    yield
    close_shared_backends()
