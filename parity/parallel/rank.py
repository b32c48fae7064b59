"""A rank process of a `RankGroup` (`python -m parity.parallel.rank RANK`, or forked by the zygote):
it connects back (`PARITY_TP_CALLER`), joins the group, builds its object and serves calls; a
failure is sent with its traceback and the process exits at once (a peer may be blocked in a
collective).
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from datetime import timedelta
from multiprocessing.connection import Client, Connection

from parity.parallel.wire import receive, send

#: a collective that waits longer than this fails (a hung peer), in seconds.
COLLECTIVE_TIMEOUT_S = 600.0
#: gloo and NCCL on the loopback interface (a rank keeps a value the caller set).
LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "NCCL_NVLS_ENABLE": "0"}


def serve(rank: int, conn: Connection) -> None:
    """Join the group, build the object, answer (method, args, kwargs) messages until None."""
    size, port, device_type, factory = receive(conn)
    for name, value in LOOPBACK.items():
        os.environ.setdefault(name, value)
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
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    state = factory(Comm(rank, size))
    send(conn, ("ok", None))
    while (message := receive(conn)) is not None:
        method, args, kwargs = message
        result = getattr(state, method)(*args, **kwargs)
        send(conn, ("ok", result if rank == 0 else None))
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
