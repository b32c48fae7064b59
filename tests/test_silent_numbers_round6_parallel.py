"""Round 6 of "no silent wrong numbers": tensor parallelism and the processes parity starts.

Each test failed on the code before its fix: a private model copy was served another copy's cached
TP=1 shard (or the checkpoint's at TP>1), a shard cut again kept its old row-parallel sum under the
new label, an adapter lost its o_proj/down_proj deltas in a shard that still claimed it, an MLP the
degree does not divide started every rank before failing, a server "started" when another process
answered on its port, and a rank dead before connecting hung the launcher for its whole timeout.
"""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from parity.core.errors import AdapterError, BackendError, ConfigError
from parity.engine import ReferenceEngine
from parity.models.loading import copy_model, load_model, resolve_model
from parity.parallel import Comm, check_shardable, shard_model
from parity.parallel import group as group_module
from parity.parallel.layers import RowParallelLinear
from parity.runtime.processes import ServerProcess, free_loopback_port


def _embedding(lm) -> torch.Tensor:
    return lm.model.model.embed_tokens.weight


def test_a_private_copy_gets_a_shard_of_its_own_weights_not_a_cached_one() -> None:
    base = load_model("tiny-qwen3")
    policy = copy_model(base)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.mul_(0.5)
    mine = shard_model(policy, Comm.single())
    checkpoint = shard_model(base, Comm.single())
    assert torch.equal(_embedding(mine), _embedding(policy))
    assert torch.equal(_embedding(checkpoint), _embedding(base)), "the checkpoint got the copy's shard"
    with torch.no_grad():  # the policy moves on: its next shard follows it
        for p in policy.model.parameters():
            p.mul_(2.0)
    again = shard_model(policy, Comm.single())
    assert torch.equal(_embedding(again), _embedding(policy))
    assert shard_model(base, Comm.single()) is checkpoint  # the checkpoint's shard stays cached


def test_a_shard_is_not_cut_again_under_another_reduction() -> None:
    stock = shard_model("tiny-qwen3", Comm.single(), reduction="all_reduce")
    with pytest.raises(ConfigError, match=r"already a tensor-parallel shard.*checkpoint path"):
        shard_model(stock, Comm.single(), reduction="canonical", reduction_groups=16)
    canonical = shard_model("tiny-qwen3", Comm.single())
    with pytest.raises(ConfigError, match="already a tensor-parallel shard"):
        shard_model(canonical, Comm.single(), reduction_groups=16)
    assert shard_model(stock, Comm.single(), reduction="all_reduce") is stock  # the shard asked for
    fresh = shard_model("tiny-qwen3", Comm.single(), reduction_groups=16)
    rows = [m for m in fresh.model.modules() if isinstance(m, RowParallelLinear)]
    assert rows and all(m.reduction == "canonical" and len(m.parts) == 16 for m in rows)


def test_a_model_with_an_adapter_is_not_sharded_without_part_of_it() -> None:
    adapted = load_model("tiny-llama", lora="tiny-llama-lora-r8")
    with pytest.raises(AdapterError, match="adapter"):
        shard_model(adapted, Comm.single())


def test_a_private_copy_is_refused_at_tp2_before_any_rank_starts() -> None:
    policy = copy_model(load_model("tiny-qwen3"))
    with pytest.raises(ConfigError, match=r"private model copy.*checkpoint"):
        ReferenceEngine(policy, tensor_parallel_size=2)


def test_an_mlp_the_degree_does_not_divide_is_refused_before_the_ranks_start(tmp_path: Path) -> None:
    config = AutoConfig.from_pretrained(resolve_model("tiny-qwen3"))
    config.intermediate_size = 250  # 4 heads and 2 KV heads split at TP=2 and 4; 250 does not at 4
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    lm = load_model(tmp_path)
    check_shardable(lm, 2)
    with pytest.raises(ConfigError, match=r"size=4 does not divide .*intermediate size \(250\)"):
        check_shardable(lm, 4)


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_a_server_is_not_started_when_another_process_answers_on_its_port() -> None:
    port = free_loopback_port()
    other = http.server.HTTPServer(("127.0.0.1", port), _Health)  # took the port after parity picked it
    threading.Thread(target=other.serve_forever, daemon=True).start()
    asleep = [sys.executable, "-c", "import time; time.sleep(60)"]  # never binds the port
    server = ServerProcess(asleep, port=port, name="fake server")
    try:
        with pytest.raises(BackendError, match=f"another process .*answers on port {port}"):
            server.start(timeout_s=1.5)
        assert server.pid is None  # stopped
    finally:
        server.stop(1.0)
        other.shutdown()
        other.server_close()


def test_a_rank_that_exits_before_connecting_stops_the_group_at_once(monkeypatch) -> None:
    started: list[subprocess.Popen[bytes]] = []

    class Dying:
        def spawn(self, rank: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
            started.append(subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], env=env))
            return started[-1]

    monkeypatch.setattr(group_module, "zygote", Dying)
    monkeypatch.setattr(group_module, "CONNECT_TIMEOUT_S", 8.0)
    begun = time.monotonic()
    with pytest.raises(group_module.TensorParallelError, match=r"exited \(exit code 3\) before it connected"):
        group_module.RankGroup(2, "cpu", dict)
    assert time.monotonic() - begun < 4.0, "waited for the connect timeout of a rank already gone"
    assert len(started) == 2 and all(p.returncode is not None for p in started)
