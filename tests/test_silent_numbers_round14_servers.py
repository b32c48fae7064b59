"""No silent wrong numbers, round 14 (the vLLM and SGLang adapters' settings and stops): on the old code
an fp8-KV and a bf16-KV server (or a quantized one) left the same recorded settings, a `--config` YAML
left only its path; a response holding a stop id before its end, or a "stop" on a token parity never
sent, was read as a sample that ran to its length; SGLang stopped on config.json's EOS ids, which vLLM's
rule (parity's) does not, found only once a sample happened to stop there. Stub servers on 127.0.0.1;
no vLLM or SGLang starts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, ClassVar

import pytest
from http_stub import StubHandler, serve

from parity.backends.base import SampleJob
from parity.backends.sglang import SGLangBackend, engine_eos_ids
from parity.backends.vllm_requests import check_sample
from parity.backends.vllm_server import VLLMServerBackend
from parity.backends.vllm_settings import SETTINGS, config_file, from_probes, from_server_info
from parity.core.errors import BackendError, ConfigError
from parity.core.types import Request, SamplingParams
from parity.models import resolve_model


def request(**kw: Any) -> Request:
    return Request((1, 5, 9), SamplingParams(**{"max_tokens": 4, "temperature": 1.0, **kw}), "q")


# -- 1. the KV cache dtype, the quantization and a --config YAML are recorded --------------------------


def info(cache_dtype: str, quantization: str | None) -> dict[str, Any]:
    """A /server_info answer (vLLM 0.32's JSON) differing in the KV cache dtype and the quantization."""
    return {"vllm_config": {"model_config": {"dtype": "torch.bfloat16", "quantization": quantization},
                            "cache_config": {"cache_dtype": cache_dtype, "block_size": 16}}, "vllm_env": {}}


def test_server_info_records_the_kv_cache_dtype_and_the_quantization():
    """An fp8-KV fp8-quantized server and a bf16 one gave equal settings (both keys were not read)."""
    fp8, plain = from_server_info(info("fp8_e4m3", "fp8")), from_server_info(info("auto", None))
    assert fp8 != plain and set(fp8) == {*SETTINGS, "source"}
    assert (fp8["kv_cache_dtype"], fp8["quantization"]) == ("fp8_e4m3", "fp8")
    assert (plain["kv_cache_dtype"], plain["quantization"]) == ("auto", "none")  # shown: unquantized
    older = {"vllm_config": {"model_config": {}, "cache_config": {}}}
    assert from_server_info(older)["quantization"] is None  # not shown: None, as for every setting


def test_the_probes_read_the_kv_cache_dtype_off_metrics():
    page = 'vllm:cache_config_info{block_size="16",cache_dtype="%s",enable_prefix_caching="True"} 1.0'
    fp8, auto = (from_probes("processed_logprobs", page % dtype, {}) for dtype in ("fp8", "auto"))
    assert (fp8["kv_cache_dtype"], auto["kv_cache_dtype"]) == ("fp8", "auto")
    assert fp8["quantization"] is None  # /metrics does not show it
    assert from_probes("processed_logprobs", None, {})["kv_cache_dtype"] is None


def test_a_config_yaml_is_recorded_with_its_text(tmp_path):
    """vLLM reads flags from `--config file.yaml` (before the command line's); only its path was kept."""
    yaml = tmp_path / "serve.yaml"
    yaml.write_text("kv-cache-dtype: fp8\nquantization: fp8\n")
    assert config_file(["--max-num-seqs", "8", "--config", str(yaml)]) == {
        "config_file": {"path": str(yaml), "text": "kv-cache-dtype: fp8\nquantization: fp8\n"}}
    assert config_file(["--max-num-seqs", "8"]) == {} and config_file(["--config"]) == {}


class FakeVLLM(StubHandler):
    """vLLM's routes an attach reads (/server_info on) and `/v1/completions` answering `choice`."""

    choice: ClassVar[dict[str, Any]] = {}

    def do_GET(self) -> None:
        if self.path.startswith("/server_info"):
            return self.reply({"vllm_config": self.server.info, "vllm_env": {}})
        if self.path == "/v1/models":
            return self.reply({"data": [{"id": "tiny", "root": "/x", "max_model_len": 512}]})
        return self.reply({"version": "fake"})

    def do_POST(self) -> None:
        self.read_json()
        tokens = self.choice["token_ids"]
        self.reply({"choices": [{"index": 0, **self.choice, "logprobs": {
            "tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": [-0.5] * len(tokens)}}]})


@pytest.fixture
def fake_vllm():
    httpd = serve(FakeVLLM)
    httpd.info = {"model_config": {"logprobs_mode": "processed_logprobs", "dtype": "torch.bfloat16",
                                   "quantization": "fp8"}, "cache_config": {"cache_dtype": "fp8"}}
    yield httpd
    httpd.shutdown()


def test_an_attached_vllm_server_records_its_kv_cache_dtype_and_a_started_ones_yaml(fake_vllm, tmp_path):
    backend = VLLMServerBackend("tiny-llama", url=fake_vllm.url, retries=0)
    settings = backend.meta["server_settings"]
    assert (settings["kv_cache_dtype"], settings["quantization"]) == ("fp8", "fp8")
    assert "config_file" not in settings  # attached: its flags are not known here
    yaml = tmp_path / "serve.yaml"
    yaml.write_text("kv-cache-dtype: fp8\n")
    backend.meta["server_args"] = ["--config", str(yaml)]  # as a server parity started records them
    backend._describe_server()
    assert backend.meta["server_settings"]["config_file"]["text"] == "kv-cache-dtype: fp8\n"


# -- 2. a stop id before the end, a "stop" on a token parity did not send ------------------------------


def job(**kw: Any) -> SampleJob:
    return SampleJob(request(**kw), 0, 0)


@pytest.mark.parametrize(("tokens", "reason", "match"), [
    ([5, 2, 6, 7], "length", r"holds stop id 2 at position 1 of its 4 tokens"),
    ([2, 2], "stop", r"holds stop id 2 at position 0"),
    ([5, 6], "stop", r"finish_reason 'stop' on token 6, which is not in the stop set parity sent \[2\]"),
])
def test_vllm_stops_that_disagree_with_the_stop_set_are_refused(tokens, reason, match):
    with pytest.raises(BackendError, match=match):
        check_sample(reason, job(), tokens, (2,), "vllm")


@pytest.mark.parametrize(("tokens", "reason", "kw"), [
    ([5, 6, 2], "stop", {}),                                 # EOS last
    ([5, 6, 7, 8], "length", {}),                            # no stop id at all
    ([5, 6, 7, 2], "length", {}),                            # EOS as the max_tokens-th token
    ([2, 5, 2, 6], "length", {"ignore_eos": True}),          # EOS generated past, as asked
    ([2, 5, 9], "stop", {"ignore_eos": True, "stop_token_ids": (9,)}),  # stop ids still stop
])
def test_vllm_stops_as_asked_are_accepted(tokens, reason, kw):
    check_sample(reason, job(**kw), tokens, (2,), "vllm")


def test_the_vllm_server_adapter_refuses_a_response_holding_a_stop_id(fake_vllm, monkeypatch):
    """tiny-llama's EOS is 2: a response [5, 2, 6, 7] was recorded as a 4-token "length" sample."""
    backend = VLLMServerBackend("tiny-llama", url=fake_vllm.url, retries=0)
    monkeypatch.setattr(FakeVLLM, "choice", {"token_ids": [5, 2, 6, 7], "finish_reason": "length"})
    with pytest.raises(BackendError, match="holds stop id 2 at position 1"):
        backend.generate([request()])
    monkeypatch.setattr(FakeVLLM, "choice", {"token_ids": [5, 6], "finish_reason": "stop"})
    with pytest.raises(BackendError, match="would record it as 'length'"):
        backend.generate([request()])
    monkeypatch.setattr(FakeVLLM, "choice", {"token_ids": [5, 2, 6, 7], "finish_reason": "length"})
    assert backend.generate([request(ignore_eos=True)])[0].finish_reason == "length"


def sglang_out(tokens: list[int], finish: dict[str, Any] | None = None) -> dict[str, Any]:
    """One SGLang `/generate` result (0.5.23's meta_info, skip_tokenizer_init)."""
    return {"output_ids": tokens, "meta_info": {
        "finish_reason": finish or {"type": "length", "length": len(tokens)}, "cached_tokens": 0,
        "output_token_logprobs": [[-0.5, t, None] for t in tokens]}}


class FakeSGLang(StubHandler):
    """An attached SGLang server: `/get_server_info` answers `info`, every `/generate` `out`."""

    info: ClassVar[dict[str, Any]] = {"version": "stub", "dtype": "bfloat16"}
    out: ClassVar[dict[str, Any]] = {}
    posts: ClassVar[list[Any]] = []

    def do_GET(self) -> None:
        self.reply(self.info)

    def do_POST(self) -> None:
        self.posts.append(self.read_json())
        self.reply(self.out)


@pytest.fixture
def sglang(monkeypatch):
    httpd = serve(FakeSGLang)
    monkeypatch.setattr(FakeSGLang, "posts", [])

    def start(out: dict[str, Any], model: str | Path = "tiny-llama") -> SGLangBackend:
        monkeypatch.setattr(FakeSGLang, "out", out)
        return SGLangBackend(model, base_url=httpd.url, retries=0)

    yield start
    httpd.shutdown()


def test_sglang_stops_that_disagree_with_the_stop_set_are_refused(sglang):
    with pytest.raises(BackendError, match="holding stop id 2 at position 1 of its 4 tokens"):
        sglang(sglang_out([5, 2, 6, 7])).generate([request()])
    # a stop string of the server's --preferred-sampling-params: recorded as "length" before
    with pytest.raises(BackendError, match="last token outside the stop set parity sent"):
        sglang(sglang_out([5, 6], {"type": "stop", "matched": "\n"})).generate([request()])
    assert sglang(sglang_out([5, 6, 2], {"type": "stop", "matched": 2})).generate(
        [request()])[0].finish_reason == "stop"
    assert sglang(sglang_out([2, 5, 2, 6])).generate([request(ignore_eos=True)])[0].finish_reason == "length"


def test_an_attached_sglang_server_records_its_kv_cache_dtype_and_quantization(sglang, monkeypatch):
    monkeypatch.setattr(FakeSGLang, "info", {"version": "stub", "dtype": "bfloat16",
                                             "kv_cache_dtype": "fp8_e5m2", "quantization": "fp8"})
    settings = sglang({}).meta["server_settings"]
    assert (settings["kv_cache_dtype"], settings["quantization"]) == ("fp8_e5m2", "fp8")


# -- 3. SGLang's EOS: config.json's too -----------------------------------------------------------------


@pytest.fixture
def config_eos(tmp_path):
    """tiny-llama whose config.json's eos_token_id is [2, 9], generation_config.json's 2 (vLLM and parity
    stop on 2; SGLang on 2 and 9)."""
    source, root = resolve_model("tiny-llama"), tmp_path / "tiny-config-eos"
    root.mkdir()
    for item in source.iterdir():
        if item.suffix == ".json":
            shutil.copy(item, root / item.name)
        else:
            (root / item.name).symlink_to(item)
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, "eos_token_id": [2, 9]}))
    return root


def test_sglang_says_what_it_stops_on_and_refuses_a_request_missing_config_eos(sglang, config_eos):
    """SGLang stopped on 9 where vLLM runs on; found only once a sample happened to stop there."""
    assert engine_eos_ids(config_eos) == (2, 9)
    backend = sglang(sglang_out([5, 6]), config_eos)
    assert backend.eos_ids == (2,) and backend.meta["engine_eos_ids"] == [2, 9]
    with pytest.raises(ConfigError, match=r"config.json's eos_token_id \[9\] too.*add \[9\] to "
                                          r"sampling.stop_token_ids"):
        backend.generate([request()])
    assert FakeSGLang.posts == []  # refused before a sample was sent
    assert backend.generate([request(stop_token_ids=(9,))])[0].token_ids == (5, 6)
    assert backend.generate([request(ignore_eos=True)])[0].token_ids == (5, 6)
    assert sglang(sglang_out([5, 6])).meta["engine_eos_ids"] == [2]  # configs agree: nothing to add
