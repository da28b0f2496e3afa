"""Stall inspector: every fanfold collective is numbered, every wait is bounded, and a stall names its cause.

Layer: between a transport (``collectives``) and its users (reducer, DDP). ``InspectedTransport(inner)`` implements
the collective interface (``collectives.Transport``) by delegating each method to ``inner`` once. Each collective
gets the next sequence number; each rank keeps its progress (the last collective started and the ones still in
flight: number, kind, bucket, the user's source line that triggered it; pid and host) in one key of the process
group's store, written by a background thread (~18 us a collective on the training thread, on a 2-core CPU host).
When a wait passes ``timeout`` seconds, or fails because a peer went away, the waiting rank reads every rank's
progress and raises :class:`StallError` naming itself, the collective and the ranks that never arrived: behind it
(a skipped backward, a rank that left the loop early), in a different collective under the same number (an extra
step meeting a barrier), or dead.

Waits are bounded without polling: torch ``Work.wait(timeout)``, or an event set by the callback of the handle's
torch future (a future, or ``handle.get_future()`` as ``ShmWork`` has). A handle of another kind is waited as is:
its transport bounds it. ``barrier`` goes through the store, bounded too. A synchronous ``broadcast`` of the inner
transport (parameters at construction, buffers before a forward) is bounded by the process group's own timeout, or
ends as soon as a peer that timed out elsewhere exits.
"""
from __future__ import annotations

import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..collectives.protocol import Transport
from ..collectives.store import StoreGroup
from ..collectives.timeouts import DEFAULT_STALL_TIMEOUT, ENV_VAR, resolve_stall_timeout
from .progress import Collective, Publisher, caller_line, process_gone, read_progress

__all__ = ["uninspected", "StallError", "InspectedTransport", "StallInspector", "inspected", "resolve_stall_timeout",
           "DEFAULT_STALL_TIMEOUT"]

_MAX_PENDING = 64
_HINT = (
    "Every rank must issue the same collectives in the same order: the same number of steps, each with one "
    "forward and one backward (DDP.join() handles uneven inputs, no_sync() accumulation). "
    f"The timeout is the stall_timeout argument or {ENV_VAR} (seconds)."
)


class StallError(RuntimeError):
    """A collective did not complete: ``rank`` gave up on collective ``seq``; ``missing`` lists the ranks that
    never arrived (behind, elsewhere, or dead)."""

    def __init__(self, message: str, *, rank: int, seq: int, kind: str, bucket: int | None, missing: list[int]):
        super().__init__(message)
        self.rank, self.seq, self.kind, self.bucket, self.missing = rank, seq, kind, bucket, missing


class _Timeout(Exception):
    pass


def _bounded_wait(handle: Any, timeout: float) -> Any:
    if isinstance(handle, dist.Work):
        if handle.is_completed():
            return handle.wait()  # the timed wait costs ~0.1 ms more per op on gloo; skip it when already done
        try:
            return handle.wait(timedelta(seconds=timeout))
        except RuntimeError:
            if not handle.is_completed():
                raise _Timeout() from None
            raise
    future = handle if isinstance(handle, torch.futures.Future) else _future_of(handle)
    if future is not None and not future.done():
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        if not done.wait(timeout):
            raise _Timeout()
    return handle.wait()  # done by now, or bounded by its own transport


def _future_of(handle: Any) -> torch.futures.Future | None:
    """The torch future behind a handle that offers one (``ShmWork.get_future()``), else None."""
    get = getattr(handle, "get_future", None)
    if get is None:
        return None
    future = get()
    return future if isinstance(future, torch.futures.Future) else None


class StallInspector:
    """Numbers collectives, publishes this rank's progress under ``str(rank)`` in ``store``, bounds waits and
    turns a stall into a :class:`StallError`. One per transport instance: its numbering is that transport's."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout: float | timedelta | None = None):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout = resolve_stall_timeout(timeout)
        self._seq = 0
        self._pending: list[Collective] = []  # started, not yet waited: a reducer has several buckets in flight
        self._state = {"pid": os.getpid(), "host": socket.gethostname(), "last": None, "pending": []}
        self._publisher = Publisher(store, str(rank))
        weakref.finalize(self, self._publisher.close)

    def start(self, kind: str, bucket: int | None = None) -> Collective:
        self._seq += 1
        op = Collective(self._seq, kind, bucket, caller_line())
        self._pending.append(op)
        del self._pending[:-_MAX_PENDING]  # handles dropped without a wait must not grow the record forever
        self._publish(last=op)
        return op

    def complete(self, op: Collective) -> None:
        if op in self._pending:
            self._pending.remove(op)
            self._publish()

    def wait(self, op: Collective, handle: Any) -> Any:
        """Wait for ``handle`` (the work of ``op``) at most ``timeout`` seconds; StallError otherwise."""
        try:
            result = _bounded_wait(handle, self.timeout)
        except _Timeout:
            raise self.diagnose(op, None) from None
        except Exception as exc:
            raise self.diagnose(op, exc) from exc
        self.complete(op)
        return result

    def run(self, kind: str, bucket: int | None, call: Callable[[], Any]) -> Any:
        """Start ``call()`` as collective ``kind``; wrap a returned handle so that its wait is inspected."""
        op = self.start(kind, bucket)
        try:
            handle = call()
        except Exception as exc:
            raise self.diagnose(op, exc) from exc
        if handle is None or not hasattr(handle, "wait"):
            self.complete(op)  # it ran synchronously
            return handle
        return InspectedWork(self, op, handle)

    def barrier(self) -> None:
        """Wait, at most ``timeout``, until every rank has reached its barrier of this number.

        Through the store rather than the transport: a synchronous barrier could not be bounded, and a barrier as
        a small all-reduce meeting a rank that is one collective off would make gloo abort that rank's process
        ("Received data size doesn't match expected size") before it could say anything."""
        op = self.start("barrier")
        self.flush()  # the peers must see this barrier in the record before they can give up on it
        key = f"barrier/{op.seq}"
        try:
            if self.store.add(key, 1) == self.world_size:
                self.store.set(f"{key}/all", "1")
            self.store.wait([f"{key}/all"], timedelta(seconds=self.timeout))
        except Exception as exc:
            timed_out = isinstance(exc, dist.DistStoreError) and "timeout" in str(exc).lower()
            raise self.diagnose(op, None if timed_out else exc) from None
        self.complete(op)

    def _publish(self, **fields: Any) -> None:
        self._state.update(fields, pending=list(self._pending))
        self._publisher.post(dict(self._state))

    def flush(self) -> None:
        """Return once this rank's latest progress is in the store (or the store is gone)."""
        self._publisher.flush()

    def _progress(self, rank: int) -> dict | str:
        return read_progress(self.store, rank)

    def diagnose(self, op: Collective, cause: BaseException | None) -> StallError:
        """Read every rank's progress and build the error for a wait on ``op`` that timed out or failed."""
        self._publish(gave_up=op.seq)
        self.flush()
        # A peer whose connection just dropped is usually still exiting: give it up to a second to finish.
        grace_until = time.monotonic() + (1.0 if cause is not None else 0.0)
        missing, lines = [], []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            p = self._progress(r)
            if isinstance(p, str):
                lines.append(f"  rank {r}: {p}")
                if p.startswith("has not"):
                    missing.append(r)
                continue
            last = Collective(*p["last"])
            pending = {o[0]: Collective(*o) for o in p["pending"]}
            gone = p["host"] == self._state["host"] and process_gone(p["pid"], grace_until)
            if op.seq in pending:
                theirs = pending[op.seq]
                same = (theirs.kind, theirs.bucket) == (op.kind, op.bucket)
                what = "arrived" if same else f"in a different collective with the same number: {theirs}"
            elif last.seq < op.seq:
                state = "still waiting on it" if last.seq in pending else "completed it"
                what = f"behind: its last collective is {last}, {state}"
            else:
                what = f"ahead: past #{op.seq}, its last collective is {last}"
            if "gave_up" in p:
                what += f"; it gave up waiting on #{p['gave_up']}"
            if what != "arrived" or gone:
                missing.append(r)
            if gone:
                what += f"; its process {p['pid']} is gone"
            lines.append(f"  rank {r}: {what}")
        verdict = f"did not complete within {self.timeout:g} s" if cause is None else f"failed ({type(cause).__name__})"
        parts = [f"rank {self.rank} of {self.world_size}: {op} {verdict}. "
                 f"Ranks that never arrived: {missing or 'none found'}.", *lines]
        if cause is not None:
            parts.append(f"  cause: {type(cause).__name__}: {str(cause)[:300]}")
        parts.append(_HINT)
        return StallError("\n".join(parts), rank=self.rank, seq=op.seq, kind=op.kind, bucket=op.bucket, missing=missing)


class InspectedWork:
    """The handle of an inspected collective: ``wait()`` is bounded and diagnosed; the rest is the inner handle's."""

    __slots__ = ("_inspector", "_op", "_handle")

    def __init__(self, inspector: StallInspector, op: Collective, handle: Any):
        self._inspector, self._op, self._handle = inspector, op, handle

    def wait(self, *args: Any, **kwargs: Any) -> Any:  # timeout arguments are ignored: the inspector's bound applies
        return self._inspector.wait(self._op, self._handle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def _store_prefix(group: Any) -> str:
    name = (group if group is not None else dist.group.WORLD).group_name
    return f"fanfold/stall/{name}/"


class InspectedTransport:
    """``inner`` (a ``collectives.Transport``) with numbered, published, bounded collectives. ``timeout`` in
    seconds (default ``$FANFOLD_STALL_TIMEOUT`` or 300); ``group``, ``rank`` and ``world_size`` default to the inner
    transport's (or the world's); ``store`` to the default process group's store. ``barrier()`` is the inspector's
    own, through the store: every rank reached it (collectives still in flight are not waited for)."""

    def __init__(self, inner: Transport, *, timeout: float | timedelta | None = None, group: Any = None,
                 store: dist.Store | None = None, rank: int | None = None, world_size: int | None = None):
        self.inner = inner
        group = group if group is not None else getattr(inner, "group", None)
        rank = rank if rank is not None else getattr(inner, "rank", None)
        self.rank = rank = dist.get_rank(group) if rank is None else rank
        world_size = world_size if world_size is not None else getattr(inner, "world_size", None)
        self.world_size = world_size = dist.get_world_size(group) if world_size is None else world_size
        if store is None:  # the group's store; a group under construction (the fanfold backend's) knows its own
            store = dist.PrefixStore("fanfold/stall/", group.store) if isinstance(group, StoreGroup) else \
                dist.PrefixStore(_store_prefix(group), dist.distributed_c10d._get_default_store())
        # Each rank counts its own transports in the store, so the n-th transport of every rank shares key space
        # n without any process-wide state, and two DDP models on one group do not mix their numbering.
        instance = store.add(f"instances/{rank}", 1)
        self.inspector = StallInspector(dist.PrefixStore(f"{instance}/", store), rank, world_size, timeout)

    def all_reduce(self, tensor: torch.Tensor, bucket: int | None = None, divisor: float | None = None) -> Any:
        return self.inspector.run("all_reduce", bucket, lambda: self.inner.all_reduce(tensor, bucket, divisor))

    def reduce_tensors(self, tensors: Sequence[torch.Tensor], bucket: int | None = None, *,
                       divisor: float | None = None, settle: bool = True, compress: torch.dtype | None = None) -> Any:
        return self.inspector.run("all_reduce", bucket, lambda: self.inner.reduce_tensors(
            tensors, bucket, divisor=divisor, settle=settle, compress=compress))

    def reduce_scatter(self, tensor: torch.Tensor, out: torch.Tensor, bucket: int | None = None, *,
                       divisor: float | None = None) -> Any:
        return self.inspector.run("reduce_scatter", bucket, lambda: self.inner.reduce_scatter(
            tensor, out, bucket, divisor=divisor))

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor, bucket: int | None = None) -> Any:
        return self.inspector.run("all_gather", bucket, lambda: self.inner.all_gather(tensor, out, bucket))

    def broadcast(self, tensor: torch.Tensor, src: int) -> Any:
        return self.inspector.run(f"broadcast(src={src})", None, lambda: self.inner.broadcast(tensor, src))

    def barrier(self) -> None:
        self.inspector.barrier()

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        return self.inner.allocate(numel, dtype, device)  # collective through the store, not numbered


def uninspected(transport: Transport) -> Transport:
    """The transport an :class:`InspectedTransport` inspects, or ``transport`` itself."""
    return transport.inner if isinstance(transport, InspectedTransport) else transport


def inspected(transport: Transport, timeout: float | timedelta | None = None) -> InspectedTransport:
    """``transport`` wrapped in an :class:`InspectedTransport`, unless it already is one."""
    return transport if isinstance(transport, InspectedTransport) else InspectedTransport(transport, timeout=timeout)
