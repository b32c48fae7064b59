"""Round 9, the server adapters: what an attached or started vLLM / SGLang server runs is what parity
records, or refused. Stub servers on 127.0.0.1 only; no vLLM or SGLang starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from http_stub import StubHandler, serve

import parity.backends.vllm_server as vllm_server
from parity.backends.sglang import SGLangBackend
from parity.backends.sglang_server import split_server_args as sglang_split
from parity.backends.vllm_server import VLLMServerBackend
from parity.backends.vllm_start import GPU_MEMORY_UTILIZATION, gpu_memory_share
from parity.core.errors import ConfigError
from parity.models import resolve_model


class FakeVLLM(StubHandler):
    """vLLM's OpenAI routes the attach reads; `info` None: no /server_info (dev mode off)."""

    def do_GET(self) -> None:
        if self.path.startswith("/server_info"):
            if self.server.info is None:
                return self.reply({"detail": "Not Found"}, 404)
            return self.reply({"vllm_config": self.server.info, "vllm_env": {}})
        if self.path == "/v1/models":
            return self.reply({"data": [{"id": "tiny", "root": self.server.root, "max_model_len": 512}]})
        if self.path == "/metrics":
            return self.reply("")
        return self.reply({"version": "fake"})

    def do_POST(self) -> None:
        body = self.read_json()
        if "prompt_logprobs" in body:
            rows = [None, {str(body["prompt"][1]): {"logprob": -1.25}}]
            return self.reply({"choices": [{"prompt_logprobs": rows, "token_ids": [3]}]})
        value = 0.0 if body["top_k"] == 1 else -0.3  # processed logprobs
        self.reply({"choices": [{"index": 0, "token_ids": [7], "finish_reason": "length",
                                 "logprobs": {"tokens": ["token_id:7"], "token_logprobs": [value]}}]})


class FakeSGLang(StubHandler):
    """SGLang's /get_server_info with `info` as its answer."""

    def do_GET(self) -> None:
        self.reply(self.server.info)


@pytest.fixture
def fake_vllm():
    httpd = serve(FakeVLLM)
    httpd.info, httpd.root = None, "/x"
    yield httpd
    httpd.shutdown()


@pytest.fixture
def fake_sglang():
    httpd = serve(FakeSGLang)
    httpd.info = {"dtype": "bfloat16", "model_path": "/x", "version": "fake"}
    yield httpd
    httpd.shutdown()


def server_info(**model_config: Any) -> dict[str, Any]:
    config = {"logprobs_mode": "processed_logprobs", "dtype": "torch.bfloat16", **model_config}
    return {"model_config": config}


# dtype: what the report says is what the server runs, or says it was not checked


def test_an_attached_vllm_server_without_server_info_records_its_dtype_as_unverified(fake_vllm):
    meta = VLLMServerBackend("tiny-llama", url=fake_vllm.url).meta
    assert meta["dtype"] == "bfloat16" and meta["server_settings"]["dtype"] is None
    assert meta["dtype_verified"] is False and "not verified" in meta["dtype_source"]
    fake_vllm.info = server_info()
    meta = VLLMServerBackend("tiny-llama", url=fake_vllm.url).meta
    assert meta["dtype_verified"] is True and meta["dtype_source"] == "server_info"


def test_an_attached_sglang_server_of_dtype_auto_records_its_dtype_as_unverified(fake_sglang):
    backend = SGLangBackend("tiny-llama", base_url=fake_sglang.url)
    assert backend.meta["dtype_verified"] is True
    assert "not verified" in backend.meta["logprobs_mode_source"]
    fake_sglang.info = {**fake_sglang.info, "dtype": "auto"}
    backend = SGLangBackend("tiny-llama", base_url=fake_sglang.url)
    assert backend.meta["dtype_verified"] is False and "'auto'" in backend.meta["dtype_source"]


# speculative decoding and the probe


def test_the_probe_refuses_an_attached_server_with_speculative_decoding_or_cuda_graphs(fake_vllm):
    fake_vllm.info = {**server_info(enforce_eager=True),
                      "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    with pytest.raises(ConfigError, match=r"runs speculative decoding .*'ngram'"):
        VLLMServerBackend("tiny-llama", url=fake_vllm.url, probe=True)
    settings = VLLMServerBackend("tiny-llama", url=fake_vllm.url).meta["server_settings"]  # no probe: fine
    assert settings["speculative_config"] == {"method": "ngram", "model": None, "num_speculative_tokens": 3}
    fake_vllm.info = server_info(enforce_eager=False)
    with pytest.raises(ConfigError, match="needs a server started with --enforce-eager"):
        VLLMServerBackend("tiny-llama", url=fake_vllm.url, probe=True)
    fake_vllm.info = server_info(enforce_eager=True)
    backend = VLLMServerBackend("tiny-llama", url=fake_vllm.url, probe=True)
    assert backend.meta["probe"] is True and backend.meta["server_settings"]["speculative_config"] is None


class Started(Exception):
    """Raised where parity would start the server process."""


@pytest.fixture
def no_start(monkeypatch):
    """The argv of every server parity would start (none starts: `Started` is raised instead)."""
    argvs: list[list[str]] = []

    class Process:
        def __init__(self, argv: list[str], **_: Any) -> None:
            argvs.append(argv)
            raise Started

    monkeypatch.setattr(vllm_server, "ServerProcess", Process)
    monkeypatch.setattr(vllm_server, "free_loopback_port", lambda: 1)
    monkeypatch.setattr(vllm_server.importlib.util, "find_spec", lambda name, *a: object())
    return argvs


@pytest.mark.parametrize("args", [
    '--speculative-config {"method":"ngram","num_speculative_tokens":3}',
    '--speculative_config={"method":"ngram"}', "--speculative-config.method ngram",
    '-sc {"method":"ngram"}', "--spec-method ngram", "--spec-tokens 3",
    "--worker-extension-cls my.Extension", "--no-enforce-eager", "--no_enforce_eager",
])
def test_the_probe_refuses_server_args_that_undo_it_before_the_start(no_start, args):
    with pytest.raises(ConfigError, match="option probe"):
        VLLMServerBackend("tiny-llama", server_args=args, probe=True)
    assert no_start == []


def test_speculative_decoding_without_the_probe_starts(no_start):
    with pytest.raises(Started):
        VLLMServerBackend("tiny-llama", server_args='--speculative-config {"method":"ngram"}')
    with pytest.raises(Started):  # parity's own extension, named again, is fine
        VLLMServerBackend("tiny-llama", probe=True,
                          server_args=["--worker-extension-cls", vllm_server.PROBE_EXTENSION])
    assert len(no_start) == 2


# the GPU memory share checked is the one vLLM reads


@pytest.mark.parametrize("args, share", [
    ("--gpu-memory-utilization 0.7", 0.7), ("--gpu-memory-utilization=0.7", 0.7),
    ("--gpu_memory_utilization 0.7", 0.7), ("--gpu_memory_utilization=0.7", 0.7),
    ("--device-memory-utilization 0.7", 0.7), ("--gpu-memory 0.7", 0.7),
    ("--gpu-memory-utilization 0.2 --gpu-memory-utilization=0.7", 0.7), ("--max-num-seqs 8", None),
])
def test_the_gpu_memory_share_is_read_in_every_spelling(args, share):
    assert gpu_memory_share(args.split()) == share


def test_the_gpu_memory_check_uses_the_share_the_server_gets(no_start, monkeypatch):
    checked: list[float] = []
    monkeypatch.setattr(vllm_server.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vllm_server, "check_gpu_memory", checked.append)
    with pytest.raises(Started):
        VLLMServerBackend("tiny-llama", server_args="--gpu_memory_utilization=0.7")
    assert checked == [0.7] and "--gpu-memory-utilization" not in no_start[-1]
    with pytest.raises(Started):
        VLLMServerBackend("tiny-llama")
    assert checked[-1] == GPU_MEMORY_UTILIZATION
    with pytest.raises(ConfigError, match="not a number"):
        VLLMServerBackend("tiny-llama", server_args="--gpu-memory-utilization=half")


# SGLang's server_args: the flags parity sets, in every spelling SGLang's argparse reads


@pytest.mark.parametrize("args, flag", [
    ("--model /other/checkpoint", "--model-path"), ("--model=/other/checkpoint", "--model-path"),
    ("--model-p /other/checkpoint", "--model-path"), ("--dtyp half", "--dtype"),
    ("--dtype=half", "--dtype"), ("--skip-tokenizer", "--skip-tokenizer-init"),
])
def test_sglang_server_args_refuse_aliases_and_prefixes_of_the_flags_parity_sets(args, flag):
    with pytest.raises(ConfigError, match=f"may not contain {flag}"):
        sglang_split(args)


def test_sglang_server_args_parity_does_not_set_pass():
    words = ("--model-impl", "transformers", "--attention-backend", "triton", "--device", "cpu",
             "--enable-deterministic-inference", "--mem-fraction-static", "0.5")
    assert sglang_split(list(words)) == words


# the checkpoint an attached server loaded


def other_checkpoint(tmp_path: Path, change: bool) -> Path:
    folder = tmp_path / "checkpoint"
    shutil.copytree(resolve_model("tiny-llama"), folder)
    if change:
        config = json.loads((folder / "config.json").read_text())
        config["rms_norm_eps"] = 1e-3
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_an_attached_vllm_server_of_another_local_checkpoint_is_refused(fake_vllm, tmp_path):
    fake_vllm.root = str(other_checkpoint(tmp_path, change=True))
    with pytest.raises(ConfigError, match=r"serves checkpoint .*model hash"):
        VLLMServerBackend("tiny-llama", url=fake_vllm.url)
    for root in ("Org/tiny-llama", "checkpoint", str(resolve_model("tiny-llama"))):  # unknowable, or the same
        fake_vllm.root = root
        assert VLLMServerBackend("tiny-llama", url=fake_vllm.url).meta["served_model_root"] == root


def test_an_attached_server_of_a_copy_of_the_checkpoint_passes(fake_vllm, fake_sglang, tmp_path):
    fake_vllm.root = str(other_checkpoint(tmp_path, change=False))
    VLLMServerBackend("tiny-llama", url=fake_vllm.url)
    fake_sglang.info = {**fake_sglang.info, "model_path": fake_vllm.root}
    assert SGLangBackend("tiny-llama", base_url=fake_sglang.url).meta["served_model_path"] == fake_vllm.root


def test_an_attached_sglang_server_of_another_local_checkpoint_is_refused(fake_sglang, tmp_path):
    fake_sglang.info = {**fake_sglang.info, "model_path": str(other_checkpoint(tmp_path, change=True))}
    with pytest.raises(ConfigError, match=r"SGLang server .* serves checkpoint"):
        SGLangBackend("tiny-llama", base_url=fake_sglang.url)
