"""No silent wrong numbers, round 5 (requests into the engines, logprobs back): each input below was
run otherwise than asked, or read back into something the engine did not say, on the old code, with
no word: vLLM raising a small temperature to 0.01, SGLang sampling a tiny one greedily or running past
stop ids under ignore_eos, a server's own sampling defaults, HF applying the checkpoint's
generation_config.json, a vLLM server's top-k row one entry too long. Each is now refused before the
engine starts (`check_requests`), or translated so the engine runs what was asked. No engine starts
here: the translations are called directly, the servers are local stubs, HF runs tiny-llama on CPU.
"""

from __future__ import annotations

import json
import shutil
from typing import ClassVar

import numpy as np
import pytest
from http_stub import StubHandler, serve

from parity.backends.base import SampleJob
from parity.backends.sglang import NEUTRAL_SAMPLING, SGLANG_MIN_TEMPERATURE, SGLangBackend
from parity.backends.sglang import translate_sampling as sglang_sampling
from parity.backends.vllm import VLLMBackend
from parity.backends.vllm_requests import VLLM_MIN_TEMPERATURE, translate_sampling
from parity.backends.vllm_server import VLLMServerBackend
from parity.backends.vllm_wire import top_k_rows
from parity.core.errors import BackendError, ConfigError
from parity.core.turns import Generate, Inject
from parity.core.types import Request, Rollout, SamplingParams
from parity.models import resolve_model


def job(**kw) -> SampleJob:
    return SampleJob(Request((1, 2, 3), SamplingParams(**kw), "q"), 0, 1234)


def trajectory(**kw) -> Request:
    return Request((1, 2), SamplingParams(max_tokens=12, **kw), "t",
                   turns=(Generate(4), Inject((5,)), Generate(4)))


# -- vLLM: a temperature below 0.01 is raised to 0.01 by vLLM -----------------------------------------


@pytest.mark.parametrize("temperature", [0.005, 1e-7])
def test_a_temperature_vllm_would_raise_is_refused(temperature):
    """vLLM's SamplingParams raises 0 < T < 0.01 to 0.01 with a log line only: parity would score the
    processed logprobs at T while vLLM sampled (and reported them) at 0.01."""
    with pytest.raises(ConfigError, match=rf"temperature={temperature} is below 0\.01.*temperature=0"):
        translate_sampling(job(temperature=temperature), (2,))
    assert translate_sampling(job(temperature=0.0), (2,))["temperature"] == 0.0  # greedy stays greedy
    assert translate_sampling(job(temperature=VLLM_MIN_TEMPERATURE), (2,))["temperature"] == 0.01


@pytest.mark.parametrize("adapter", [VLLMBackend, VLLMServerBackend])
def test_the_vllm_adapters_refuse_before_they_start(adapter):
    """Refused by `check_requests` (before an engine or server starts), not at the first generate."""
    with pytest.raises(ConfigError, match=r"below 0\.01"):
        adapter.check_requests([Request((1, 2), SamplingParams(temperature=0.001), "a")], {})
    with pytest.raises(ConfigError, match="above vLLM's limit"):
        adapter.check_requests([Request((1, 2), SamplingParams(temperature=2.5), "a")], {})
    with pytest.raises(ConfigError, match=r"logprobs_mode='raw' but backend .* logprobs_mode='processed'"):
        adapter.check_requests([Request((1, 2), SamplingParams(logprobs_mode="raw"), "a")], {})
    adapter.check_requests([Request((1, 2), SamplingParams(logprobs_mode="raw"), "a")],
                           {"logprobs_mode": "raw"})
    adapter.check_requests([trajectory(temperature=0.7)], {})  # trajectories run turn by turn


@pytest.mark.slow
def test_vllm_still_raises_small_temperatures():
    """The fact the refusal rests on, read off the installed vLLM (no engine starts)."""
    vllm = pytest.importorskip("vllm")
    assert vllm.SamplingParams(temperature=0.005).temperature == VLLM_MIN_TEMPERATURE


# -- vLLM server: a sampled token tying the k-th ------------------------------------------------------


def top_answer(tokens, positions):
    """A `/v1/completions` answer with `logprobs=k`: per position the sampled token, then the top-k."""
    logprobs = {"tokens": [f"token_id:{t}" for t in tokens],
                "token_logprobs": [dict(p)[t] for t, p in zip(tokens, positions)],
                "top_logprobs": [{f"token_id:{t}": v for t, v in p} for p in positions]}
    return {"choices": [{"index": 0, "token_ids": tokens, "finish_reason": "length", "logprobs": logprobs}]}


def test_a_sampled_token_tying_the_kth_but_not_picked_is_not_in_the_top_k():
    """k + 1 entries mean vLLM's top-k did not pick the sampled token (its rank, the count of logprobs
    >= its own, is k + 1, and the offline adapter leaves it out). It was kept when it tied the k-th:
    a row of k + 1 ids, which broke the rollout's array (a bare ValueError) or, for a one-token
    response, passed as a top-3 asked as a top-2."""
    positions = [[(7, -0.5), (7, -0.5), (3, -1.2)],   # sampled within the top-2
                 [(5, -1.0), (2, -0.5), (6, -1.0)]]   # ties the 2nd, not picked (bf16 logits tie often)
    ids, lps = top_k_rows(top_answer([7, 5], positions), [7, 5], 2)
    assert ids == [[7, 3], [2, 6]] and lps == [[-0.5, -1.2], [-0.5, -1.0]]
    rollout = Rollout("q", 0, (1,), (7, 5), (-0.5, -1.0), "length", "vllm-server", "raw",
                      sampling=SamplingParams(top_k_logprobs=2, logprobs_mode="raw"),
                      top_k_ids=np.array(ids), top_k_logprobs=np.array(lps))
    assert rollout.top_k_ids.shape == (2, 2)
    ids, _ = top_k_rows(top_answer([5], positions[1:]), [5], 2)
    assert ids == [[2, 6]]  # was [[2, 5, 6]]: three ids for top_k_logprobs=2
    with pytest.raises(BackendError, match="outside the top-2 but more likely than one inside"):
        top_k_rows(top_answer([5], [[(5, -0.7), (2, -0.5), (6, -1.0)]]), [5], 2)


# -- SGLang -------------------------------------------------------------------------------------------


def test_sglang_check_requests_takes_trajectories():
    """`parity compare --backend sglang` with turns was refused before anything ran ("a multi-turn
    trajectory; this backend runs it turn by turn"): check_requests expanded samples, which refuses
    turns, though the trajectory then runs turn by turn. Now it checks each request's sampling."""
    SGLangBackend.check_requests([trajectory(temperature=0.8)], {})
    with pytest.raises(ConfigError, match="not truncated"):  # the checks still apply to trajectories
        SGLangBackend.check_requests([trajectory(temperature=0.8, top_p=0.9)], {})


def test_a_temperature_sglang_samples_greedily_is_refused():
    """SGLang samples 0 <= T < 1e-6 greedily at temperature 1, so its "processed" logprobs are raw
    ones; parity converted only T == 0 to the point mass and scored the rest at T."""
    with pytest.raises(ConfigError, match=r"temperature=5e-07 is below 1e-06.*temperature=0"):
        sglang_sampling(job(temperature=5e-7), (2,), "processed")
    with pytest.raises(ConfigError, match="below 1e-06"):
        SGLangBackend.check_requests([Request((1,), SamplingParams(temperature=5e-7), "a")], {})
    sglang_sampling(job(temperature=0.0), (2,), "processed")
    sglang_sampling(job(temperature=SGLANG_MIN_TEMPERATURE), (2,), "processed")


def test_stop_ids_under_ignore_eos_are_refused_on_sglang():
    """SGLang's ignore_eos skips its stop_token_ids check too (Req.check_finished), unlike vLLM's and
    parity's meaning (stop ids still stop): its samples would run past the stop ids asked for."""
    with pytest.raises(ConfigError, match=r"ignore_eos also ignores stop_token_ids \[9\]"):
        sglang_sampling(job(ignore_eos=True, stop_token_ids=(9,)), (2,), "processed")
    with pytest.raises(ConfigError, match=r"ignore_eos also ignores stop_token_ids \[9\]"):
        stops = SamplingParams(ignore_eos=True, stop_token_ids=(9,))
        SGLangBackend.check_requests([Request((1,), stops, "a")], {})
    turn_stops = Request((1, 2), SamplingParams(max_tokens=12, ignore_eos=True), "t",
                         turns=(Generate(4, stop_token_ids=(7,)), Inject((5,)), Generate(4)))
    with pytest.raises(ConfigError, match=r"stop_token_ids \[7\]"):
        SGLangBackend.check_requests([turn_stops], {})
    assert sglang_sampling(job(ignore_eos=True), (2,), "processed")["stop_token_ids"] == []


def test_sglang_requests_carry_neutral_values_of_the_knobs_parity_does_not_model():
    """A server's --preferred-sampling-params fill every field a /generate request leaves out (SGLang's
    TokenizerManager merges them under the request's own): min_p or a repetition penalty would apply."""
    params = sglang_sampling(job(temperature=0.8), (2,), "processed")
    assert {key: params[key] for key in NEUTRAL_SAMPLING} == {
        "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


class InfoServer(StubHandler):
    """Answers `/get_server_info` with `info` (an attached SGLang server's settings)."""

    info: ClassVar[dict] = {}

    def do_GET(self):
        self.reply(self.info)


@pytest.fixture
def info_server():
    httpd = serve(InfoServer)
    yield httpd.url
    httpd.shutdown()


def test_an_attached_sglang_server_in_another_dtype_is_refused(info_server, monkeypatch):
    """vllm-server checked an attached server's dtype; sglang recorded it and ran on: a float16 server
    reported as bfloat16, judged by bfloat16's limits."""
    monkeypatch.setattr(InfoServer, "info", {"version": "stub", "dtype": "half"})
    with pytest.raises(ConfigError, match=r"runs dtype 'half' but dtype='bfloat16' was asked for; pass "
                                          r"dtype='float16'"):
        SGLangBackend("tiny-llama", base_url=info_server)
    assert SGLangBackend("tiny-llama", base_url=info_server, dtype="float16").dtype == "float16"
    monkeypatch.setattr(InfoServer, "info", {"version": "stub", "dtype": "auto"})  # resolved in the server
    assert SGLangBackend("tiny-llama", base_url=info_server).meta["server_settings"]["dtype"] == "auto"


# -- HF: the checkpoint's generation_config.json ------------------------------------------------------


def test_hf_does_not_apply_the_checkpoint_s_generation_defaults(tmp_path):
    """transformers fills every field parity's GenerationConfig leaves unset from the checkpoint's
    generation_config.json: min_p / typical_p / no_repeat_ngram_size truncated the sampled
    distribution, so the processed logprobs were 0.0 where the trainer's were -0.7 to -2.7."""
    from parity.backends.hf import HFBackend  # torch and transformers: only this test needs them

    ckpt = tmp_path / "ckpt"
    shutil.copytree(resolve_model("tiny-llama"), ckpt)
    config = json.loads((ckpt / "generation_config.json").read_text())
    (ckpt / "generation_config.json").write_text(json.dumps(
        {**config, "min_p": 0.3, "typical_p": 0.5, "no_repeat_ngram_size": 1}))
    backend = HFBackend(ckpt, dtype="float32")
    sampling = SamplingParams(temperature=1.0, max_tokens=8, seed=3)
    rollout = backend.generate([Request((1, 5, 9), sampling, "q")])[0]
    scored = backend.score([rollout], logprobs_mode="processed", temperature=1.0)[0].numpy()
    np.testing.assert_allclose(rollout.logprobs, scored, atol=1e-5)
    assert "generation_config.json is not applied" in rollout.meta["generation_defaults"]
