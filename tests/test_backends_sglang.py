"""SGLang adapter: translation, and parsing of responses captured from a real SGLang server.

tests/data/sglang_captured/ holds `/generate` responses of SGLang 0.5.23 serving tiny-llama on
this machine's CPU (its README says how): they are the source of truth for parsing and for
SGLang's logprob definition. Routed experts could not be captured (SGLang's CPU path does not
load the MoE checkpoints), so the MoE `routed_experts` field is still checked on
tests/data/documented_format/sglang_generate.json, built in the documented layout (generate.py
there); that file also feeds the local HTTP server these tests run the adapter against.
"""

import base64
import importlib.util
import json
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
from http_stub import StubHandler, serve

from parity.backends import get_backend
from parity.backends.base import SampleJob, eos_token_ids
from parity.backends.http import RequestsLostError
from parity.backends.sglang import (
    SGLangBackend,
    decode_routes,
    parse_output,
    parse_prompt_logprobs,
    translate_sampling,
)
from parity.core.errors import BackendError, BackendUnavailableError, ConfigError, UnsupportedError
from parity.core.types import Request, SamplingParams
from parity.engine import train_forward
from parity.models import resolve_model
from parity.runtime.processes import free_loopback_port

#: outputs generated in the backend's documented format, not captured from a server (see generate.py there)
DATA = Path(__file__).parent / "data" / "documented_format"
DOCUMENTED = json.loads((DATA / "sglang_generate.json").read_text())
#: responses captured from SGLang 0.5.23 on this machine's CPU (see the README there)
CAPTURED = Path(__file__).parent / "data" / "sglang_captured"


def captured(name: str) -> list[tuple[list[int], dict, dict]]:
    """One captured file -> (prompt ids, sampling params sent, output) per sequence."""
    entry = json.loads((CAPTURED / f"{name}.json").read_text())
    request, response = entry["request"], entry["response"]
    prompts = request["input_ids"] if isinstance(request["input_ids"][0], list) else [request["input_ids"]]
    params = request["sampling_params"]
    params = params if isinstance(params, list) else [params] * len(prompts)
    outputs = response if isinstance(response, list) else [response]
    return list(zip(prompts, params, outputs))


def job(**kw):
    return SampleJob(Request((1, 2, 3), SamplingParams(**kw), "q"), 1, 1234)


def test_translation_spells_every_field_the_sglang_way():
    params = translate_sampling(job(temperature=0.8, max_tokens=7, stop_token_ids=(9,)), (2,), "processed")
    assert params["top_k"] == -1 and params["max_new_tokens"] == 7 and params["sampling_seed"] == 1234
    assert params["stop_token_ids"] == [9, 2] and params["ignore_eos"] is False and params["n"] == 1
    ignored = translate_sampling(job(ignore_eos=True), (2,), "processed")  # with stop ids: refused
    assert ignored["stop_token_ids"] == [] and ignored["ignore_eos"] is True
    assert translate_sampling(job(top_k=5, logprobs_mode="raw"), (2,), "raw")["top_k"] == 5


def test_requests_sglang_cannot_honour_are_refused():
    with pytest.raises(ConfigError, match="not truncated"):
        translate_sampling(job(temperature=0.7, top_p=0.9), (2,), "processed")
    with pytest.raises(ConfigError, match="SGLANG_RETURN_ORIGINAL_LOGPROB"):
        translate_sampling(job(logprobs_mode="raw"), (2,), "processed")
    # greedy with truncation knobs is fine: the point mass does not depend on them
    translate_sampling(job(temperature=0, top_p=0.5), (2,), "processed")


@pytest.mark.parametrize("name", ["default_sample", "default_sample_topk", "default_greedy_score",
                                  "raw_sample", "raw_sample_topk", "raw_greedy_score"])
def test_parse_captured_outputs(name):
    for prompt, params, out in captured(name):
        tokens, logprobs, routes = parse_output(out, None)
        assert tokens == out["output_ids"] and len(logprobs) == len(tokens) == params["max_new_tokens"]
        assert routes is None and all(lp < 0 for lp in logprobs)
        if out["meta_info"]["input_token_logprobs"]:  # logprob_start_len=0: the prompt's raw logprobs
            assert len(parse_prompt_logprobs(out, 1)) == len(prompt) - 1


def _reference(prompt, tokens, **params):
    """The training forward's float32 logprobs of `tokens` after `prompt` on tiny-llama."""
    return train_forward("tiny-llama", [(tuple(prompt), tuple(tokens))], **params).logprobs[0].numpy()


@pytest.mark.slow
def test_captured_logprob_definition_against_the_training_forward():
    """SGLang (bf16) against parity's float32 training forward on the same tokens: its default
    logprob is log_softmax(logits / T), temperature-scaled but not truncated by top-k/top-p; with
    SGLANG_RETURN_ORIGINAL_LOGPROB=1 it is raw log_softmax(logits); a greedy token's logprob is raw.
    The margins: bf16 drift stays < 0.1 nats while the wrong definition is off by > 0.4."""
    for mode in ("default", "raw"):
        for name in ("sample", "sample_topk"):
            for prompt, params, out in captured(f"{mode}_{name}"):
                tokens, logprobs, _ = parse_output(out)
                temperature = params["temperature"]
                scaled = _reference(prompt, tokens, logprobs_mode="processed", temperature=temperature)
                raw = _reference(prompt, tokens, logprobs_mode="raw")
                right, wrong = (scaled, raw) if mode == "default" else (raw, scaled)
                assert np.abs(np.array(logprobs) - right).max() < 0.1
                if params["temperature"] != 1.0:
                    assert np.abs(np.array(logprobs) - wrong).max() > 0.4
                if params.get("top_k", -1) > 0:  # truncation would raise kept tokens' logprobs
                    truncated = _reference(prompt, tokens, logprobs_mode="processed", top_k=params["top_k"],
                                           top_p=params["top_p"], temperature=params["temperature"])
                    assert np.abs(np.array(logprobs) - truncated).max() > 0.1
        (prompt, _, out), = captured(f"{mode}_greedy_score")
        tokens, logprobs, _ = parse_output(out)
        assert abs(logprobs[0] - _reference(prompt, tokens, logprobs_mode="raw")[0]) < 0.1
        prompt_logprobs = np.array(parse_prompt_logprobs(out, 1))
        assert np.abs(prompt_logprobs - _reference(prompt[:1], prompt[1:], logprobs_mode="raw")).max() < 0.1


def test_captured_sampling_seed_is_not_honoured_on_the_cpu_path():
    """The same request and `sampling_seed` twice on one server drew different tokens (SGLang seeds
    only under --enable-deterministic-inference, which refuses torch_native attention)."""
    first, second = (json.loads((CAPTURED / f"raw_seedrepeat_{i}.json").read_text()) for i in (1, 2))
    assert parse_output(first)[0] != parse_output(second)[0]


def test_parse_documented_format_routes():
    """MoE routes could not be captured on CPU: checked on outputs built in the documented layout."""
    model = resolve_model(DOCUMENTED["model"])
    config = json.loads((model / "config.json").read_text())
    shape = (config["num_hidden_layers"], config["num_experts_per_tok"])
    for prompt, out in zip(DOCUMENTED["prompts"], DOCUMENTED["outputs"]):
        tokens, logprobs, routes = parse_output(out, shape)
        assert tokens == out["output_ids"] and len(logprobs) == len(tokens)
        assert routes.shape == (len(prompt) + len(tokens) - 1, *shape)
        assert routes.dtype == np.int32 and routes.min() >= 0 and routes.max() < config["num_experts"]
    assert eos_token_ids(model) == (2,)


def test_parse_rejects_inconsistent_outputs():
    out = json.loads(json.dumps(DOCUMENTED["outputs"][0]))
    out["output_ids"] = out["output_ids"][:-1]
    with pytest.raises(BackendError, match="disagree"):
        parse_output(out)
    with pytest.raises(BackendError, match="return_logprob"):
        parse_output({"output_ids": [1], "meta_info": {}})
    with pytest.raises(BackendError, match="multiple"):
        decode_routes(base64.b64encode(np.arange(5, dtype=np.int32).tobytes()).decode(), 2, 2)


class StubServer(StubHandler):
    """Answers SGLang's native routes with the documented-format outputs (one `/generate` request
    per sequence, the output for its input_ids); keeps the request bodies and auth headers.

    Not a mock of a backend that runs here: SGLang does not run on these machines, and this
    replays its documented wire format so the adapter's HTTP path runs end to end.
    """

    bodies: ClassVar[list] = []
    auth: ClassVar[list] = []

    def do_GET(self):
        self.reply({"version": "stub"})

    def do_POST(self):
        body = self.read_json()
        self.bodies.append(body)
        self.auth.append(self.headers.get("Authorization"))
        self.reply(DOCUMENTED["outputs"][DOCUMENTED["prompts"].index(body["input_ids"])])


@pytest.fixture(scope="module")
def server():
    httpd = serve(StubServer)
    yield httpd.url
    httpd.shutdown()


def test_http_generate_and_score_end_to_end(server):
    backend = SGLangBackend(DOCUMENTED["model"], base_url=server)
    sampling = SamplingParams(**DOCUMENTED["sampling"])
    reqs = [Request(tuple(p), sampling, f"s{i}") for i, p in enumerate(DOCUMENTED["prompts"])]
    rollouts = backend.generate(reqs)
    sent = StubServer.bodies[-len(reqs):]
    assert sorted(b["input_ids"] for b in sent) == sorted(DOCUMENTED["prompts"])
    assert all(b["return_logprob"] is True for b in sent)
    assert all(b["sampling_params"]["top_k"] == -1 for b in sent)
    assert all(b["sampling_params"]["max_new_tokens"] == 8 for b in sent)
    for r, out in zip(rollouts, DOCUMENTED["outputs"]):
        assert list(r.token_ids) == out["output_ids"] and r.sampling == sampling
        assert list(r.logprobs) == [e[0] for e in out["meta_info"]["output_token_logprobs"]]
        assert r.routed_experts.shape[0] == len(r.prompt_ids) + len(r.token_ids) - 1
        assert r.meta["backend_version"] == "stub" and r.meta["sglang_return_original_logprob"] == "0"
    scores = backend.score([((p[0],), tuple(p[1:])) for p in DOCUMENTED["prompts"]])
    assert all(b["logprob_start_len"] == 0 for b in StubServer.bodies[-len(reqs):])
    for s, out in zip(scores, DOCUMENTED["outputs"]):
        assert s.tolist() == pytest.approx([e[0] for e in out["meta_info"]["input_token_logprobs"][1:]])
    with pytest.raises(ConfigError, match="raw only"):
        backend.score([((1,), (2,))], logprobs_mode="processed", temperature=0.8)


def test_http_needs_no_sglang_wheel(server):
    """`base_url=` goes through the registry without the sglang package (not installed here)."""
    backend = get_backend("sglang", DOCUMENTED["model"], base_url=server)
    assert backend.meta["endpoint"] == server and backend.meta["backend_version"] == "stub"
    if importlib.util.find_spec("sglang") is None:
        with pytest.raises(BackendUnavailableError, match="sglang"):
            get_backend("sglang", DOCUMENTED["model"])


def test_http_api_key_from_env_and_credentials_kept_out_of_provenance(server, monkeypatch):
    monkeypatch.setenv("PARITY_SGLANG_KEY", "sk-sglang-456")
    with_user = server.replace("http://", "http://bob:hunter2@")
    backend = SGLangBackend(DOCUMENTED["model"], base_url=with_user + "/",  # a query is refused (item 10)
                            api_key_env="PARITY_SGLANG_KEY")
    sampling = SamplingParams(**DOCUMENTED["sampling"])
    backend.generate([Request(tuple(DOCUMENTED["prompts"][1]), sampling, "k")])
    assert StubServer.auth[-1] == "Bearer sk-sglang-456"
    recorded = json.dumps(backend.meta)
    assert backend.meta["endpoint"] == server
    assert not any(secret in recorded for secret in ("sk-sglang", "bob", "hunter2", "token"))


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:30000", "127.0.0.1:30000", "http://"])
def test_http_url_is_checked(url):
    with pytest.raises(ConfigError, match="option base_url"):
        SGLangBackend(DOCUMENTED["model"], base_url=url)


def test_http_server_gone_names_the_lost_requests():
    with pytest.raises(BackendError, match="get_server_info failed"):
        SGLangBackend(DOCUMENTED["model"], base_url=f"http://127.0.0.1:{free_loopback_port()}", retries=0)
    httpd = serve(StubServer)
    backend = SGLangBackend(DOCUMENTED["model"], base_url=httpd.url, retries=1)
    httpd.shutdown()
    httpd.server_close()
    sampling = SamplingParams(**{**DOCUMENTED["sampling"], "n": 2})
    with pytest.raises(RequestsLostError, match=r"2 of 2 requests to http://127\.0\.0\.1:\d+ were lost: k/0"):
        backend.generate([Request(tuple(DOCUMENTED["prompts"][1]), sampling, "k")])


#: a stand-in `sglang.launch_server` (its docstring says what it is)
STUB_SITE = Path(__file__).parent / "data" / "sglang_stub"


@pytest.fixture
def stub_python(monkeypatch):
    """This interpreter, with the stand-in `sglang` package first on the server's path."""
    monkeypatch.setenv("PYTHONPATH", f"{STUB_SITE}:{Path.cwd()}")
    monkeypatch.delenv("PARITY_SGLANG_PYTHON", raising=False)


def test_launch_server_starts_flushes_and_stops_the_server(stub_python):
    """parity starts the server (flags it owns plus server_args, the logprob variable), reads its
    settings, flushes the radix cache for an uncached run, and stops it on close."""
    backend = get_backend("sglang", DOCUMENTED["model"], logprobs_mode="raw", launch_server=True,
                          server_args="--enable-deterministic-inference --attention-backend triton",
                          return_routed_experts=True, start_timeout_s=60)
    info = backend.client.get("/get_server_info")
    assert info["argv"][:2] == ["--model-path", str(resolve_model(DOCUMENTED["model"]))]
    assert {"--skip-tokenizer-init", "--enable-return-routed-experts", "--dtype"} <= set(info["argv"])
    assert info["return_original_logprob"] == "1"
    assert backend.meta["batch_invariant"] is True and backend.meta["attention_backend"] == "triton"
    assert backend.meta["server_args"] == ["--enable-deterministic-inference", "--attention-backend",
                                           "triton"]
    sampling = SamplingParams(**{**DOCUMENTED["sampling"], "logprobs_mode": "raw"})
    req = [Request(tuple(DOCUMENTED["prompts"][1]), sampling, "u")]
    assert backend.generate(req)[0].meta["num_cached_tokens"] == 0
    assert backend.generate_uncached(req)[0].meta["num_cached_tokens"] == 1  # flushed once before
    server = backend.server
    backend.close()
    assert server.exit_reason() is not None and backend.server is None


def test_launch_server_failure_names_the_log_and_leaves_nothing(monkeypatch, tmp_path):
    """A server that cannot start (no sglang on its Python) fails with its log's tail, stopped."""
    monkeypatch.setenv("PYTHONPATH", str(Path.cwd()))
    with pytest.raises(BackendError, match=r"SGLang server failed to start(.|\n)*sglang"):
        get_backend("sglang", DOCUMENTED["model"], launch_server=True, start_timeout_s=60)


@pytest.mark.parametrize(("options", "match"), [
    ({"launch_server": True, "server_args": "--port 1"}, "may not contain --port"),
    ({"launch_server": True, "server_args": ["--dtype=float16"]}, "may not contain --dtype"),
    ({"launch_server": True, "base_url": "http://127.0.0.1:1"}, "drop base_url"),
    ({"server_args": "--attention-backend triton"}, "add launch_server=true"),
    ({"launch_server": True, "python": "/no/such/python"}, "PARITY_SGLANG_PYTHON"),
])
def test_launch_server_options_are_checked_before_anything_starts(options, match):
    with pytest.raises(ConfigError, match=match):
        SGLangBackend(DOCUMENTED["model"], **options)


def test_what_sglang_cannot_report_is_refused_before_it_starts(monkeypatch):
    """compare, audit and the probe check the requests against the SGLang options first: a refusal
    after a server start would cost a minute (the probe's first run did, before this check)."""
    from parity import audit, compare
    from parity.attribute import EngineSide, engine_diff

    def refuse(*args, **kwargs):
        raise AssertionError("an engine was started")

    for module, name in (("parity.compare", "shared_backend"), ("parity.audit.run", "shared_backend"),
                         ("parity.attribute.probe", "get_backend"),
                         ("parity.attribute.probe", "shared_backend")):
        monkeypatch.setattr(importlib.import_module(module), name, refuse)
    truncated = SamplingParams(top_p=0.9, max_tokens=4)
    with pytest.raises(ConfigError, match="cannot be reported"):
        compare("tiny-llama", "sglang", prompts=[[3, 4, 5]], sampling=truncated, launch_server=True)
    with pytest.raises(ConfigError, match="cannot be reported"):  # the audit's case samples at top-p 0.95
        audit("tiny-llama", "sglang", launch_server=True)
    options = EngineSide(options={"launch_server": True})
    with pytest.raises(ConfigError, match="cannot be reported"):
        engine_diff("tiny-llama", [Request((3, 4, 5), truncated, "t")], backend="sglang", side=options)
    raw = SamplingParams(top_p=0.9, max_tokens=4, logprobs_mode="raw")
    with pytest.raises(ConfigError, match="start the backend with logprobs_mode='raw'"):
        engine_diff("tiny-llama", [Request((3, 4, 5), raw, "t")], backend="sglang", side=options)
    # on a CPU SGLang the sampler overwrites a sampled request's dumped logits (tests/test_sglang_probe.py)
    on_cpu = EngineSide(options={"launch_server": True, "logprobs_mode": "raw",
                                 "server_args": "--device cpu"})
    with pytest.raises(UnsupportedError, match="greedy requests"):
        engine_diff("tiny-llama", [Request((3, 4, 5), raw, "t")], backend="sglang", side=on_cpu)
    with pytest.raises(AssertionError, match="an engine was started"):  # controls: greedy, or no logits
        engine_diff("tiny-llama", [Request((3, 4, 5), raw.replace(temperature=0.0), "t")], backend="sglang",
                    side=on_cpu)
    with pytest.raises(AssertionError, match="an engine was started"):
        engine_diff("tiny-llama", [Request((3, 4, 5), raw, "t")], backend="sglang", side=on_cpu,
                    stages="layer,norm")
