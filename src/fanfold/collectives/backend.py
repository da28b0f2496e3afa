"""The ``fanfold`` torch.distributed backend: ``init_process_group("fanfold")`` (or ``"cpu:fanfold"``) runs torch's
own collectives -- and so torch's DDP, ZeroRedundancyOptimizer and FSDP2 -- with fanfold's shared memory where the
ranks share a host.

Layer: collectives (above ``shm/``). :class:`FanfoldProcessGroup` is a ``dist.ProcessGroup`` written in Python:
torch calls its ``allreduce``, ``allreduce_coalesced``, ``broadcast`` and ``barrier``; each takes the shared-memory
transport (``shm.ShmTransport``) when the tensors allow it, else the inner gloo backend built on the same store.
Every other collective (all_gather, reduce_scatter, all_to_all, send/recv, gather, scatter, reduce) goes straight
to that gloo backend, registered as the group's CPU backend, so no call fails for the choice of backend.

Which path a collective takes depends only on what is the same on every rank (the op, the dtype, the device, the
number of tensors), never on a rank's own state, so every rank takes the same path. The transport is created at
the group's first fast collective (a collective itself), after checking through the store that all ranks share
this host; ``$FANFOLD_TRANSPORT=torch`` turns the shared memory off (everything goes through gloo).
"""
from __future__ import annotations

import json
import os
import platform
import threading
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .select import ENV_VAR
from .shm.engine import DTYPES
from .shm.host import host_key
from .shm.transport import ShmTransport
from .store import StoreGroup
from .work import FanfoldWork, completed_work

__all__ = ["FanfoldProcessGroup", "register", "BACKEND"]

BACKEND = "fanfold"
_FAST_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg"}


def _op_name(op: Any) -> str | None:
    """"sum" or "avg" for the reductions the shared memory computes (fixed rank order, bitwise equal on every rank);
    None for the rest (MIN, MAX, PRODUCT, bitwise ops, PREMUL_SUM: gloo's)."""
    for fast, name in _FAST_OPS.items():
        if op == fast:
            return name
    return None


def _supported(tensors: list[torch.Tensor], op: str | None = "sum") -> bool:
    """Whether shared memory takes ``tensors``: CPU, one supported dtype; averages of floating point only."""
    if not tensors or op is None:
        return False
    dtype = tensors[0].dtype
    return all(t.device.type == "cpu" and t.dtype == dtype and not t.is_sparse for t in tensors) and (
        dtype in DTYPES and (op == "sum" or dtype.is_floating_point))


class FanfoldProcessGroup(dist.ProcessGroup):
    """The process group behind ``init_process_group("fanfold")`` and ``new_group(backend="fanfold")``.

    ``store``, ``rank``, ``world_size`` and ``timeout`` are torch's (the creator's arguments). :attr:`gloo` is the
    inner gloo backend, :attr:`transport` the shared-memory transport once created (None before the first fast
    collective, or where the ranks do not share a host): fanfold's own DDP can take it from the group."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout: timedelta):
        super().__init__(rank, world_size)
        self._store, self._timeout = store, timeout
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, world_size, timeout)
        # The C++ side sends every collective without a Python override here (and CUDA tensors: gloo's).
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self.gloo)
        if torch.cuda.is_available():
            self._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.GLOO, self.gloo)
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        self._shm: ShmTransport | None = None
        self._decided = False
        self._lock = threading.Lock()

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    @property
    def transport(self) -> ShmTransport | None:
        return self._shm

    def _fast(self) -> ShmTransport | None:
        """The shared-memory transport, created at the first call (collective: every rank makes the same first
        fast collective); None where the ranks do not all share this host, or it is turned off."""
        with self._lock:
            if not self._decided:
                self._decided = True
                self._shm = self._create()
            return self._shm

    def _create(self) -> ShmTransport | None:
        rank, size = self.rank(), self.size()
        if size == 1:
            return None
        store = dist.PrefixStore("fanfold/backend/", self._store)
        choice = os.environ.get(ENV_VAR) or None
        local = platform.machine().lower() in ("x86_64", "amd64")  # the segment relies on x86's store order
        store.set(str(rank), json.dumps([choice, host_key(), local]))
        store.wait([str(r) for r in range(size)], self._timeout)
        views = [json.loads(store.get(str(r))) for r in range(size)]
        choices = {v[0] for v in views}
        if len(choices) > 1:
            raise ValueError(f"ranks set different ${ENV_VAR} (by rank): {[v[0] for v in views]}")
        if choice == "torch":
            return None
        reason = ("the ranks run on different hosts" if len({v[1] for v in views}) > 1 else
                  "the shared-memory transport needs x86-64" if not all(v[2] for v in views) else None)
        if reason is not None:
            if choice == "shm":
                raise RuntimeError(f"rank {rank}: ${ENV_VAR}=shm, but {reason}")
            warnings.warn(f"fanfold backend (rank {rank}): every collective goes through gloo: {reason}",
                          stacklevel=3)
            return None
        return ShmTransport(StoreGroup(store, rank, size), self._timeout)

    # The collectives torch calls from Python; each falls back to gloo with the same arguments.

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.AllreduceOptions()
        op = _op_name(opts.reduceOp)
        shm = self._fast() if len(tensors) == 1 and _supported(tensors, op) else None
        if shm is None:
            return self.gloo.allreduce(tensors, opts)
        divisor = self.size() if op == "avg" else None
        # detach: collectives write a tensor's data whatever autograd thinks of it (a Parameter), as gloo does
        return FanfoldWork(shm.all_reduce(tensors[0].detach(), divisor=divisor).get_future(), tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        op = _op_name(opts.reduceOp)
        shm = self._fast() if _supported(tensors, op) else None
        if shm is None:
            return self.gloo.allreduce_coalesced(tensors, opts)
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        divisor = self.size() if op == "avg" else None

        def unpack() -> None:
            offset = 0
            for t in tensors:
                t.detach().copy_(flat[offset: offset + t.numel()].view_as(t))
                offset += t.numel()
        return FanfoldWork(shm.all_reduce(flat, divisor=divisor).get_future(), tensors, unpack)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.BroadcastOptions()
        shm = self._fast() if len(tensors) == 1 and opts.rootTensor == 0 and _supported(tensors) else None
        if shm is None:
            return self.gloo.broadcast(tensors, opts)
        shm.broadcast(tensors[0].detach(), opts.rootRank)  # returns once done: broadcasts are rare and small
        return completed_work(tensors)

    def barrier(self, opts: Any = None) -> dist.Work:
        shm = self._fast()
        if shm is not None:
            shm.barrier()  # every rank has finished its queued shared-memory collectives
        # then gloo's, behind the delegated collectives queued before it
        return self.gloo.barrier(opts if opts is not None else dist.BarrierOptions())

    def shutdown(self) -> None:
        """Close the transport (its queued collectives finish first), then torch's own shutdown (gloo's)."""
        if self._shm is not None:
            self._shm.close()
        super().shutdown()

    def abort(self) -> None:
        if self._shm is not None:
            self._shm.close()
        super().abort()

    def __repr__(self) -> str:
        return f"FanfoldProcessGroup(rank={self.rank()}, size={self.size()}, shm={self._shm is not None})"


def _create_group(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> FanfoldProcessGroup:
    return FanfoldProcessGroup(store, rank, world_size, timeout)


def register() -> None:
    """Register the ``fanfold`` backend with torch.distributed for CPU tensors (done by ``import fanfold``;
    idempotent)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create_group, devices=["cpu"])
