"""The shm transport's worker: the thread that runs its collectives, the caller-thread path for small ones, and
the handles of both.

Layer: used by ``transport.py`` (which builds the requests); runs ``engine.Engine`` and closes the ``segment.Segment``
mappings. Collectives run in the order they were numbered (every rank issues them in the same order, so the n-th
of every rank is the same one): queued ones in FIFO order on one thread per transport; one that the transport marks
for the caller's thread runs there only when nothing is queued or running (no hand-off: its latency is the peers'
alone).
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from .engine import Engine
from .request import Collective, Request
from .segment import Segment

__all__ = ["ShmWork", "completed", "Worker"]


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


class Worker:
    """Numbers the collectives of one transport and runs them on ``engine``: queued for its thread, or on the
    caller's thread (``inline``) when nothing is queued or running. After a failure the transport is unusable (the
    peers were told through the abort word); later collectives get the same error."""

    def __init__(self, engine: Engine, name: str, timeout: Callable[[], float]):
        """``timeout()``: the bound of a collective numbered now (read on the caller's thread)."""
        self.engine, self._timeout = engine, timeout
        self.seq = 0  # the collectives numbered so far
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # numbering, queueing and the count of unfinished collectives, together
        self._running = threading.Lock()  # held while the engine runs: one collective at a time, in number order
        self._pending = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True, name=name)
        self._thread.start()

    def submit(self, c: Collective, value: Any, finish: Any = None, inline: bool = False) -> torch.futures.Future:
        """Number ``c`` and run it; the future yields ``value`` once it (and ``finish``) ran. ``inline``: run it on
        this thread, before returning, if nothing is queued or running (otherwise it is queued like the rest)."""
        fut = torch.futures.Future()
        with self._lock:  # numbering and queueing together: the FIFO order is the numbering order
            self.seq += 1
            request = Request(fut, value, finish, replace(c, seq=self.seq, timeout=self._timeout()))
            inline = inline and self._pending == 0
            self._pending += 1
            if inline:
                # Nothing unfinished: the thread is not running (it releases the engine before it counts down)
                self._running.acquire()
            else:
                self._requests.put(request)
        if inline:
            try:
                self._execute(request)
            finally:
                self._running.release()
                self._done()
        return fut

    def run_small(self, t: torch.Tensor, divisor: float | None, bucket: int | None) -> bool:
        """An all_reduce of contiguous ``t`` (at most a quarter chunk) on this thread, if nothing is queued or
        running: True once done (raising the transport's error, as its handle would). False, with nothing done, when
        it must queue."""
        with self._lock:
            if self._pending or self._error is not None:
                return False
            self.seq += 1
            seq = self.seq
            self._pending = 1
            self._running.acquire()  # nothing unfinished: the thread is not running (see submit)
        try:
            self.engine.seg.timeout = self._timeout()
            self.engine.run_small(t, divisor, seq, bucket)
        except BaseException as exc:  # noqa: BLE001 - every peer must learn of the failure, as in _execute
            self._error = exc
            self._abort(exc)
            raise
        finally:
            self._running.release()
            self._done()
        return True

    def _abort(self, exc: BaseException) -> None:
        # the peers raise at once, naming the ranks this one found missing (a StallError's), if any
        self.engine.seg.abort(f"rank {self.engine.rank}: {type(exc).__name__}: {exc}", getattr(exc, "missing", None))

    def _serve(self) -> None:
        while True:
            request = self._requests.get()
            if request is None:
                return
            with self._running:  # behind a collective running on a caller's thread, numbered before this one
                self._execute(request)
            self._done()

    def _done(self) -> None:
        with self._lock:
            self._pending -= 1

    def _execute(self, request: Request) -> None:
        if self._error is not None:
            error = RuntimeError(f"the shm transport failed earlier and cannot be used: {self._error}")
            error.__cause__ = self._error  # what failed, for the stall inspector's diagnosis
            request.future.set_exception(error)
            return
        try:
            self.engine.run(request.collective)
            if request.finish is not None:
                request.finish()
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the waiting caller
            self._error = exc
            self._abort(exc)
            request.future.set_exception(exc)
            return
        request.future.set_result(request.value)

    def stop(self, segment: Segment, regions: list[Segment]) -> None:
        """Finish the queued collectives, stop the thread, let go of the segment and the regions: each is unmapped
        now, or when the last tensor viewing it dies (``Segment.close``)."""
        if self._thread.is_alive():
            self._requests.put(None)
            self._thread.join(5.0)
        if not self._thread.is_alive():
            self.engine.close()
            segment.close()
            for region in regions:
                region.close()
            regions.clear()
