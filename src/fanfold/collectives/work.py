"""``FanfoldWork``: the torch ``Work`` of a shared-memory collective of the ``fanfold`` backend (``backend.py``), and
:class:`Handout`, which makes the Work the backend returns safe to hand to torch's C++.

Layer: collectives, beside the backend. torch's own ``_create_work_from_future`` gives a Work whose ``wait()``
returns True even when the collective failed; gloo's raises, and so does this one: an error reaches the caller
of ``wait()`` and of ``get_future().wait()``, whichever it uses (DDP's reducer uses the future).

A Work written in Python is two objects: the Python one, which holds the methods, and torch's C++ half. When Python
code hands it to C++ and drops it -- torch's DDP does, with ``Join.notify_join_context``'s all-reduce, which its
reducer waits for in the backward -- the Python half dies, and the C++ half's ``wait()`` is the base class's,
which waits forever for a completion nobody signals (pybind11 issue 1333). So an asynchronous collective's Work is
one whose C++ half stands alone: torch's future-backed Work when the collective has already completed, else torch's
own holder of the Python Work (what it makes of the Work of a Python group's collective called from C++), which
owns the Python half for as long as C++ holds it. A synchronous one (``async_op=False``) is waited for at once by
``torch.distributed`` and dropped: it stays as it is.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

__all__ = ["FanfoldWork", "DoneWork", "Handout", "completed_work", "failed_work"]


class FanfoldWork(dist._Work):
    """A collective in flight on the transport's thread: ``future`` completes when this rank has its result (or
    fails); then ``finish`` (if any) runs, on that thread; ``result`` is what ``get_future()`` yields, as gloo's
    futures do (the output tensors)."""

    def __init__(self, future: torch.futures.Future, result: Any, finish: Callable[[], None] | None = None):
        super().__init__()
        self._future = future

        def done(fut: torch.futures.Future) -> Any:
            fut.value()
            if finish is not None:
                finish()
            return result
        self._result = future.then(done)

    def wait(self, timeout: timedelta | None = None) -> bool:
        # every wait of the transport is bounded by its own timeout (the group's), naming the missing rank
        self._future.wait()  # the transport's error as it is, not wrapped by the callback's future
        self._result.wait()
        return True

    def is_completed(self) -> bool:
        return self._result.done()

    def is_success(self) -> bool:
        if not self._result.done():
            raise RuntimeError("is_success on a collective that has not completed")
        try:
            self._result.value()
        except Exception:  # noqa: BLE001 - the question is only whether it failed
            return False
        return True

    def exception(self) -> BaseException | None:
        if not self._result.done():
            return None
        try:
            self._future.value()
            self._result.value()
        except Exception as exc:  # noqa: BLE001
            return exc
        return None

    def get_future(self) -> torch.futures.Future:
        return self._result


def completed_work(result: Any) -> FanfoldWork:
    fut = torch.futures.Future()
    fut.set_result(result)
    return FanfoldWork(fut, result)


def failed_work(error: BaseException, result: Any) -> FanfoldWork:
    """The Work of a collective that failed before its call returned: ``wait()`` raises ``error``."""
    fut = torch.futures.Future()
    fut.set_exception(error)
    return FanfoldWork(fut, result)


class DoneWork(dist._Work):
    """The Work of a collective that completed before its call returned (the latency path): nothing to wait for;
    ``get_future()`` yields ``result`` (the output tensors, as gloo's futures do)."""

    def __init__(self, result: Any):
        super().__init__()
        self._value = result

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return None

    def get_future(self) -> torch.futures.Future:
        fut = torch.futures.Future()
        fut.set_result(self._value)
        return fut


class _Holder(dist.ProcessGroup):
    """A group of one whose only collective returns the Work it was given: torch's C++ wraps what a Python group's
    collective returns in its holder of the Python Work (``PyWorkHolder``), which keeps the Python object alive."""

    def __init__(self) -> None:
        super().__init__(0, 1)
        self.given = threading.local()  # per thread: collectives may be issued from several

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self.given.work


class Handout:
    """``handout(work, async_op)``: the Work a collective of the ``fanfold`` group returns (see the module's
    docstring). An asynchronous one completed at return: torch's future-backed Work (``wait()`` returns at once,
    ``is_completed()`` is True; a finite ``wait(timeout)`` is refused by torch's class). Failed or in flight: torch's
    holder of ``work``, whose ``wait(timeout)`` and ``get_future()`` are ``work``'s; its ``is_completed()`` is the
    holder's own, False (torch forwards only those two)."""

    def __init__(self) -> None:
        self._holder = _Holder()

    def __call__(self, work: dist.Work, async_op: bool) -> dist.Work:
        if not async_op or not isinstance(work, (FanfoldWork, DoneWork)):
            return work  # waited for at once, or gloo's (C++ through and through)
        if work.is_completed() and work.exception() is None:
            return _create_work_from_future(work.get_future())
        self._holder.given.work = work
        try:
            return dist.ProcessGroup.allreduce(self._holder, [], dist.AllreduceOptions())
        finally:
            self._holder.given.work = None
