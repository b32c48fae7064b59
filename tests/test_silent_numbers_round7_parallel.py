"""Round 7 of "no silent wrong numbers": the tensor-parallel process groups parity starts on CPU.

Each test failed on the code before its fix: the rendezvous port was picked free and bound later by
rank 0 (a process that took it in between failed the start), rank 0's rendezvous store listened on
every interface (`::`), a GLOO_SOCKET_IFNAME in the user's environment made the ranks listen on that
(public) interface, and ranks that fed each other other tokens (a tool replying differently per rank)
returned rank 0's rollouts with logprobs that no model computes for its tokens, silently.
"""

from __future__ import annotations

import ipaddress
import socket

import psutil
import pytest
import torch.distributed as dist
from procs import listening_addresses

from parity.core.turns import Generate, Inject
from parity.core.types import Request, SamplingParams
from parity.engine import ReferenceEngine
from parity.parallel import RankGroup, TensorParallelError
from parity.parallel import group as group_module

pytestmark = pytest.mark.slow


def _listening(group: RankGroup) -> set[str]:
    return listening_addresses([psutil.Process(pid) for pid in group.pids])


def _loopback(addresses: set[str]) -> bool:
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def test_rank_0_binds_the_rendezvous_port_on_loopback_not_one_picked_before(probe_path, monkeypatch) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        # the port a pick-then-bind launcher would pick, taken by another process before rank 0 binds it
        monkeypatch.setattr(group_module, "free_loopback_port", lambda: port, raising=False)
        with RankGroup(2, "cpu", probe_path) as group:
            assert group.call("gather") == [0, 1]
            addresses = _listening(group)
    assert _loopback(addresses), f"the ranks listen on {addresses}"


def reply_of_this_rank(history: tuple[int, ...]) -> tuple[int, ...]:
    """A tool whose reply differs between ranks (as one drawing from a per-process random state, or
    calling a service, would): token 5 on rank 0, 405 (the other half of the vocabulary) on rank 1."""
    return (5 + 400 * (dist.get_rank() if dist.is_initialized() else 0),)


def test_ranks_that_fed_each_other_other_tokens_are_refused_not_rank_0s_mix(probe_path) -> None:
    # before: rank 0's rollout claimed token 24 after the injected 5 with logprob -6.1666, while the
    # model's logprob of that token given those ids is -6.8865 (rank 1's partials came from token 405)
    turns = (Generate(2), Inject(fn=reply_of_this_rank, name="per_rank"), Generate(4))
    requests = [Request(request_id="r0", prompt_ids=(5, 6, 7), turns=turns,
                        sampling=SamplingParams(max_tokens=8, temperature=1.0, seed=3))]
    with ReferenceEngine("tiny-qwen3", tensor_parallel_size=2) as engine:
        pids = engine._ranks.pids
        expected = (r"rank 1 of 2 holds other token ids than rank 0 after generate \(first at result 0: "
                    r"request 'r0', sample 0\).*deterministic")
        with pytest.raises(TensorParallelError, match=expected):
            engine.generate(requests)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


class _Holds:
    """A rank object whose rollouts' tokens are the same on every rank but the other fields differ."""

    def __init__(self, comm) -> None:
        self.comm = comm

    def rollouts(self) -> list:
        from types import SimpleNamespace

        return [SimpleNamespace(token_ids=(1, 2), logprobs=(-0.5, -1.0), request_id="a", sample_index=0,
                                rank=self.comm.rank), SimpleNamespace(token_ids=(), request_id="b")]


def test_ranks_that_hold_the_same_tokens_return_rank_0s_result(probe_path) -> None:
    with RankGroup(2, "cpu", _Holds) as group:
        result = group.call("rollouts")
        assert [r.request_id for r in result] == ["a", "b"] and result[0].rank == 0
        assert group.call("rollouts")[0].token_ids == (1, 2)  # the group still serves


def _public_interface() -> str:
    """A non-loopback interface of this host (or a name no host has: gloo fails on it at once)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback
               for a in addresses):
            return name
    return "parity-no-such-if0"


def test_a_users_socket_interface_does_not_move_parity_ranks_off_loopback(probe_path, monkeypatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", _public_interface())  # set for the user's multi-host jobs
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", _public_interface())
    with RankGroup(2, "cpu", probe_path) as group:
        assert group.call("environ", "GLOO_SOCKET_IFNAME") == "lo"
        assert group.call("environ", "NCCL_SOCKET_IFNAME") == "lo"
        addresses = _listening(group)
    assert _loopback(addresses), f"the ranks listen on {addresses}"
