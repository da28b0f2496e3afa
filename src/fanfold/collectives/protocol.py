"""The collective interface every fanfold feature that reaches other ranks talks to (:class:`Transport`, every
method required), its one handle (:class:`FanfoldWork`) and :class:`StallError`, the error of a collective a peer did
not complete. Collectives match by issue order: every rank calls the same methods with the same sizes in that order.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

__all__ = ["Transport", "Work", "TransportOwner", "StallError", "FanfoldWork", "completed_work", "failed_work"]


class StallError(RuntimeError):
    """A collective did not complete: ``rank`` gave up on collective ``seq`` (``kind``) of ``feature`` (the fanfold
    feature that issued it, e.g. "clip_grad_norm_"); ``missing`` lists the ranks that never arrived (behind,
    elsewhere, or dead); ``gone``: those of them whose process had exited (this failure is their death's consequence;
    ``fanfold run`` blames them). A peer's fault, told apart by its type from a misuse of the API (``ValueError``).
    ``headline``: the diagnosis in one line, what ``fanfold run`` and ``fanfold.launch`` print first (default: the
    message's first line)."""

    def __init__(self, message: str, *, rank: int, seq: int, kind: str, bucket: int | None, missing: list[int],
                 feature: str | None = None, gone: list[int] | None = None, headline: str | None = None):
        super().__init__(message)
        self.rank, self.seq, self.kind, self.bucket, self.missing = rank, seq, kind, bucket, missing
        self.feature, self.gone = feature, list(gone or ())
        self.headline = headline or message.partition("\n")[0]


@runtime_checkable
class Work(Protocol):
    """The handle of an asynchronous collective: ``wait()`` blocks until its result is in place."""

    def wait(self) -> Any: ...


@runtime_checkable
class Transport(Protocol):
    """Collectives over the ranks ``0..world_size-1`` of one group; this process is ``rank``."""

    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor, bucket: int | None = None, divisor: float | None = None) -> Work:
        """In-place SUM of ``tensor`` over the group, divided by ``divisor`` when given (bitwise the sum, then a
        division). ``bucket`` is a label for diagnostics (the gradient bucket index, None otherwise)."""
        ...

    def reduce_tensors(self, tensors: Sequence[torch.Tensor], bucket: int | None = None, *,
                       divisor: float | None = None, settle: bool = True,
                       compress: torch.dtype | None = None) -> Work:
        """All-reduce ``tensors`` (contiguous, one dtype, not overlapping), laid end to end as one tensor, in place:
        DDP's gradients where autograd left them. ``divisor``: as ``all_reduce``. The tensors must not change until
        the wait returns; with ``settle=False`` (every rank alike) not until a later collective of this transport
        has returned either. ``compress`` (torch.bfloat16 or torch.float16, float32 tensors): cast to it, average,
        cast back, as the compression hook of that name does on a bucket of these tensors (``TorchTransport``:
        bitwise torch's hook)."""
        ...

    def reduce_scatter(self, tensor: torch.Tensor, out: torch.Tensor, bucket: int | None = None, *,
                       divisor: float | None = None) -> Work:
        """The sum over the group of ``tensor`` (world_size times ``out``'s elements), divided by ``divisor`` when
        given; this rank's part (rank r: elements r * n .. (r + 1) * n) into ``out``. ``tensor`` may be overwritten."""
        ...

    def reduce_scatter_tensors(self, tensors: Sequence[torch.Tensor], out: torch.Tensor, bucket: int | None = None,
                               *, divisor: float | None = None, settle: bool = True,
                               compress: torch.dtype | None = None) -> Work:
        """``reduce_scatter`` of ``tensors`` laid end to end and zero-padded to world_size times ``out``'s
        elements (``ceil(total / world_size)``): ZeRO stage 2's gradients where autograd left them, this rank's part
        into ``out``. ``divisor``, ``settle``, ``compress``: as ``reduce_tensors`` (``out`` keeps the tensors'
        dtype when compressed)."""
        ...

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor, bucket: int | None = None) -> Work:
        """Every rank's ``tensor`` (the same size on every rank) into ``out``, by rank."""
        ...

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Rank ``src``'s ``tensor`` into every rank's, in place, synchronously."""
        ...

    def barrier(self) -> None: ...


@runtime_checkable
class TransportOwner(Protocol):
    """A process group that runs its collectives on a transport of its own (the ``fanfold`` backend's group):
    fanfold's DDP on such a group uses that transport, so torch's calls and DDP's share one collective layer."""

    def shared_transport(self) -> Transport | None:
        """The group's transport (None: it has none, e.g. ranks on different hosts). Collective at first use."""
        ...


class FanfoldWork(dist._Work):
    """The torch ``Work`` of a fanfold collective: ``future`` completes when this rank has its result (or fails);
    then ``finish`` (if any) runs, on that thread; ``result`` is what ``get_future()`` yields (gloo's: the output
    tensors). ``future=None``: completed before the call returned. ``wait()`` raises the collective's error."""

    def __init__(self, future: torch.futures.Future | None, result: Any, finish: Callable[[], None] | None = None):
        super().__init__()
        self._future = future
        self._origin: FanfoldWork | None = None  # chain()'s: the Work whose error wait() raises as it is
        if future is None:  # no future made unless asked for: the latency path makes one Work a call
            self._result, self._value = None, result
            return

        def done(fut: torch.futures.Future) -> Any:
            fut.value()
            if finish is not None:
                finish()
            return result
        self._result = future.then(done)

    def chain(self, result: Any, finish: Callable[[], None] | None = None) -> FanfoldWork:
        """A Work done once this one is and ``finish`` ran, yielding ``result``; its ``wait()`` raises this one's
        error as it is (ShmMismatchError, StallError), not as the RuntimeError of its text that a future's callback
        makes of it (which its ``get_future()`` still yields, as torch's C++ expects)."""
        work = FanfoldWork(self.get_future(), result, finish)
        work._origin = self
        return work

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._origin is not None:
            self._origin.wait()
        if self._future is not None:
            self._future.wait()  # the transport's error as it is, not wrapped by the callback's future
            self._result.wait()
        return True

    def is_completed(self) -> bool:
        return self._future is None or self._result.done()

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
    fut = torch.futures.Future()
    fut.set_exception(error)
    return FanfoldWork(fut, result)
