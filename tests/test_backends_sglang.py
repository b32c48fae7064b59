"""SGLang adapter: translation and output parsing on outputs in SGLang's documented format.

SGLang does not run on these CPU machines; tests/data/documented_format/sglang_generate.json holds
`/generate` results in the documented `meta_info` layout (see generate.py there).
"""

import base64
import importlib.util
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

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
from parity.errors import BackendError, BackendUnavailableError, ConfigError
from parity.models import resolve_model
from parity.processes import free_loopback_port
from parity.types import Request, SamplingParams

#: outputs generated in the backend's documented format, not captured from a server (see generate.py there)
DATA = Path(__file__).parent / "data" / "documented_format"
DOCUMENTED = json.loads((DATA / "sglang_generate.json").read_text())


def job(**kw):
    return SampleJob(Request((1, 2, 3), SamplingParams(**kw), "q"), 1, 1234)


def test_translation_spells_every_field_the_sglang_way():
    params = translate_sampling(job(temperature=0.8, max_tokens=7, stop_token_ids=(9,)), (2,), "processed")
    assert params["top_k"] == -1 and params["max_new_tokens"] == 7 and params["sampling_seed"] == 1234
    assert params["stop_token_ids"] == [9, 2] and params["ignore_eos"] is False and params["n"] == 1
    ignored = translate_sampling(job(ignore_eos=True, stop_token_ids=(9,)), (2,), "processed")
    assert ignored["stop_token_ids"] == [9] and ignored["ignore_eos"] is True
    assert translate_sampling(job(top_k=5, logprobs_mode="raw"), (2,), "raw")["top_k"] == 5


def test_requests_sglang_cannot_honour_are_refused():
    with pytest.raises(ConfigError, match="not truncated"):
        translate_sampling(job(temperature=0.7, top_p=0.9), (2,), "processed")
    with pytest.raises(ConfigError, match="SGLANG_RETURN_ORIGINAL_LOGPROB"):
        translate_sampling(job(logprobs_mode="raw"), (2,), "processed")
    # greedy with truncation knobs is fine: the point mass does not depend on them
    translate_sampling(job(temperature=0, top_p=0.5), (2,), "processed")


def test_parse_documented_format_outputs():
    model = resolve_model(DOCUMENTED["model"])
    config = json.loads((model / "config.json").read_text())
    shape = (config["num_hidden_layers"], config["num_experts_per_tok"])
    for prompt, out, raw in zip(DOCUMENTED["prompts"], DOCUMENTED["outputs"],
                                DOCUMENTED["expected_raw_logprobs"]):
        tokens, logprobs, routes = parse_output(out, shape)
        assert tokens == out["output_ids"] and len(logprobs) == len(tokens)
        # SGLang's temperature-scaled number is not the raw logprob (T = 0.8)
        assert max(abs(a - b) for a, b in zip(logprobs, raw)) > 0.05
        assert routes.shape == (len(prompt) + len(tokens) - 1, *shape)
        assert routes.dtype == np.int32 and routes.min() >= 0 and routes.max() < config["num_experts"]
        assert len(parse_prompt_logprobs(out, 1)) == len(prompt) - 1
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


class StubServer(BaseHTTPRequestHandler):
    """Answers SGLang's native routes with the documented-format outputs (one `/generate` request
    per sequence, the output for its input_ids); keeps the request bodies and auth headers.

    Not a mock of a backend that runs here: SGLang does not run on these machines, and this
    replays its documented wire format so the adapter's HTTP path runs end to end.
    """

    bodies: ClassVar[list] = []
    auth: ClassVar[list] = []

    def do_GET(self):
        self._reply({"version": "stub"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        self.auth.append(self.headers.get("Authorization"))
        self._reply(DOCUMENTED["outputs"][DOCUMENTED["prompts"].index(body["input_ids"])])

    def _reply(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), StubServer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
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
        assert list(r.token_ids) == out["output_ids"]
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
    backend = SGLangBackend(DOCUMENTED["model"], base_url=with_user + "/?token=abc",
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
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), StubServer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    backend = SGLangBackend(DOCUMENTED["model"], base_url=f"http://127.0.0.1:{httpd.server_address[1]}",
                            retries=1)
    httpd.shutdown()
    httpd.server_close()
    sampling = SamplingParams(**{**DOCUMENTED["sampling"], "n": 2})
    with pytest.raises(RequestsLostError, match=r"2 of 2 requests to http://127\.0\.0\.1:\d+ were lost: k/0"):
        backend.generate([Request(tuple(DOCUMENTED["prompts"][1]), sampling, "k")])
