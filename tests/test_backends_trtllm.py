"""TensorRT-LLM adapter: translation and `CompletionOutput` parsing in both logprobs layouts.

TRT-LLM does not run on these CPU machines; tests/data/documented_format/trtllm_completions.json holds
`CompletionOutput`s as JSON in the documented layouts (see generate.py there).
"""

import json
from pathlib import Path

import pytest

from parity.backends.base import SampleJob
from parity.backends.trtllm import parse_completion, parse_prompt_logprobs, token_logprob, translate_sampling
from parity.core.errors import BackendError, ConfigError
from parity.core.types import Request, SamplingParams

#: outputs generated in the backend's documented format, not captured from a server (see generate.py there)
DATA = Path(__file__).parent / "data" / "documented_format"
DOCUMENTED = json.loads((DATA / "trtllm_completions.json").read_text())


def job(**kw):
    return SampleJob(Request((1, 2, 3), SamplingParams(**kw), "q"), 0, 77)


def test_translation():
    fields = translate_sampling(job(temperature=0.7, max_tokens=9, stop_token_ids=(5,)), (2,),
                                has_logprobs_mode=True)
    assert fields["top_k"] == 0 and fields["max_tokens"] == 9 and fields["seed"] == 77
    assert fields["stop_token_ids"] == [5, 2] and fields["end_id"] == 2
    assert fields["logprobs_mode"] == "processed_logprobs" and fields["logprobs"] == 1
    ignored = translate_sampling(job(ignore_eos=True, logprobs_mode="raw"), (2,), has_logprobs_mode=True)
    assert ignored["stop_token_ids"] == [] and ignored["end_id"] == -1
    assert ignored["logprobs_mode"] == "raw_logprobs"


def test_processed_refused_where_trtllm_reports_raw_only():
    with pytest.raises(ConfigError, match="raw logprobs only"):
        translate_sampling(job(temperature=0.7), (2,), has_logprobs_mode=False)
    assert "logprobs_mode" not in translate_sampling(job(logprobs_mode="raw"), (2,), has_logprobs_mode=False)


def test_parse_both_logprobs_layouts():
    for prompt, completion, expected in zip(DOCUMENTED["prompts"], DOCUMENTED["completions"],
                                            DOCUMENTED["expected_logprobs"]):
        tokens, logprobs, finish = parse_completion(completion)
        assert tokens == completion["token_ids"] and logprobs == pytest.approx(expected, abs=0)
        assert finish in ("stop", "length")
        scored = parse_prompt_logprobs(completion, prompt, tokens)
        assert scored == pytest.approx(expected, abs=1e-5)  # teacher-forced raw == raw rollout logprobs


def test_parse_errors():
    with pytest.raises(BackendError, match="logprobs=1"):
        parse_completion({"token_ids": [1, 2], "logprobs": [-0.5]})
    with pytest.raises(BackendError, match="sampled token 7"):
        token_logprob({"8": {"logprob": -1.0}}, 7)
    with pytest.raises(BackendError, match="prompt logprobs"):
        parse_prompt_logprobs({"prompt_logprobs": [-1.0]}, [1, 2], [3])


def test_a_dump_in_trtllm_output_layout_is_scored_by_parity_score(tmp_path, capsys):
    """What a TensorRT-LLM user does instead of the adapter (it cannot run here, docs/BACKENDS.md):
    write each `RequestOutput`'s `prompt_token_ids` and its `CompletionOutput` fields as they are
    (`token_ids`, `logprobs` in either layout, `finish_reason`) as JSONL, and `parity score` it. The
    logprobs are the fp32 reference engine's (written on another host: 4e-06 nats from this host's fp32
    training forward); one logprob shifted by 0.5 nats is the negative control."""
    from parity.cli import main

    rows = [{"prompt_token_ids": prompt, "token_ids": c["token_ids"], "logprobs": c["logprobs"],
             "finish_reason": c["finish_reason"], "logprobs_mode": "raw", "temperature": 1.0}
            for prompt, c in zip(DOCUMENTED["prompts"], DOCUMENTED["completions"])]
    assert isinstance(rows[0]["logprobs"][0], float) and isinstance(rows[1]["logprobs"][0], dict)
    dump = tmp_path / "trtllm.jsonl"
    dump.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "score.json"
    assert main(["score", str(dump), "--model", DOCUMENTED["model"], "--dtype", "float32", "--rollout-dtype",
                 "float32", "--logprobs-mode", "raw", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    assert summary["num_tokens"] == sum(len(c["token_ids"]) for c in DOCUMENTED["completions"])
    assert summary["max_abs_logprob_diff"] < 1e-4
    first = rows[1]["token_ids"][0]
    rows[1]["logprobs"][0] = {str(first): {"logprob": rows[1]["logprobs"][0][str(first)]["logprob"] - 0.5,
                                           "rank": 1}}
    dump.write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(["score", str(dump), "--model", DOCUMENTED["model"], "--dtype", "float32", "--rollout-dtype",
          "float32", "--logprobs-mode", "raw", "--json", str(out)])
    assert json.loads(out.read_text())["summary"]["max_abs_logprob_diff"] == pytest.approx(0.5, abs=1e-4)


def test_a_trtllm_dict_entry_without_the_sampled_token_is_refused(tmp_path):
    from parity.core.errors import InputError
    from parity.rollouts.dumps import read_dump

    dump = tmp_path / "bad.jsonl"
    dump.write_text(json.dumps({"prompt_token_ids": [1, 2], "token_ids": [5],
                                "logprobs": [{"6": {"logprob": -1.0}}], "logprobs_mode": "raw"}) + "\n")
    with pytest.raises(InputError, match="no logprob of the sampled token 5"):
        read_dump(dump, logprobs_mode="raw")
