"""``FanfoldWork``, the one handle of a fanfold collective: a torch ``Work``, done at return or backed by a torch
future in flight; its ``wait()`` raises the collective's error, as gloo's does."""
from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["FanfoldWork", "completed_work", "failed_work"]


class FanfoldWork(dist._Work):
    """``future`` completes when this rank has its result (or fails); then ``finish`` (if any) runs, on that thread;
    ``result`` is what ``get_future()`` yields (gloo's: the output tensors). ``future=None``: completed before the
    call returned, nothing to wait for."""

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
            self._future.wait()  # the transport's error as it is, not wrapped by the callback's future
            self._result.wait()
        return True

    def is_completed(self) -> bool:
        return self._future is None or self._result.done()

    def is_success(self) -> bool:
        if not self.is_completed():
            raise RuntimeError("is_success on a collective that has not completed")
        return self.exception() is None

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

