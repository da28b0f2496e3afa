"""``FanfoldWork``, the torch ``Work`` of a fanfold collective (done at return, or a torch future in flight; its
``wait()`` raises the collective's error, as gloo's does), and :class:`Handout`, which makes the Work the ``fanfold``
backend returns safe to hand to torch's C++ (a Work written in Python dies with its Python half: docs/backend.md).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

__all__ = ["FanfoldWork", "Handout", "completed_work", "failed_work"]


class FanfoldWork(dist._Work):
    """The torch Work of a fanfold collective: ``future`` completes when this rank has its result (or fails); then
    ``finish`` (if any) runs, on that thread; ``result`` is what ``get_future()`` yields, as gloo's futures do (the
    output tensors). ``future=None``: completed before the call returned (the latency path), nothing to wait for."""

    def __init__(self, future: torch.futures.Future | None, result: Any, finish: Callable[[], None] | None = None):
        super().__init__()
        self._future = future
        if future is None:  # no future made unless asked for: the latency path makes one Work a call
            self._result, self._value = None, result
            return

        def done(fut: torch.futures.Future) -> Any:
            fut.value()
            if finish is not None:
                finish()
            return result
        self._result = future.then(done)

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._future is not None:
            # every wait of the transport is bounded by its own timeout (the group's), naming the missing rank
            self._future.wait()  # the transport's error as it is, not wrapped by the callback's future
            self._result.wait()
        return True

    def is_completed(self) -> bool:
        return self._future is None or self._result.done()

    def is_success(self) -> bool:
        if self._future is None:
            return True
        if not self._result.done():
            raise RuntimeError("is_success on a collective that has not completed")
        try:
            self._result.value()
        except Exception:  # noqa: BLE001 - the question is only whether it failed
            return False
        return True

    def exception(self) -> BaseException | None:
        if self._future is None or not self._result.done():
            return None
        try:
            self._future.value()
            self._result.value()
        except Exception as exc:  # noqa: BLE001
            return exc
        return None

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            fut = torch.futures.Future()
            fut.set_result(self._value)
            return fut
        return self._result


def completed_work(result: Any) -> FanfoldWork:
    return FanfoldWork(None, result)


def failed_work(error: BaseException, result: Any) -> FanfoldWork:
    """The Work of a collective that failed before its call returned: ``wait()`` raises ``error``."""
    fut = torch.futures.Future()
    fut.set_exception(error)
    return FanfoldWork(fut, result)


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
        if not async_op or not isinstance(work, FanfoldWork):
            return work  # waited for at once, or gloo's (C++ through and through)
        if work.is_completed() and work.exception() is None:
            return _create_work_from_future(work.get_future())
        self._holder.given.work = work
        try:
            return dist.ProcessGroup.allreduce(self._holder, [], dist.AllreduceOptions())
        finally:
            self._holder.given.work = None
