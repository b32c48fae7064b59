"""Round 10, compare's checks before an engine starts and the stopping rules: a mix of top-k requests
refused before sampling, the tokenizer's eos token in parity's stop set (vLLM stops on it), and the
vLLM server's answers read into BackendErrors that name where, not bare KeyError/ValueError."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest
from conftest import EngineStarted

from parity.backends.base import SampleJob, eos_token_ids, stop_set
from parity.backends.vllm_wire import completion_body, parse_completion, prompt_logprob_rows, top_k_rows
from parity.core.errors import BackendError, ConfigError
from parity.core.top_k import TopKError
from parity.core.types import Request, SamplingParams
from parity.models.checkpoints import builtin_path, tokenizer_eos_id
from parity.workload.cases import Case

compare_module = importlib.import_module("parity.compare")


@pytest.fixture
def no_engine(no_compare_engine):
    return no_compare_engine


def _case(*top_k: int) -> Case:
    s = SamplingParams(max_tokens=4)
    return Case(name="mix", model="tiny-llama", requests=tuple(
        Request((5, 6, 7 + i), s.replace(seed=i, top_k_logprobs=k), request_id=f"r{i}")
        for i, k in enumerate(top_k)))


@pytest.mark.parametrize("top_k", [(2, 0), (0, 3), (2, 3)])
def test_a_mix_of_top_k_requests_is_refused_before_the_engine_starts(no_engine, top_k):
    # old: sampled, then has_top_k's InputError (or "different k") after the engine ran
    with pytest.raises(TopKError, match=r"request 'r\d' asks for top_k_logprobs=\d but request 'r\d' for \d"):
        compare_module.compare(None, "reference", case=_case(*top_k), dtype="float32", gold=False)


@pytest.mark.parametrize("top_k", [(2, 2), (0, 0)])
def test_one_top_k_for_every_request_still_runs(no_engine, top_k):
    with pytest.raises(EngineStarted):
        compare_module.compare(None, "reference", case=_case(*top_k), dtype="float32", gold=False)


def test_the_top_k_argument_asks_every_request_of_a_mixed_case(no_engine):
    with pytest.raises(EngineStarted):
        compare_module.compare(None, "reference", case=_case(2, 0), dtype="float32", gold=False,
                               top_k_logprobs=2)


def test_a_sweep_file_with_top_k_in_one_block_is_refused_before_sampling(no_engine, tmp_path):
    case = tmp_path / "sweep.toml"
    case.write_text('model = "tiny-llama"\n[prompts]\ntoken_ids = [[5, 6, 7]]\n'
                    '[[sampling]]\nmax_tokens = 4\ntop_k_logprobs = 2\n'
                    '[[sampling]]\nmax_tokens = 4\ntemperature = 0.5\n')
    with pytest.raises(TopKError, match="give every sampling block the same top_k_logprobs"):
        compare_module.compare(None, "reference", case=case, dtype="float32", gold=False)


def _with_tokenizer_eos(tmp_path: Path, eos: object, file: str = "tokenizer_config.json") -> Path:
    path = tmp_path / "m"
    shutil.copytree(builtin_path("tiny-llama"), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    if file == "tokenizer_config.json":
        config["eos_token"] = eos
    else:
        config.pop("eos_token")
        (path / file).write_text(json.dumps({"eos_token": eos}))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_builtin_checkpoints_keep_their_one_eos():
    for name in ("tiny-llama", "tiny-qwen3", "tiny-mixtral"):
        assert eos_token_ids(builtin_path(name)) == (2,)
        assert tokenizer_eos_id(builtin_path(name)) == 2


@pytest.mark.parametrize(("eos", "file"), [("<s>", "tokenizer_config.json"),
                                           ({"content": "<s>", "special": True}, "tokenizer_config.json"),
                                           ("<s>", "special_tokens_map.json")])
def test_the_tokenizer_eos_is_in_the_stop_set(tmp_path, eos, file):
    # vLLM's server stops on tokenizer.eos_token_id (1 here) besides generation_config's [2]; old: (2,)
    path = _with_tokenizer_eos(tmp_path, eos, file)
    assert eos_token_ids(path) == (2, 1)
    assert stop_set(SamplingParams(stop_token_ids=(9,)), eos_token_ids(path)) == (9, 2, 1)
    assert stop_set(SamplingParams(ignore_eos=True), eos_token_ids(path)) == ()
    job = SampleJob(Request((5, 6), SamplingParams(), request_id="a"), 0, 0)
    assert completion_body(job, eos_token_ids(path), "m")["stop_token_ids"] == [2, 1]


def test_the_reference_engine_stops_on_the_tokenizer_eos(tmp_path):
    from parity.engine import ReferenceEngine

    request = Request((5, 6, 7), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                      request_id="a")
    with ReferenceEngine(str(builtin_path("tiny-llama")), dtype="float32", device="cpu") as engine:
        first = engine.generate([request])[0].token_ids[0]
    vocab = json.loads((builtin_path("tiny-llama") / "tokenizer.json").read_text())["model"]["vocab"]
    path = _with_tokenizer_eos(tmp_path, next(t for t, i in vocab.items() if i == first))
    stopping = Request((5, 6, 7), SamplingParams(temperature=0.0, max_tokens=6), request_id="a")
    with ReferenceEngine(str(path), dtype="float32", device="cpu") as engine:
        rollout = engine.generate([stopping])[0]
    assert rollout.token_ids == (first,)  # old: ran on to max_tokens past the token vLLM stops on
    assert rollout.finish_reason == "stop"


def _scored(rows: list) -> dict:
    return {"choices": [{"prompt_logprobs": rows}]}


def test_a_prompt_logprob_row_without_the_token_is_a_backend_error():
    rows = prompt_logprob_rows(_scored([None, {"5": {"logprob": -1.0}}, {"7": {"logprob": -0.5}}]), 1)
    assert rows[0][5] == -1.0 and rows == [{5: -1.0}, {7: -0.5}]
    with pytest.raises(BackendError, match="position 2 hold no logprob for token 8"):  # old: KeyError 8
        rows[1][8]


@pytest.mark.parametrize("row", [None, {"5": {}}, {"5": {"logprob": None}}])
def test_a_prompt_logprob_row_of_no_entries_is_a_backend_error(row):
    with pytest.raises(BackendError, match="position 1 are not"):  # old: AttributeError, KeyError
        prompt_logprob_rows(_scored([None, row]), 1)


def test_tokens_named_as_text_are_a_backend_error():
    answer = {"choices": [{"token_ids": [5], "finish_reason": "length",
                           "logprobs": {"tokens": ["hi"], "token_logprobs": [-1.0],
                                        "top_logprobs": [{"hi": -1.0}]}}]}
    with pytest.raises(BackendError, match="ignored return_tokens_as_token_ids"):  # old: ValueError
        parse_completion(answer)
    with pytest.raises(BackendError, match="ignored return_tokens_as_token_ids"):
        top_k_rows(answer, [5], 1)
    answer["choices"][0]["logprobs"]["tokens"] = ["token_id:5"]
    assert parse_completion(answer)[:2] == ([5], [-1.0])


@pytest.mark.parametrize("tp", [True, 0, -2, "2", 2.0])
def test_a_tensor_parallel_degree_that_is_no_count_is_refused_before_the_engine_starts(no_engine, tp):
    # old: True ran a degree of 1 recorded as True; 0 reached the engine, which refused it as it started
    with pytest.raises(ConfigError, match=r"tensor_parallel \(--tp\) must be an integer >= 1"):
        compare_module.compare("tiny-llama", "vllm", prompts=[[5, 6, 7]], tensor_parallel=tp, gold=False)


def test_a_tensor_parallel_degree_still_runs(no_engine):
    with pytest.raises(EngineStarted):
        compare_module.compare("tiny-llama", "reference", prompts=[[5, 6, 7]], tensor_parallel=2, gold=False,
                               dtype="float32")
