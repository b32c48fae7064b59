"""No silent wrong numbers, round 7 (the production engines' answers read back into rollouts): each
answer below was read into a number or a rollout that the engine did not mean, with no word, on the
old code: SGLang's clamped -inf read as a finite logprob; a sample the engine aborted, or SGLang
stopped on an EOS id parity did not send, recorded as one that ran to its length; a raw vLLM server
taken for a processed one; a scoring answer that covered part of the response. No engine starts:
the answers are built by hand in the engines' own shapes (SGLang 0.5.23's `meta_info`, vLLM 0.32's
`/v1/completions`) and served by local stubs.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pytest
from http_stub import StubHandler, serve

from parity.backends.base import SampleJob
from parity.backends.http import Endpoint, HttpClient
from parity.backends.sglang import SGLangBackend, parse_output, parse_prompt_logprobs, parse_top_logprobs
from parity.backends.vllm_requests import check_finish
from parity.backends.vllm_server import VLLMServerBackend
from parity.backends.vllm_wire import probe_logprobs_mode
from parity.core.errors import BackendError, ConfigError
from parity.core.types import Request, SamplingParams
from parity.drift.distribution import TrainerView, position_drift

#: what SGLang writes for -inf: `logprobs.clamp_(min=torch.finfo(torch.float32).min)`
F32_MIN = float(np.finfo(np.float32).min)
BF16_MIN = -3.3895313892515355e38  # the rl_on_policy_target path's bfloat16 logprobs


def sglang_out(tokens: list[int], logprobs: list[float], finish: dict[str, Any] | None = None,
               top: list[list[tuple[float, int]]] | None = None,
               inputs: list[float | None] | None = None) -> dict[str, Any]:
    """One SGLang `/generate` result (skip_tokenizer_init: no text in the logprob tuples)."""
    info: dict[str, Any] = {
        "finish_reason": finish or {"type": "length", "length": len(tokens)},
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, tokens)],
        "input_token_logprobs": [[lp, 1, None] for lp in (inputs or [])], "cached_tokens": 0}
    if top is not None:
        info["output_top_logprobs"] = [[[lp, t, None] for lp, t in row] for row in top]
    return {"output_ids": tokens, "meta_info": info}


class SGLangStub(StubHandler):
    """An attached SGLang server answering every `/generate` with `out`."""

    out: ClassVar[dict[str, Any]] = {}

    def do_GET(self):
        self.reply({"version": "stub", "dtype": "bfloat16"})

    def do_POST(self):
        self.read_json()
        self.reply(self.out)


@pytest.fixture
def sglang(monkeypatch):
    httpd = serve(SGLangStub)
    yield lambda out: (monkeypatch.setattr(SGLangStub, "out", out),
                       SGLangBackend("tiny-llama", base_url=httpd.url, retries=0))[1]
    httpd.shutdown()


def request(**kw: Any) -> Request:
    return Request((1, 5, 9), SamplingParams(**{"max_tokens": 4, "temperature": 1.0, **kw}), "q")


# -- SGLang's clamped -inf ----------------------------------------------------------------------------


@pytest.mark.parametrize("floor", [F32_MIN, BF16_MIN])
def test_sglang_s_clamped_minus_infinity_is_read_as_minus_infinity(floor):
    """SGLang clamps every logprob to its dtype's lowest finite value (no -inf in JSON); parity kept
    -3.4e38 as a finite logprob where vLLM reports -inf."""
    out = sglang_out([7, 8], [-0.5, floor], top=[[(-0.5, 7), (floor, 3)], [(-0.1, 4), (floor, 8)]],
                     inputs=[None, -1.0, floor, -2.0, floor])
    assert parse_output(out)[1] == [-0.5, float("-inf")]
    _, values = parse_top_logprobs(out, 2)
    assert values == [[-0.5, float("-inf")], [-0.1, float("-inf")]]
    assert parse_prompt_logprobs(out, 3) == [-2.0, float("-inf")]
    with pytest.raises(BackendError, match="null logprob"):  # orjson writes NaN as null
        parse_output(sglang_out([7], [None]))  # type: ignore[list-item]


def test_the_clamped_value_changed_the_distribution_drift(sglang):
    """Low temperature, untruncated processed logprobs: SGLang's log(softmax) underflows to -inf for the
    third token. With -3.4e38 kept, KL(train || engine) came out 7.0e29 (not inf) and the third
    entry counted among the engine's finite top-k entries (3 of 3, not 2)."""
    backend = sglang(sglang_out([7], [-0.01], top=[[(-0.01, 7), (-5.0, 2), (F32_MIN, 3)]]))
    rollout, = backend.generate([request(temperature=0.2, top_k_logprobs=3)])
    assert rollout.top_k_logprobs.tolist() == [[-0.01, -5.0, float("-inf")]]
    train = np.array([[-0.01, -5.0, -20.0]])
    view = TrainerView(at_engine=train, top_ids=np.array([[7, 2, 3]]), top_logprobs=train,
                       entropy=np.array([0.1]), sampled_rank=np.array([0]), sampled_ids=np.array([7]))
    drift = position_drift(rollout.top_k_logprobs, view)
    assert drift.kl_train_engine[0] == np.inf and drift.engine_entries[0] == 2


# -- samples the engine aborted -----------------------------------------------------------------------


def test_a_sample_sglang_aborted_is_not_recorded_as_run_to_its_length(sglang):
    """/abort_request or /pause_generation (an RL trainer's weight sync) ends SGLang's requests with
    finish_reason "abort" and the tokens so far: parity recorded 2 of 4 tokens as a "length" sample."""
    aborted = sglang_out([7, 8], [-0.5, -0.7], finish={"type": "abort", "message": "Abort before prefill"})
    with pytest.raises(BackendError, match=r"'q'/0 with finish_reason .*'abort'.* after 2 tokens"):
        sglang(aborted).generate([request()])
    stopped = sglang_out([7, 2], [-0.5, -0.7], finish={"type": "stop", "matched": 2})
    rollout, = sglang(stopped).generate([request()])
    assert rollout.finish_reason == "stop" and rollout.token_ids == (7, 2)


def test_a_stop_sglang_made_on_a_token_parity_did_not_send_is_refused(sglang):
    """SGLang stops on every EOS id of config.json and generation_config.json; parity sends (and the
    reference engine stops on) generation_config.json's. A fine-tune whose config.json names another
    EOS ended early there: recorded as a "length" sample of 2 of its 4 tokens."""
    early = sglang_out([7, 151], [-0.5, -0.7], finish={"type": "stop", "matched": 151})
    with pytest.raises(BackendError, match=r"on token 151, which is not in the stop set parity sent \[2\].*"
                                           r"add 151 to sampling.stop_token_ids"):
        sglang(early).generate([request()])
    rollout, = sglang(early).generate([request(stop_token_ids=(151,))])  # the fix the message names
    assert rollout.finish_reason == "stop"


class VLLMStub(StubHandler):
    """A vLLM server's `/v1/completions`: `choice` for samples, `rows` for prompt logprobs."""

    choice: ClassVar[dict[str, Any]] = {}
    rows: ClassVar[list[Any]] = []

    def do_POST(self):
        body = self.read_json()
        if "prompt_logprobs" in body:
            return self.reply({"choices": [{"index": 0, "token_ids": [3], "prompt_logprobs": self.rows}]})
        self.reply({"choices": [self.choice]})


@pytest.fixture
def vllm_server(monkeypatch):
    """A VLLMServerBackend on the stub, without the attach protocol (only `generate` and `score` run)."""
    httpd = serve(VLLMStub)
    backend = object.__new__(VLLMServerBackend)
    backend.client = HttpClient(Endpoint.parse(httpd.url))
    backend.eos_ids, backend.logprobs_mode, backend.served_model, backend._adapter_name = (2,), "processed", \
        "m", None
    backend.meta = {"backend": "vllm-server"}

    def answer(choice=None, rows=None):
        monkeypatch.setattr(VLLMStub, "choice", choice or {})
        monkeypatch.setattr(VLLMStub, "rows", rows or [])
        return backend

    yield answer
    httpd.shutdown()


def completion(tokens: list[int], logprobs: list[float], finish: str) -> dict[str, Any]:
    return {"index": 0, "token_ids": tokens, "finish_reason": finish,
            "logprobs": {"tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": logprobs}}


def test_a_sample_vllm_aborted_is_not_recorded_as_run_to_its_length(vllm_server):
    """vLLM's `/pause` aborts in-flight requests by default (mode=abort): the answer is an ordinary
    choice with finish_reason "abort" and the tokens so far, recorded as a 4-token "length" sample."""
    backend = vllm_server(completion([7, 8], [-0.5, -0.7], "abort"))
    with pytest.raises(BackendError, match=r"'q'/0 with finish_reason 'abort' after 2 tokens"):
        backend.generate([request()])
    rollout, = vllm_server(completion([7, 2], [-0.5, -0.7], "stop")).generate([request()])
    assert rollout.finish_reason == "stop" and rollout.meta["vllm_finish_reason"] == "stop"
    job = SampleJob(request(), 1, 0)  # the offline adapter's check: CompletionOutput.finish_reason
    for reason in ("error", "repetition"):
        with pytest.raises(BackendError, match=rf"'q'/1 with finish_reason '{reason}'"):
            check_finish(reason, job, 3, "vllm")
    for reason in ("stop", "length", None):
        check_finish(reason, job, 3, "vllm")


# -- a raw vLLM server taken for a processed one ------------------------------------------------------


class ProbedVLLM(StubHandler):
    """A raw_logprobs vLLM server whose model is all but certain of token 7 after token 2: the sampled
    logprob and the prompt logprob are both 0.0 (float32 log_softmax saturates)."""

    raw: ClassVar[float] = 0.0

    def do_POST(self):
        body = self.read_json()
        if "prompt_logprobs" in body:
            rows = [None, {str(body["prompt"][1]): {"logprob": self.raw}}]
            return self.reply({"choices": [{"index": 0, "token_ids": [3], "prompt_logprobs": rows}]})
        self.reply({"choices": [completion([7], [self.raw], "length")]})


def test_a_raw_server_whose_logprob_is_zero_is_not_taken_for_a_processed_one(monkeypatch):
    """The attach probe read a 0.0 logprob under top_k=1 as the processed point mass: a raw server
    (dev mode off) then passed as processed and its raw logprobs were recorded as processed ones."""
    httpd = serve(ProbedVLLM)
    try:
        client = HttpClient(Endpoint.parse(httpd.url))
        with pytest.raises(ConfigError, match=r"raw logprob of 0.*cannot be told apart.*DEV_MODE=1"):
            probe_logprobs_mode(client, "m", 2)
        monkeypatch.setattr(ProbedVLLM, "raw", -0.25)
        assert probe_logprobs_mode(client, "m", 2) == "raw_logprobs"
    finally:
        httpd.shutdown()


# -- scoring answers that cover part of the response --------------------------------------------------


def test_sglang_scoring_that_covers_part_of_the_response_is_refused(sglang):
    """SGLang with --allow-auto-truncate cuts an over-long input's tail: input_token_logprobs for 4 of
    6 positions, read as 1 logprob for a 3-token response (a tensor of the wrong length, no word)."""
    backend = sglang(sglang_out([4], [-0.1], inputs=[None, -1.0, -2.0, -3.0]))
    with pytest.raises(BackendError, match=r"scored 1 of the 3 response tokens of sequences\[0\]"):
        backend.score([((1, 5, 9), (4, 6, 8))], logprobs_mode="raw")
    whole = sglang(sglang_out([4], [-0.1], inputs=[None, -1.0, -2.0, -3.0, -4.0, -5.0]))
    assert whole.score([((1, 5, 9), (4, 6, 8))], logprobs_mode="raw")[0].tolist() == [-3.0, -4.0, -5.0]


def test_vllm_server_scoring_that_covers_part_of_the_response_is_refused(vllm_server):
    """`zip(rows, response)` kept the first rows only: 1 logprob for a 2-token response."""
    backend = vllm_server(rows=[None, {"5": {"logprob": -1.0}}, {"9": {"logprob": -2.0}},
                                {"4": {"logprob": -3.0}}])
    with pytest.raises(BackendError, match="prompt logprobs for 1 of 2 response tokens"):
        backend.score([((1, 5, 9), (4, 6))], logprobs_mode="raw")
    assert backend.score([((1, 5, 9), (4,))], logprobs_mode="raw")[0].tolist() == [-3.0]
