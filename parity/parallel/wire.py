"""Messages between the caller and its rank processes: whole objects, pickled by value."""

from __future__ import annotations

import pickle
from multiprocessing.connection import Connection
from typing import Any


def send(conn: Connection, obj: Any) -> None:
    """Pickle `obj` by value: `Connection.send` would pass tensors as shared-memory handles, which
    only processes started by multiprocessing (sharing its authkey) can open."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> Any:
    """The next object `send` sent on `conn`."""
    return pickle.loads(conn.recv_bytes())
