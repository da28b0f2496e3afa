"""``HierarchicalTransport``: the collective interface for a group whose ranks span hosts -- shared memory inside
each host (two ``ShmTransport``s over the host's ranks), gloo across hosts (one gloo group per shard index).

An all-reduce of n elements cuts the tensor into ``S`` shards of ``ceil(n / S)`` elements, ``S`` the most ranks any
host has (``HostLayout``). Inside each host the shards are reduce-scattered through shared memory, in local-rank
order; the rank that owns shard k on each host all-reduces it with its counterparts on the other hosts over gloo
group k (the owners of shard k, one per host, by host), the groups running concurrently; the results are
all-gathered inside the host. Ranks are matched by issue order on three channels: the in-host reduce-scatters (on
the caller's thread), the cross-host gloo collectives and the in-host all-gathers (both on this transport's thread,
in call order), so that bucket i + 1's in-host reduction overlaps bucket i's trip across hosts. Design, shard layout
for uneven hosts and sum order: docs/hierarchical.md.
"""
from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .._core.job import require_initialized
from .shm.request import flat_view
from .shm.segment import host_key
from .shm.thread import ShmWork
from .shm.thread import completed as _completed
from .shm.transport import ShmTransport
from .store import StoreGroup, group_store
from .timeouts import bound, group_timeout, resolve_stall_timeout
from .transport import reduce_through_copy

__all__ = ["HierarchicalTransport", "HostLayout", "host_layout"]

_GLOO_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
             "product": dist.ReduceOp.PRODUCT}


@dataclass(frozen=True)
class HostLayout:
    """Which group ranks share a host, and who owns which shard.

    ``hosts[h]``: the group ranks of host h in local-rank order (ascending); hosts ordered by their lowest rank.
    ``shards`` = the most ranks any host has. On a host of ``L`` ranks, local rank l owns the shards k with
    ``k % L == l`` (all of them on a host of one rank); cross-host group k is shard k's owner on every host."""
    hosts: tuple[tuple[int, ...], ...]

    @property
    def shards(self) -> int:
        return max(len(h) for h in self.hosts)

    def place(self, rank: int) -> tuple[int, int]:
        """(host index, local rank) of group rank ``rank``."""
        for h, members in enumerate(self.hosts):
            if rank in members:
                return h, members.index(rank)
        raise ValueError(f"rank {rank} is on no host of {self.hosts}")

    def owned(self, rank: int) -> tuple[int, ...]:
        """The shards ``rank`` owns, ascending."""
        h, local = self.place(rank)
        return tuple(range(local, self.shards, len(self.hosts[h])))

    def cross(self, shard: int) -> tuple[int, ...]:
        """The group ranks of cross-host group ``shard``: its owner on each host, by host."""
        return tuple(members[shard % len(members)] for members in self.hosts)

    @property
    def worthwhile(self) -> bool:
        """Whether the hierarchy has anything to do: more than one host, and some host with more than one rank (with
        one rank per host, every byte crosses hosts anyway: the plain network group is the same with fewer steps)."""
        return len(self.hosts) > 1 and self.shards > 1


def host_layout(keys: Sequence[str]) -> HostLayout:
    """The layout of a group from each rank's host identity (``keys[r]``: rank r's ``host_key()``)."""
    order: dict[str, list[int]] = {}
    for r, key in enumerate(keys):
        order.setdefault(key, []).append(r)
    return HostLayout(tuple(tuple(m) for m in order.values()))


@dataclass(eq=False)
class _Step:
    """One collective in the pipeline thread's queue. ``first``: its in-host stage, issued by the caller (None:
    none); ``cross()`` issues the cross-host gloo collectives once ``first`` is done and returns their works;
    ``then()`` runs once they are done and returns the in-host work that follows (or None); ``finish()`` runs after
    that, then ``future`` yields ``value``."""
    first: Any
    cross: Callable[[], list[Any]]
    then: Callable[[], Any]
    finish: Callable[[], None] | None
    value: Any
    future: torch.futures.Future = field(default_factory=torch.futures.Future)


class HierarchicalTransport:
    """The transport interface (``protocol.Transport``) for a group spanning hosts: shared memory inside each host,
    gloo across. Collective: every rank of ``group`` (None: the default group; or a ``StoreGroup``, the ``fanfold``
    backend's) constructs it, in the same order as its other transports; the ranks exchange their host identity
    (``host_key``) through the group's store and build the same layout. ``timeout`` (seconds or timedelta; default
    ``$FANFOLD_STALL_TIMEOUT``, else 300; at most the process group's) bounds every wait for a peer, in shared memory
    and in gloo.
    Tensors: CPU, the shared-memory transport's dtypes. Call :meth:`close` when done (also run when collected)."""

    def __init__(self, group: Any = None, timeout: float | timedelta | None = None):
        own = isinstance(group, StoreGroup)
        if not own:
            require_initialized("HierarchicalTransport")
        self.group = group
        self.rank, self.world_size = (group.rank, group.world_size) if own else (dist.get_rank(group),
                                                                                 dist.get_world_size(group))
        # the stall timeout, at most the group's (as every transport's: timeouts.bound)
        self._base, self._limit = resolve_stall_timeout(timeout), group_timeout(group)
        self.timeout = bound(self._base, self._limit)
        store = group_store(group, "hierarchical", self.rank)
        store.set(f"host/{self.rank}", host_key())
        keys = [f"host/{r}" for r in range(self.world_size)]
        store.wait(keys, timedelta(seconds=self.timeout))  # bounded: a missing rank raises the store's error
        self.layout = host_layout([store.get(k).decode() for k in keys])
        h, local = self.layout.place(self.rank)
        self.host, self.local_rank = h, local
        members = self.layout.hosts[h]
        inside = StoreGroup(dist.PrefixStore(f"host{h}/", store), local, len(members), self._limit)
        # Two in-host transports, each matched by its own issue order: the reduce-scatters are issued by callers,
        # the all-gathers by this transport's thread once the cross-host step is done; one transport for both
        # would see them in an order that depends on timing, different on each rank.
        self._scatter = ShmTransport(inside, self._base)
        self._gather = ShmTransport(inside, self._base)
        # Cross-host groups built from the store by their members alone (no new_group over the whole world, which
        # a backend still under construction cannot call), ascending: every rank creates its groups in the same
        # order, so no two ranks wait for each other's rendezvous in opposite orders.
        wait = timedelta(seconds=self.timeout)
        self._cross = {k: dist.ProcessGroupGloo(dist.PrefixStore(f"cross{k}/", store), h, len(self.layout.hosts),
                                                wait)
                       for k in self.layout.owned(self.rank)}
        self._across = "across hosts (gloo group of ranks " + ", ".join(
            str(list(self.layout.cross(k))) for k in self._cross) + ")"
        self._lock = threading.Lock()  # the in-host first stage and the queue in one order
        self._steps: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True, name=f"fanfold-hierarchical-rank{self.rank}")
        self._thread.start()
        self._finalizer = weakref.finalize(self, _stop, self._steps, self._thread, self._scatter, self._gather)

    # -- the pipeline

    def _submit(self, first: Callable[[], Any] | None, cross: Callable[[], list[Any]], then: Callable[[], Any],
                finish: Callable[[], None] | None, value: Any) -> ShmWork:
        if not self._finalizer.alive:
            raise RuntimeError(f"rank {self.rank}: a collective on a closed HierarchicalTransport")
        with self._lock:
            step = _Step(first() if first is not None else None, cross, then, finish, value)
            self._steps.put(step)
        return ShmWork(step.future)

    def _serve(self) -> None:
        while True:
            step = self._steps.get()
            if step is None:
                return
            if self._error is not None:
                step.future.set_exception(RuntimeError(f"the hierarchical transport failed earlier and cannot be used: "
                                                       f"{self._error}"))
                continue
            phase = "in host"
            try:
                if step.first is not None:
                    step.first.wait()
                phase = self._across
                for work in step.cross():
                    work.wait()
                phase = "in host"
                last = step.then()
            except BaseException as exc:  # noqa: BLE001 - every failure must reach the waiting caller
                self._fail(step, phase, exc)
                continue
            if last is None:
                self._complete(step, None)
            else:
                last.get_future().add_done_callback(lambda fut, step=step: self._complete(step, fut))

    def _complete(self, step: _Step, fut: torch.futures.Future | None) -> None:
        try:
            if fut is not None:
                fut.value()
            if step.finish is not None:
                step.finish()
        except BaseException as exc:  # noqa: BLE001
            self._fail(step, "in host", exc)
            return
        step.future.set_result(step.value)

    def _fail(self, step: _Step, phase: str, exc: BaseException) -> None:
        """Fail ``step`` and every later collective, with an error naming this rank, its host and the phase; tell
        this host's other ranks at once (their in-host waits raise instead of running into the timeout)."""
        members = self.layout.hosts[self.host]
        where = (f"rank {self.rank} (host {self.host} of {len(self.layout.hosts)}, whose local ranks 0.. are ranks "
                 f"{list(members)}) failed {phase}")
        error = RuntimeError(f"fanfold hierarchical transport: {where}: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        self._error = error
        for inside in (self._scatter, self._gather):
            inside.abort(f"{where}: {type(exc).__name__}: {exc}")
        step.future.set_exception(error)

    # -- shard geometry

    def _slots(self) -> tuple[int, list[int]]:
        """(slots per rank m, the shards of this rank's slots: shard index, or -1 for padding)."""
        size = len(self.layout.hosts[self.host])
        m = -(-self.layout.shards // size)
        return m, [k if k < self.layout.shards else -1 for k in range(self.local_rank, m * size, size)]

    # -- the Transport protocol

    def all_reduce(self, tensor: torch.Tensor, bucket: int | None = None, divisor: float | None = None, *,
                   op: str = "sum") -> ShmWork:
        """Reduce ``tensor`` over the group in place, asynchronously: in-host reduce-scatter (local-rank order),
        cross-host all-reduce of each shard (gloo), in-host all-gather; then divided by ``divisor``. ``op``: "sum",
        "min", "max" or "product" (no divisor). Every rank gets the same bits."""
        if divisor is not None and not (isinstance(divisor, (int, float)) and divisor > 0):
            raise ValueError(f"all_reduce: divisor must be a positive number, got {divisor!r}")
        if op not in _GLOO_OPS or (divisor is not None and op != "sum"):
            raise ValueError(f"all_reduce: op must be one of {sorted(_GLOO_OPS)} (a divisor with 'sum' only), "
                             f"got op={op!r}, divisor={divisor!r}")
        flat, back = flat_view(tensor, "all_reduce")
        n = flat.numel()
        if n == 0:
            return _completed(tensor)
        shards, size = self.layout.shards, len(self.layout.hosts[self.host])
        c = -(-n // shards)
        m, slots = self._slots()
        if size == shards and n == shards * c:
            stage, scatter_in = flat, flat  # the tensor is the layout: no copy in or out
        else:
            stage = torch.zeros(size * m * c, dtype=flat.dtype)
            for r in range(size):
                for j, k in enumerate(range(r, m * size, size)):
                    if k < shards and k * c < n:
                        piece = flat[k * c:(k + 1) * c]
                        stage[(r * m + j) * c:][:piece.numel()].copy_(piece)
            scatter_in = stage
        part = torch.empty(m * c, dtype=flat.dtype)
        gloo_op = _GLOO_OPS[op]

        def cross() -> list[Any]:
            works = []
            for j, k in enumerate(slots):
                if k >= 0:
                    opts = dist.AllreduceOptions()
                    opts.reduceOp = gloo_op
                    works.append(self._cross[k].allreduce([part[j * c:(j + 1) * c]], opts))
            return works

        def then() -> Any:
            if divisor is not None:
                part.div_(divisor)
            return self._gather.all_gather(part, stage, bucket)

        def finish() -> None:
            if stage is not flat:
                for k in range(shards):
                    if k * c < n:
                        r, j = k % size, k // size
                        piece = flat[k * c:(k + 1) * c]
                        piece.copy_(stage[(r * m + j) * c:][:piece.numel()])
            if back is not None:
                back()

        return self._submit(lambda: self._scatter.reduce_scatter(scatter_in, part, bucket, op=op), cross, then,
                            finish, tensor)

    def reduce_tensors(self, tensors: Sequence[torch.Tensor], bucket: int | None = None, *,
                       divisor: float | None = None, settle: bool = True,
                       compress: torch.dtype | None = None) -> Any:
        """``tensors`` all-reduced in place through one flat copy, as ``TorchTransport`` does (``settle``: nothing to
        settle, the copy is private; ``compress``: torch's compression hooks' steps)."""
        return reduce_through_copy(self, tensors, bucket, divisor, compress)

    def reduce_scatter(self, tensor: torch.Tensor, out: torch.Tensor, bucket: int | None = None, *,
                       divisor: float | None = None, op: str = "sum") -> ShmWork:
        """This rank's part (rank r: elements r * n .. (r + 1) * n, n = ``out``'s elements) of the reduction of
        ``tensor`` over the group, into ``out``: the hierarchical all-reduce of a copy, then the part (the bytes
        across hosts of an all-reduce; ``tensor`` is left as it was)."""
        n = out.numel()
        if tensor.numel() != n * self.world_size:
            raise ValueError(f"reduce_scatter: tensor must have world_size ({self.world_size}) x out's {n} elements, "
                             f"got {tensor.numel()}")
        whole = tensor.reshape(-1).clone()
        work = self.all_reduce(whole, bucket, divisor, op=op)
        mine = whole[self.rank * n:(self.rank + 1) * n]
        return ShmWork(work.get_future().then(lambda _: out.copy_(mine.view_as(out))))

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor, bucket: int | None = None) -> ShmWork:
        """Every rank's ``tensor`` into ``out`` by rank, asynchronously: across hosts first (gloo group k gathers
        local rank k's tensor of every host; a host with fewer ranks sends zeros there), then inside the host."""
        # read by the cross-host step only, before finish() writes out: out may overlap it (an in-place gather)
        flat, _ = flat_view(tensor, "all_gather")
        n, hosts = flat.numel(), len(self.layout.hosts)
        out_flat, back = flat_view(out, "all_gather (out)")
        if out_flat.numel() != n * self.world_size or out_flat.dtype != flat.dtype:
            raise ValueError(f"all_gather: out must hold world_size ({self.world_size}) x {n} elements of "
                             f"{flat.dtype}, got {out.numel()} of {out.dtype}")
        if n == 0:
            return _completed(out)
        size = len(self.layout.hosts[self.host])
        m, slots = self._slots()
        part = torch.zeros(m * hosts * n, dtype=flat.dtype)
        whole = torch.empty(size * m * hosts * n, dtype=flat.dtype)

        def cross() -> list[Any]:
            works = []
            for j, k in enumerate(slots):
                if k >= 0:
                    send = flat if k == self.local_rank else torch.zeros_like(flat)
                    recv = list(part[j * hosts * n:(j + 1) * hosts * n].view(hosts, n).unbind())
                    works.append(self._cross[k].allgather([recv], [send]))
            return works

        def finish() -> None:
            for h, members in enumerate(self.layout.hosts):
                for k, g in enumerate(members):
                    r, j = k % size, k // size
                    out_flat[g * n:(g + 1) * n].copy_(whole[((r * m + j) * hosts + h) * n:][:n])
            if back is not None:
                back()

        return self._submit(None, cross, lambda: self._gather.all_gather(part, whole, bucket), finish, out)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Rank ``src``'s ``tensor`` into every rank's, in place, synchronously: across hosts on the gloo group of
        ``src``'s local rank, then inside each host from that group's member."""
        if not isinstance(src, int) or not 0 <= src < self.world_size:
            raise ValueError(f"broadcast: src must be a rank of the group (0..{self.world_size - 1}), got {src!r}")
        flat, back = flat_view(tensor, "broadcast")
        h, k = self.layout.place(src)
        size = len(self.layout.hosts[self.host])

        def cross() -> list[Any]:
            if k not in self._cross:
                return []
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = h, 0
            return [self._cross[k].broadcast([flat], opts)]

        def then() -> None:
            self._gather.broadcast(flat, k % size)

        self._submit(None, cross, then, back, tensor).wait()

    def barrier(self) -> None:
        """Return once every rank has reached it: in-host barrier, a gloo barrier of the hosts' first ranks, in-host
        barrier (each after the collectives issued before it on its channel)."""
        def cross() -> list[Any]:
            return [self._cross[0].barrier(dist.BarrierOptions())] if self.local_rank == 0 else []

        self._submit(self._scatter.barrier, cross, self._gather.barrier, None, None).wait()

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=device)

    def close(self) -> None:
        """Finish the queued collectives, stop the thread, close the in-host transports. Idempotent."""
        self._finalizer()

    def __repr__(self) -> str:
        return (f"HierarchicalTransport(rank={self.rank}, world_size={self.world_size}, "
                f"hosts={[len(m) for m in self.layout.hosts]}, host={self.host}, local_rank={self.local_rank})")


def _stop(steps: queue.SimpleQueue, thread: threading.Thread, scatter: ShmTransport, gather: ShmTransport) -> None:
    if thread.is_alive():
        steps.put(None)
        thread.join(5.0)
    scatter.close()
    gather.close()
