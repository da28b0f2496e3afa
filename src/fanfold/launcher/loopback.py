"""Everything a local launch listens on stays on 127.0.0.1: a free port there, a store hosted there, gloo pinned to
the loopback interface. Used by ``spawn`` (fanfold.launch) and ``agent`` (fanfold run)."""
from __future__ import annotations

import socket

__all__ = ["LOOPBACK", "free_port", "loopback_store", "loopback_interface"]

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_store(timeout: float):
    """A TCPStore server listening on 127.0.0.1 only, on a port of its own; returns ``(store, port)``.

    Given a host name, TCPStore listens on every interface; given a socket already bound to loopback it listens on
    that alone. Binding the socket here also removes the race of "find a free port, then bind it".
    """
    from datetime import timedelta

    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    store = TCPStore(LOOPBACK, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                     timeout=timedelta(seconds=timeout), master_listen_fd=sock.detach())
    return store, port


def loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS), or None if not found."""
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return next((n for n in ("lo", "lo0") if n in names), None)
