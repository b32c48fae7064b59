"""A rank process of a `RankGroup` (`python -m parity.parallel.rank RANK`, or forked by the zygote):
it connects back (`PARITY_TP_CALLER`), joins the group, builds its object and serves calls; a
failure is sent with its traceback and the process exits at once (a peer may be blocked in a
collective).

The group is single-host and listens on loopback only: rank 0 binds the rendezvous store to
127.0.0.1 on a port the OS picks (and reports it; no port is picked first and bound later, which
another process could take in between), and gloo/NCCL use the loopback interface whatever
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME the caller's environment holds (a value meant for the
user's own multi-host jobs would make parity's ranks listen on a public interface).
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import sys
import traceback
from datetime import timedelta
from multiprocessing.connection import Client, Connection
from typing import Any

import psutil

from parity.parallel.wire import receive, send

#: a collective that waits longer than this fails (a hung peer), in seconds.
COLLECTIVE_TIMEOUT_S = 600.0
#: the address the rendezvous store listens on (`runtime.processes.LOOPBACK`, not imported: that module
#: would load httpx into every rank).
STORE_HOST = "127.0.0.1"
#: the variables that put gloo and NCCL on an interface: the loopback one, always (single-host groups).
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
#: NCCL settings a rank takes unless the caller set them.
DEFAULTS = {"NCCL_NVLS_ENABLE": "0"}


def loopback_interface() -> str:
    """This host's loopback interface: the one holding 127.0.0.1 (lo on Linux, lo0 on macOS)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == STORE_HOST for a in addresses):
            return name
    return "lo"


def set_environment() -> None:
    """The loopback settings (over any the caller's environment holds) and the defaults."""
    os.environ.update(dict.fromkeys(INTERFACE_VARIABLES, loopback_interface()))
    for name, value in DEFAULTS.items():
        os.environ.setdefault(name, value)


def agreement(result: Any) -> tuple[bytes, ...] | None:
    """What every rank must hold alike in a call's result: for a list of rollouts, a digest of each
    one's token ids (each rank fed them to its own next steps: ranks that sampled or injected other
    tokens computed one another's partials on other inputs); None for any other result."""
    if not isinstance(result, list) or not all(hasattr(item, "token_ids") for item in result):
        return None
    return tuple(hashlib.blake2b(repr(tuple(item.token_ids)).encode(), digest_size=16).digest()
                 for item in result)


def _store(rank: int, size: int, port: int | None, conn: Connection) -> Any:
    """The group's rendezvous store: rank 0 serves it on 127.0.0.1 at a port the OS picks and sends
    the port to the caller (who passes it to the other ranks); the others connect to `port`."""
    import torch.distributed as dist  # loaded by `serve` after `set_environment`: here only bound again

    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if rank != 0:
        return dist.TCPStore(STORE_HOST, port, size, is_master=False, timeout=timeout)
    listening = socket.create_server((STORE_HOST, 0), backlog=max(size, 128))
    bound = int(listening.getsockname()[1])
    # the store takes the socket (its own bind would listen on every interface)
    store = dist.TCPStore(STORE_HOST, bound, size, is_master=True, timeout=timeout, wait_for_workers=False,
                          master_listen_fd=listening.detach())
    send(conn, ("ok", bound))
    return store


def serve(rank: int, conn: Connection) -> None:
    """Join the group, build the object, answer (method, args, kwargs) messages until None."""
    size, port, device_type, factory = receive(conn)
    set_environment()
    # after the loopback settings: NCCL and gloo read them when torch.distributed loads
    import torch
    import torch.distributed as dist

    from parity.parallel.comm import Comm  # torch's: loaded after the loopback settings above

    backend = "gloo"
    if device_type == "cpu":
        # k ranks share the host's cores; the CPU kernels' bits do not depend on the thread count
        torch.set_num_threads(max(1, torch.get_num_threads() // size))
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        backend = "nccl"
    dist.init_process_group(backend, store=_store(rank, size, port, conn), rank=rank, world_size=size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    state = factory(Comm(rank, size))
    send(conn, ("ok", None))
    while (message := receive(conn)) is not None:
        method, args, kwargs = message
        result = getattr(state, method)(*args, **kwargs)
        send(conn, ("ok", (result if rank == 0 else None, agreement(result))))
    dist.destroy_process_group()
    send(conn, ("ok", None))


def main(rank: int) -> None:
    """Connect back to the caller (`PARITY_TP_CALLER`) and serve as rank `rank` until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller stops the group on Ctrl-C
    host, port, key = os.environ.pop("PARITY_TP_CALLER").rsplit(":", 2)
    conn = Client((host, int(port)), authkey=bytes.fromhex(key))
    send(conn, rank)
    try:
        serve(rank, conn)
    except BaseException:
        try:
            send(conn, ("error", traceback.format_exc()))
        finally:
            os._exit(1)


if __name__ == "__main__":
    main(int(sys.argv[1]))
