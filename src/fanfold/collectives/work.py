"""``FanfoldWork``: the torch ``Work`` of a shared-memory collective of the ``fanfold`` backend (``backend.py``).

Layer: collectives, beside the backend. torch's own ``_create_work_from_future`` gives a Work whose ``wait()``
returns True even when the collective failed; gloo's raises, and so does this one: an error reaches the caller
of ``wait()`` and of ``get_future().wait()``, whichever it uses (DDP's reducer uses the future).
"""
from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["FanfoldWork", "DoneWork", "completed_work", "failed_work"]


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
