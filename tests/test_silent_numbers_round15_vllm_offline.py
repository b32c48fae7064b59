"""Round 15: what the offline vLLM adapter records and checks before its engine starts (no engine starts
here: meta from a stand-in `vllm_config`, start settings from small config.json files and option dicts).

1. meta records the KV cache dtype, the weights' quantization and max_model_len, spelled as a server's
   `server_settings` ("auto", "none").
2. the context length parity passes as max_model_len follows vLLM 0.32's own default (nested
   `text_config`, the smallest length key, RoPE scaling factors), refusing what config.json cannot say.
3. a GPU memory share outside (0, 1] is a ConfigError naming the field (engine_kwargs, server_args).
4. options that contradict each other (prefix caching twice, eager mode with CUDA-graph settings) and
   requests longer than engine_kwargs max_model_len are refused before the engine starts.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from parity.backends import vllm as vllm_adapter
from parity.backends import vllm_start
from parity.backends.vllm import VLLMBackend
from parity.backends.vllm_settings import SETTINGS, from_server_info
from parity.core.errors import ConfigError
from parity.core.types import Request, SamplingParams
from parity.models import resolve_model

# -- 1. the engine's KV cache dtype and quantization in meta ------------------------------------------


def _vllm_config(cache_dtype: str, quantization: str | None) -> SimpleNamespace:
    """The parts of a started engine's `vllm_config` its meta reads."""
    return SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=True, enable_sleep_mode=False, max_model_len=512,
                                     quantization=quantization),
        cache_config=SimpleNamespace(enable_prefix_caching=True, block_size=16, cache_dtype=cache_dtype,
                                     gpu_memory_utilization=0.4),
        scheduler_config=SimpleNamespace(enable_chunked_prefill=False, max_num_seqs=256,
                                         max_num_batched_tokens=2048),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        compilation_config=SimpleNamespace(cudagraph_mode="NONE"))


def test_meta_tells_an_fp8_kv_engine_from_a_bf16_one_as_the_server_spells_it():
    """The offline meta had neither key: an fp8-KV engine's report read like a bf16-KV one's."""
    fp8 = vllm_adapter.engine_settings(_vllm_config("fp8", None))
    auto = vllm_adapter.engine_settings(_vllm_config("auto", None))
    assert (fp8["kv_cache_dtype"], auto["kv_cache_dtype"]) == ("fp8", "auto")
    assert fp8["quantization"] == auto["quantization"] == "none"
    assert vllm_adapter.engine_settings(_vllm_config("auto", "fp8"))["quantization"] == "fp8"
    assert fp8["max_model_len"] == 512 and fp8["gpu_memory_utilization"] == 0.4
    # the server's names and spellings of the same engine
    server = from_server_info({"vllm_config": {"model_config": {"quantization": None, "max_model_len": 512},
                                               "cache_config": {"cache_dtype": "auto"}}})
    for key in ("kv_cache_dtype", "quantization", "max_model_len"):
        assert key in SETTINGS and auto[key] == server[key]


# -- 2. the context length parity passes as max_model_len ---------------------------------------------

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 512,
         "rope_theta": 10000.0}
QWEN3 = {**LLAMA, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
PHI3 = {"model_type": "phi3", "max_position_embeddings": 4096, "original_max_position_embeddings": 1024,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}}

#: config.json -> vLLM 0.32's default max_model_len, each checked against its `_get_and_verify_max_len`.
VLLM_LENGTHS = [
    (LLAMA, 512),
    ({**LLAMA, "rope_scaling": {"type": "linear", "factor": 4.0}}, 2048),
    ({**LLAMA, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, 1024),
    ({**LLAMA, "rope_parameters": {"rope_type": "linear", "factor": 3.0, "rope_theta": 1e4}}, 1536),
    ({**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 128}}, 512),
    ({**QWEN3, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}},
     512),  # vLLM 0.32 takes YaRN's max_position_embeddings as already scaled
    ({**LLAMA, "seq_length": 256}, 256),  # the smallest length key
    ({**LLAMA, "model_max_length": 1024}, 1024),  # model_max_length over the others
    ({"model_type": "qwen2_5_vl", "max_position_embeddings": 128000,
      "text_config": {"model_type": "qwen2_5_vl_text", "max_position_embeddings": 4096,
                      "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}}, 4096),
    (PHI3, 1024),  # LongRoPE: original_max_position_embeddings
]


def _checkpoint(tmp_path: Path, config: dict[str, Any]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(("config", "length"), VLLM_LENGTHS)
def test_max_positions_is_vllms_default_max_model_len(tmp_path, config, length):
    """It was top-level max_position_embeddings or 2048: RoPE factors dropped (a 4x linear scaling
    started a quarter-length engine), a text_config's length read as 2048, a smaller seq_length ignored
    (vLLM then refused parity's larger max_model_len at its start)."""
    assert vllm_start.max_positions(_checkpoint(tmp_path, config)) == length


@pytest.mark.parametrize("config", [
    {"model_type": "qwen3"},  # vLLM would take Qwen3Config's default, 32768 (parity passed 2048)
    {"model_type": "qwen2_5_vl", "text_config": {"model_type": "qwen2_5_vl_text"}},
])
def test_a_config_without_a_context_length_is_refused_naming_max_model_len(tmp_path, config):
    with pytest.raises(ConfigError, match=r"names no context length.*pass max_model_len"):
        vllm_start.max_positions(_checkpoint(tmp_path, config))


@pytest.mark.parametrize(("config", "match"), [
    ({**LLAMA, "max_position_embeddings": "4k"}, "max_position_embeddings must be a positive number"),
    ({**LLAMA, "max_position_embeddings": 0}, "max_position_embeddings must be a positive number"),
    ({**LLAMA, "rope_scaling": {"type": "linear", "factor": "x"}}, "RoPE scaling factor"),
    ({**LLAMA, "rope_scaling": {"type": "linear", "factor": -2.0}}, "RoPE scaling factor"),
])
def test_a_length_or_factor_that_is_no_number_is_refused(tmp_path, config, match):
    with pytest.raises(ConfigError, match=match):
        vllm_start.max_positions(_checkpoint(tmp_path, config))


def _lengthless_model(tmp_path: Path) -> Path:
    source = resolve_model("tiny-llama")
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, tmp_path / name)
    config = json.loads((source / "config.json").read_text())
    del config["max_position_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")
    return tmp_path


@pytest.fixture
def no_vllm(monkeypatch):
    """`import vllm` fails: a test reaching the engine's start fails instead of starting one."""
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    monkeypatch.setenv("PARITY_VLLM_FAST_EXIT", "1")


def test_the_adapter_refuses_an_undecidable_length_before_vllm_loads_and_takes_a_given_one(tmp_path, no_vllm):
    model = _lengthless_model(tmp_path)
    with pytest.raises(ConfigError, match="pass max_model_len"):
        VLLMBackend(model)
    with pytest.raises(ImportError):  # a given max_model_len: the checkpoint's is not read
        VLLMBackend(model, engine_kwargs={"max_model_len": 256})


# -- 3. the GPU memory share -------------------------------------------------------------------------

BAD_SHARES = [0, 0.0, -0.2, 1.5, math.nan, math.inf, True, "0.5", None]


@pytest.mark.parametrize("share", BAD_SHARES)
def test_a_gpu_memory_share_outside_0_1_is_refused_naming_the_field(share):
    """0, negatives and NaN passed parity's free-memory check and failed inside vLLM's start (a server's:
    in its log); 1.5 read as a busy GPU; True would take the whole GPU."""
    with pytest.raises(ConfigError, match=r"engine_kwargs gpu_memory_utilization must be a share .*\(0, 1\]"):
        VLLMBackend.check_requests([], {"engine_kwargs": {"gpu_memory_utilization": share}})


@pytest.mark.parametrize("share", [0.01, 0.4, 1, 1.0])
def test_a_share_in_range_is_kept(share):
    given = {"gpu_memory_utilization": share}
    assert vllm_start.check_engine_kwargs(given) == given
    VLLMBackend.check_requests([], {"engine_kwargs": {"gpu_memory_utilization": share}})


@pytest.mark.parametrize("given", ["0", "-0.5", "1.2", "nan"])
def test_a_servers_share_outside_0_1_is_refused(given):
    for words in (["--gpu-memory-utilization", given], [f"--gpu_memory_utilization={given}"]):
        with pytest.raises(ConfigError, match="server_args --gpu-memory-utilization must be a share"):
            vllm_start.gpu_memory_share(words)
    assert vllm_start.gpu_memory_share(["--gpu-memory-utilization", "0.5"]) == 0.5


def test_the_adapter_refuses_the_share_before_vllm_loads(tmp_path, no_vllm):
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        VLLMBackend("tiny-llama", engine_kwargs={"gpu_memory_utilization": 0})


# -- 4. options that contradict each other or the requests ---------------------------------------------


def test_prefix_caching_given_twice_differently_is_refused():
    """The option silently overwrote engine_kwargs' value."""
    options = {"enable_prefix_caching": True, "engine_kwargs": {"enable_prefix_caching": False}}
    with pytest.raises(ConfigError, match="enable_prefix_caching=true contradicts engine_kwargs"):
        VLLMBackend.check_requests([], options)
    agreeing = {"enable_prefix_caching": False, "engine_kwargs": {"enable_prefix_caching": False}}
    VLLMBackend.check_requests([], agreeing)
    VLLMBackend.check_requests([], {"enable_prefix_caching": False})


@pytest.mark.parametrize(("engine_kwargs", "probe"), [
    ({"enforce_eager": True, "compilation_config": {"cudagraph_mode": "FULL"}}, False),
    ({"enforce_eager": True, "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4]}}, False),
    ({"enforce_eager": True, "max_cudagraph_capture_size": 64}, False),
    ({"compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"}}, True),  # the probe runs eager
])
def test_eager_mode_with_cuda_graph_settings_is_refused(engine_kwargs, probe):
    """vLLM drops the CUDA-graph settings under enforce_eager with an info line."""
    with pytest.raises(ConfigError, match=r"contradicts engine_kwargs .*cudagraph.*drop one of them"):
        VLLMBackend.check_requests([], {"engine_kwargs": engine_kwargs, "probe": probe})


@pytest.mark.parametrize("engine_kwargs", [
    {"enforce_eager": True, "compilation_config": {"cudagraph_mode": "NONE"}},
    {"enforce_eager": True, "compilation_config": 0},
    {"enforce_eager": False, "compilation_config": {"cudagraph_mode": "FULL"}},
    {"compilation_config": {"cudagraph_mode": "FULL", "cudagraph_capture_sizes": [1, 2]}},
])
def test_settings_that_agree_are_kept(engine_kwargs):
    VLLMBackend.check_requests([], {"engine_kwargs": engine_kwargs})


def test_a_request_longer_than_engine_kwargs_max_model_len_is_refused():
    """vLLM ends the sample at max_model_len with finish_reason "length": parity recorded it as a sample
    that ran to max_tokens (the checkpoint's own length is what the case check knows)."""
    request = Request(tuple(range(1, 11)), SamplingParams(max_tokens=8), "long")
    with pytest.raises(ConfigError, match=r"'long' needs 10 prompt \+ 8 generated = 18 .* max_model_len=16"):
        VLLMBackend.check_requests([request], {"engine_kwargs": {"max_model_len": 16}})
    for fits in (18, -1, None):  # -1: vLLM fits the length to memory
        VLLMBackend.check_requests([request], {"engine_kwargs": {"max_model_len": fits}})


@pytest.mark.parametrize("engine_kwargs", ["{max_num_seqs: 4}", ["max_num_seqs", 4], 4])
def test_engine_kwargs_that_are_no_object_are_refused_naming_the_option(engine_kwargs):
    """A command line's engine_kwargs that is not valid JSON stays a string: the adapter's start failed on
    `dict(...)` with a ValueError naming nothing."""
    with pytest.raises(ConfigError, match=r"option engine_kwargs must be an object of vllm\.LLM arguments"):
        VLLMBackend.check_requests([], {"engine_kwargs": engine_kwargs})
