"""Everything a local launch listens on stays on 127.0.0.1: a free port there, the job's store hosted there (open
only to processes holding the job's secret), gloo pinned to the loopback interface. Used by ``spawn``
(fanfold.launch) and ``agent`` (fanfold run)."""
from __future__ import annotations

import socket

from .._core.job_store import StoreServer

__all__ = ["LOOPBACK", "free_port", "loopback_store", "loopback_interface"]

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_store(secret: bytes) -> StoreServer:
    """The job's store, served on a port of its own on 127.0.0.1 only, to clients that prove ``secret``
    (``fanfold._core.job_store``): loopback keeps out other hosts, the secret other users of this one."""
    return StoreServer(secret, host=LOOPBACK)


def loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS), or None if not found."""
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return next((n for n in ("lo", "lo0") if n in names), None)
