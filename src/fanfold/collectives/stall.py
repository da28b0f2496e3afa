"""Stall inspector: every fanfold collective is numbered, every wait is bounded, and a stall names its cause.

``InspectedTransport(inner)`` implements the collective interface (``protocol.Transport``) by delegating each method
to ``inner`` once; every feature that reaches other ranks (DDP, ZeRO, SyncBatchNorm, clip_grad_norm_, a pipeline's
data parallelism, checkpoints and object collectives: :func:`group_transport`) talks through one. Each collective
gets a number, shows in torch.profiler traces as ``fanfold.<kind>``, and is published in the rank's progress record
(``progress.py``); a wait past the timeout, or one that fails, raises :class:`StallError` naming the feature, the
collective and the ranks that never arrived. Design notes: docs/reliability.md.
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
from torch.autograd.profiler import record_function

from .errors import StallError
from .progress import Collective, Publisher, caller_line, process_gone, read_progress
from .protocol import Transport, TransportOwner
from .shm.transport import ShmTransport
from .store import StoreGroup
from .timeouts import DEFAULT_STALL_TIMEOUT, ENV_VAR, resolve_stall_timeout
from .transport import TorchTransport

__all__ = ["StallError", "InspectedTransport", "StallInspector", "inspected", "group_transport",
           "resolve_stall_timeout", "DEFAULT_STALL_TIMEOUT"]

_MAX_PENDING = 64
_HINT = (
    "Every rank must issue the same collectives in the same order: the same number of steps, each with one "
    "forward and one backward (DDP.join() handles uneven inputs, no_sync() accumulation). "
    f"The timeout is the stall_timeout argument or {ENV_VAR} (seconds)."
)


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
    turns a stall into a :class:`StallError`. One per transport instance: its numbering is that transport's.
    ``feature`` names what issues the collectives in errors ("DistributedDataParallel", "SyncBatchNorm", ...)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout: float | timedelta | None = None,
                 feature: str | None = None):
        self.store, self.rank, self.world_size, self.feature = store, rank, world_size, feature
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
        """Start ``call()`` as collective ``kind``; wrap a returned handle so that its wait is inspected. Under
        torch.profiler the collective is a ``fanfold.<kind>`` span from the call to its completion."""
        op = self.start(kind, bucket)
        if torch._C._autograd._profiler_enabled():  # a C call: record_function costs ~5 us, this ~0.1 us
            return self._profiled(op, call)
        try:
            handle = call()
        except Exception as exc:
            raise self.diagnose(op, exc) from exc
        if handle is None or not hasattr(handle, "wait"):
            self.complete(op)  # it ran synchronously
            return handle
        return InspectedWork(self, op, handle)

    def _profiled(self, op: Collective, call: Callable[[], Any]) -> Any:
        with record_function(f"fanfold.{op.kind.partition('(')[0]}") as span:
            try:
                handle = call()
            except Exception as exc:
                raise self.diagnose(op, exc) from exc
            if handle is None or not hasattr(handle, "wait"):
                self.complete(op)
                return handle
            future = handle if isinstance(handle, torch.futures.Future) else _future_of(handle)
            if future is not None and not future.done():
                span._call_end_callbacks_on_future(future)  # the span ends when the collective does
            return InspectedWork(self, op, handle)

    def barrier(self) -> None:
        """Wait, at most ``timeout``, until every rank has reached its barrier of this number.

        Through the store rather than the transport: a synchronous barrier could not be bounded, and a barrier as
        a small all-reduce meeting a rank that is one collective off would make gloo abort that rank's process
        ("Received data size doesn't match expected size") before it could say anything."""
        op = self.start("barrier")
        if torch._C._autograd._profiler_enabled():
            with record_function("fanfold.barrier"):
                return self._barrier(op)
        self._barrier(op)

    def _barrier(self, op: Collective) -> None:
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
            arrived = False
            if op.seq in pending:
                theirs = pending[op.seq]
                arrived = (theirs.kind, theirs.bucket) == (op.kind, op.bucket)
                what = "arrived" if arrived else f"in a different collective with the same number: {theirs}"
            elif last.seq < op.seq:
                state = "still waiting on it" if last.seq in pending else "completed it"
                what = f"behind: its last collective is {last}, {state}"
            else:
                what = f"ahead: past #{op.seq}, its last collective is {last}"
            if "gave_up" in p:
                what += f"; it gave up waiting on #{p['gave_up']}"
            if not arrived or gone:  # a rank that arrived and then gave up, as this one, is not missing
                missing.append(r)
            if gone:
                what += f"; its process {p['pid']} is gone"
            lines.append(f"  rank {r}: {what}")
        verdict = f"did not complete within {self.timeout:g} s" if cause is None else f"failed ({type(cause).__name__})"
        who = "" if self.feature is None else f"{self.feature}'s "
        parts = [f"rank {self.rank} of {self.world_size}: {who}{op} {verdict}. "
                 f"Ranks that never arrived: {missing or 'none found'}.", *lines]
        if cause is not None:
            parts.append(f"  cause: {type(cause).__name__}: {str(cause)[:300]}")
        parts.append(_HINT)
        return StallError("\n".join(parts), rank=self.rank, seq=op.seq, kind=op.kind, bucket=op.bucket, missing=missing,
                          feature=self.feature)


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
    transport's (or the world's); ``store`` to the default process group's store; ``feature`` names the issuer in
    errors. ``barrier()`` is the inspector's own, through the store: every rank reached it (collectives still in
    flight are not waited for)."""

    def __init__(self, inner: Transport, *, timeout: float | timedelta | None = None, group: Any = None,
                 store: dist.Store | None = None, rank: int | None = None, world_size: int | None = None,
                 feature: str | None = None):
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
        self.inspector = StallInspector(dist.PrefixStore(f"{instance}/", store), rank, world_size, timeout, feature)

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

    def all_reduce_now(self, tensor: torch.Tensor, bucket: int | None = None) -> torch.Tensor:
        """Sum ``tensor`` over the group, in place, and return it once done: the rule for a small collective waited
        for at once (SyncBatchNorm's statistics) -- on this thread where the transport can (the shm transport's
        latency path, when nothing else is in flight), no hand-off to a transport thread and back."""
        inner = self.inner
        if isinstance(inner, ShmTransport):
            self.inspector.run("all_reduce", bucket, lambda: inner.all_reduce(tensor, bucket, inline=True)).wait()
        else:
            self.all_reduce(tensor, bucket).wait()
        return tensor

    def on_group(self, group: Any) -> bool:
        """Whether these collectives travel over torch.distributed's ``group`` itself (None: the default group),
        where they would interleave with that group's other collectives."""
        world = dist.group.WORLD
        return isinstance(self.inner, TorchTransport) and (self.inner.group or world) is (group or world)

    def reads_peers(self) -> bool:
        """Whether the transport all-reduces tensors where they lie (the shm transport reading its peers' memory)."""
        return isinstance(self.inner, ShmTransport) and self.inner.peer_read

    def gathers(self) -> bool:
        """Whether ``all_gather`` is the fast way to gather; else broadcasting each piece is (torch's gloo)."""
        return not isinstance(self.inner, TorchTransport) or self.inner.native_scatter

    def reduce_scatter_tensors(self, tensors: list[torch.Tensor], out: torch.Tensor, bucket: int | None = None,
                               **kw: Any) -> Any:
        """The shm transport's reduce-scatter of tensors read where they lie (where :meth:`reads_peers`)."""
        return self.inspector.run("reduce_scatter", bucket, lambda: self.inner.reduce_scatter_tensors(
            tensors, out, bucket, **kw))


def inspected(transport: Transport, timeout: float | timedelta | None = None, feature: str | None = None
              ) -> InspectedTransport:
    """``transport`` wrapped in an :class:`InspectedTransport`, unless it already is one."""
    if isinstance(transport, InspectedTransport):
        return transport
    return InspectedTransport(transport, timeout=timeout, feature=feature)


def group_transport(group: Any = None, feature: str | None = None) -> InspectedTransport:
    """The inspected transport for ``feature``'s collectives over process group ``group`` (None: the default group):
    the group's own where it has one (the ``fanfold`` backend's shared memory), else torch.distributed's. Made at the
    feature's first call on the group (every rank alike) and kept, so that each call does not pay for a new
    progress record and its writer thread. Timeout: ``$FANFOLD_STALL_TIMEOUT``, else the process group's own, as
    torch's collectives had."""
    pg = group if group is not None else dist.group.WORLD
    with _GROUP_LOCK:
        kept = _BY_GROUP.setdefault(pg, {})
        transport = kept.get(feature)
        if transport is None:
            timeout = None if os.environ.get(ENV_VAR) else dist.distributed_c10d._get_default_store().timeout
            inner = pg.shared_transport() if isinstance(pg, TransportOwner) else None
            transport = kept[feature] = InspectedTransport(inner or TorchTransport(group), timeout=timeout,
                                                           group=group, feature=feature)
        return transport


# The transports of group_transport, by process group: the default group's go with it; another group's transports
# hold the group, so they stay for the process (a handful: one per feature that used the group).
_BY_GROUP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_GROUP_LOCK = threading.Lock()
