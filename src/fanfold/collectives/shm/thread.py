"""The shm transport's background thread and the handles of its collectives.

Layer: used by ``shm.py`` (the transport queues requests here); runs ``shm_engine.Engine`` and closes the
``shm_segment.Segment`` mappings. One thread per transport serves requests in FIFO order -- every rank issues its
collectives in the same order, so the n-th request of every rank is the same collective.
"""
from __future__ import annotations

import queue
import threading
from typing import Any

import torch

from .engine import Engine
from .segment import Segment

__all__ = ["ShmWork", "completed", "serve", "stop"]


class ShmWork:
    """The handle of an asynchronous collective: ``wait()`` blocks until the tensor holds the result (or raises
    the transport's error; the transport's timeout bounds it), ``get_future()`` gives a torch Future of the tensor."""

    __slots__ = ("_future",)

    def __init__(self, future: torch.futures.Future):
        self._future = future

    def wait(self, timeout: Any = None) -> bool:
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        return self._future


def completed(value: Any) -> ShmWork:
    fut = torch.futures.Future()
    fut.set_result(value)
    return ShmWork(fut)


def serve(requests: queue.SimpleQueue, engine: Engine) -> None:
    """The transport's thread: requests in FIFO order (every rank issues them in the same order). After a failure
    the transport is unusable (the peers were told through the abort word); later requests get the same error."""
    error = None
    while True:
        item = requests.get()
        if item is None:
            return
        fut, value, finish, args = item
        if error is not None:
            fut.set_exception(RuntimeError(f"the shm transport failed earlier and cannot be used: {error}"))
            continue
        try:
            engine.run(*args)
            if finish is not None:
                finish()
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the waiting caller
            error = exc
            engine.seg.abort(f"rank {engine.rank}: {type(exc).__name__}: {exc}")
            fut.set_exception(exc)
            continue
        fut.set_result(value)


def stop(requests: queue.SimpleQueue, thread: threading.Thread, segment: Segment | None, regions: list) -> None:
    if thread is not None and thread.is_alive():
        requests.put(None)
        thread.join(5.0)
    if segment is not None and (thread is None or not thread.is_alive()):
        segment.close()
        for *_, region in regions:  # mappings still used by tensors stay until those go (Segment.close)
            region.close()
        regions.clear()
