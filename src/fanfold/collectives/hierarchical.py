"""``HierarchicalTransport``: the collective interface for a group whose ranks span hosts: shared memory inside
each host, gloo across hosts (one gloo group per shard index), pipelined piece by piece. Design, shard layout for
uneven hosts and sum order: docs/hierarchical.md.
"""
from __future__ import annotations

import collections
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
from .protocol import FanfoldWork, completed_work
from .shm.engine import reduce_code
from .shm.segment import host_key
from .shm.transport import ShmTransport, check_reduce_tensors, flat_view, split_into
from .timeouts import StoreGroup, bound, group_store, group_timeout, resolve_stall_timeout
from .transport import reduce_through_copy, scatter_through_copy

__all__ = ["HierarchicalTransport", "HostLayout", "host_layout"]

_GLOO_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
             "product": dist.ReduceOp.PRODUCT}
_COMBINE = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum, "product": torch.mul}
# The pipelining unit of all_reduce: small enough that the in-host stages of the first and last pieces (all that is
# not hidden behind the link) are short, large enough that each gloo all-reduce keeps the link busy
PIECE_BYTES = 4 << 20
WINDOW = 2  # pieces crossing hosts at once: the next one is queued in gloo before the current one ends


@dataclass(frozen=True)
class HostLayout:
    """``hosts[h]``: the group ranks of host h, ascending; hosts ordered by their lowest rank. On a host of ``L``
    ranks, local rank l owns the shards k with ``k % L == l``; cross-host group k is shard k's owner on every host."""
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
        # with one rank per host every byte crosses hosts anyway: the plain network group does it in fewer steps
        return len(self.hosts) > 1 and self.shards > 1


def host_layout(keys: Sequence[str]) -> HostLayout:
    """The layout of a group from each rank's host identity (``keys[r]``: rank r's ``host_key()``)."""
    order: dict[str, list[int]] = {}
    for r, key in enumerate(keys):
        order.setdefault(key, []).append(r)
    return HostLayout(tuple(tuple(m) for m in order.values()))


@dataclass(eq=False)
class _Step:
    """A queued step: ``first`` (the caller's in-host work, or None), then ``cross()``, ``then()``, ``finish()``."""
    first: Any
    cross: Callable[[], list[Any]]
    then: Callable[[], Any]
    finish: Callable[[], None] | None
    future: torch.futures.Future = field(default_factory=torch.futures.Future)


class HierarchicalTransport:
    """The Transport for a group spanning hosts. Every rank of ``group`` (None: the default group; or the
    ``fanfold`` backend's ``StoreGroup``) constructs it; ``timeout`` (seconds or timedelta; default
    ``$FANFOLD_STALL_TIMEOUT``, else 300; at most the group's) bounds every wait for a peer. CPU tensors."""

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
        self.host, self.local_rank = self.layout.place(self.rank)
        size = len(self.layout.hosts[self.host])
        inside = StoreGroup(dist.PrefixStore(f"host{self.host}/", store), self.local_rank, size, self._limit)
        # Two in-host transports, each matched by its own issue order (reduce-scatters issued by callers, all-gathers
        # by this transport's thread): one for both would see them in an order that differs from rank to rank.
        self._scatter = ShmTransport(inside, self._base)
        self._gather = ShmTransport(inside, self._base)
        # Cross-host groups built from the store by their members alone (a backend still under construction cannot
        # call new_group), ascending on every rank: no two ranks wait for each other's rendezvous in opposite orders.
        wait, hosts = timedelta(seconds=self.timeout), len(self.layout.hosts)
        self._cross = {k: dist.ProcessGroupGloo(dist.PrefixStore(f"cross{k}/", store), self.host, hosts, wait)
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
                finish: Callable[[], None] | None) -> torch.futures.Future:
        if not self._finalizer.alive:
            raise RuntimeError(f"rank {self.rank}: a collective on a closed HierarchicalTransport")
        with self._lock:
            self._steps.put(step := _Step(first() if first is not None else None, cross, then, finish))
        return step.future

    def _serve(self) -> None:
        """Issue each step's cross-host collectives once its in-host stage is done, up to ``WINDOW`` at once; land the
        oldest when the window is full or the queue is empty. Both in step order: every rank issues the same."""
        flight: collections.deque = collections.deque()
        while True:
            try:
                step = self._steps.get(block=not flight)
            except queue.Empty:
                self._land(*flight.popleft())
                continue
            if step is None:
                while flight:
                    self._land(*flight.popleft())
                return
            if self._error is not None:
                self._refuse(step)
                continue
            phase = "in host"
            try:
                if step.first is not None:
                    step.first.wait()
                phase = self._across
                flight.append((step, step.cross()))
            except BaseException as exc:  # noqa: BLE001 - every failure must reach the waiting caller
                self._fail(step, phase, exc)
                continue
            if len(flight) > WINDOW:
                self._land(*flight.popleft())

    def _land(self, step: _Step, works: list[Any]) -> None:
        if self._error is not None:
            self._refuse(step)
            return
        phase = self._across
        try:
            for work in works:
                work.wait()
            phase = "in host"
            last = step.then()
        except BaseException as exc:  # noqa: BLE001
            self._fail(step, phase, exc)
            return
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
        step.future.set_result(None)

    def _refuse(self, step: _Step) -> None:
        step.future.set_exception(RuntimeError(f"the hierarchical transport failed earlier: {self._error}"))

    def _fail(self, step: _Step, phase: str, exc: BaseException) -> None:
        """Fail ``step`` and every later collective, naming this rank, its host and the phase; abort the in-host
        transports, so that this host's other ranks raise at once instead of at their timeout."""
        members = self.layout.hosts[self.host]
        where = (f"rank {self.rank} (host {self.host} of {len(self.layout.hosts)}, whose local ranks 0.. are ranks "
                 f"{list(members)}) failed {phase}")
        error = RuntimeError(f"fanfold hierarchical transport: {where}: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        self._error = self._error or error
        for inside in (self._scatter, self._gather):
            inside.abort(f"{where}: {type(exc).__name__}: {exc}")
        step.future.set_exception(error)

    # -- shard geometry

    def _slots(self) -> tuple[int, list[int]]:
        """(slots per rank m, the shards of this rank's slots: shard index, or -1 for padding)."""
        size = len(self.layout.hosts[self.host])
        m = -(-self.layout.shards // size)
        return m, [k if k < self.layout.shards else -1 for k in range(self.local_rank, m * size, size)]

    def _host_stage(self, pieces: list[torch.Tensor], part: torch.Tensor, bucket: int | None,
                    op: str) -> Callable[[], Any]:
        """The in-host reduce-scatter of ``pieces`` end to end into each rank's ``part``."""
        if op == "sum":
            return lambda: self._scatter.reduce_scatter_tensors(pieces, part, bucket)
        return lambda: self._scatter.reduce_scatter(torch.cat(pieces), part, bucket, op=op)

    # -- the Transport protocol

    def all_reduce(self, tensor: torch.Tensor, bucket: int | None = None, divisor: float | None = None, *,
                   op: str = "sum") -> FanfoldWork:
        """Reduce ``tensor`` in place, asynchronously: in-host reduce-scatter, cross-host all-reduce of each shard,
        in-host all-gather; then divided by ``divisor`` ("sum" only). Every rank gets the same bits."""
        reduce_code(op, divisor, "all_reduce")
        flat, back = flat_view(tensor, "all_reduce")
        return self._reduce([flat], bucket, divisor, op, tensor, back)

    def reduce_tensors(self, tensors: Sequence[torch.Tensor], bucket: int | None = None, *,
                       divisor: float | None = None, settle: bool = True,
                       compress: torch.dtype | None = None) -> Any:
        """``tensors`` (laid end to end) all-reduced in place, as :meth:`all_reduce` (``settle``: always settled).
        ``compress``: through one flat copy, as ``TorchTransport`` does."""
        reduce_code("sum", divisor, "reduce_tensors")
        if compress is not None:
            return reduce_through_copy(self, tensors, bucket, divisor, compress)
        tensors = check_reduce_tensors(list(tensors), None)
        return self._reduce([t.view(-1) for t in tensors], bucket, divisor, "sum", tensors, None)

    def _reduce(self, flats: list[torch.Tensor], bucket: int | None, divisor: float | None, op: str, value: Any,
                back: Callable[[], None] | None) -> FanfoldWork:
        """One step per piece of ``PIECE_BYTES``: piece i + 1's in-host stages run while piece i crosses hosts."""
        total = sum(f.numel() for f in flats)
        if total == 0:
            return completed_work(value)
        step = max(1, PIECE_BYTES // flats[0].element_size())
        futures = [self._piece(_span(flats, a, min(a + step, total)), bucket, divisor, op)
                   for a in range(0, total, step)]

        def done(fut: torch.futures.Future) -> Any:
            for f in fut.value():
                f.value()  # the first piece's error, if any
            return back() if back is not None else None

        return FanfoldWork(torch.futures.collect_all(futures).then(done), value)

    def _piece(self, views: list[torch.Tensor], bucket: int | None, divisor: float | None,
               op: str) -> torch.futures.Future:
        """``views`` (m elements end to end) cut into shards of ``ceil(m / shards)`` elements, laid out slot by
        owner (zeros pad short and absent shards)."""
        m, dtype = sum(v.numel() for v in views), views[0].dtype
        shards, size = self.layout.shards, len(self.layout.hosts[self.host])
        c = -(-m // shards)
        slots_per_rank, slots = self._slots()
        order = [r + j * size for r in range(size) for j in range(slots_per_rank)]  # the shard of each slot
        pieces, places = [], []  # the reduce-scatter's input; (slot, the views of its shard) for the copy back
        for s, k in enumerate(order):
            got = _span(views, k * c, min((k + 1) * c, m)) if k < shards else []
            short = c - sum(g.numel() for g in got)
            pieces += got + ([torch.zeros(short, dtype=dtype)] if short else [])
            places.append((s, got))
        part = torch.empty(slots_per_rank * c, dtype=dtype)
        # the one tensor in shard order already (equal hosts, n a multiple of the shards): gathered into it directly
        whole = views[0] if len(views) == 1 and size == shards and m == shards * c else \
            torch.empty(len(order) * c, dtype=dtype)

        def cross() -> list[Any]:
            opts = dist.AllreduceOptions()
            opts.reduceOp = _GLOO_OPS[op]
            return [self._cross[k].allreduce([part[j * c:(j + 1) * c]], opts) for j, k in enumerate(slots) if k >= 0]

        def then() -> Any:
            if divisor is not None:
                part.div_(divisor)
            return self._gather.all_gather(part, whole, bucket)

        def finish() -> None:
            for s, got in places if whole is not views[0] else ():
                split_into(whole[s * c:(s + 1) * c], got)

        return self._submit(self._host_stage(pieces, part, bucket, op), cross, then, finish)

    def reduce_scatter(self, tensor: torch.Tensor, out: torch.Tensor, bucket: int | None = None, *,
                       divisor: float | None = None, op: str = "sum") -> FanfoldWork:
        """Rank r's part (elements r * n .. (r + 1) * n, n = ``out``'s elements) of the reduction into ``out``:
        in-host reduce-scatter, an all_to_all on each cross group, each host's sums combined in host order."""
        n, hosts = out.numel(), self.layout.hosts
        if tensor.numel() != n * self.world_size:
            raise ValueError(f"reduce_scatter: tensor must have world_size ({self.world_size}) x out's {n} elements, "
                             f"got {tensor.numel()}")
        reduce_code(op, divisor, "reduce_scatter")
        flat, _ = flat_view(tensor, "reduce_scatter")
        out_flat, back = flat_view(out, "reduce_scatter (out)")
        if n == 0:
            return completed_work(out)
        size, H = len(hosts[self.host]), len(hosts)
        slots_per_rank, slots = self._slots()
        pieces = []
        for k in (r + j * size for r in range(size) for j in range(slots_per_rank)):
            for members in hosts:  # shard k, host by host: the part of that host's local rank k (zeros: none)
                g = members[k] if k < len(members) else None
                pieces.append(torch.zeros(n, dtype=flat.dtype) if g is None else flat[g * n:(g + 1) * n])
        part = torch.empty(slots_per_rank * H * n, dtype=flat.dtype)
        got = torch.empty_like(part)

        def cross() -> list[Any]:
            w = H * n
            return [self._cross[k].alltoall_base(got[j * w:(j + 1) * w], part[j * w:(j + 1) * w], [], [])
                    for j, k in enumerate(slots) if k >= 0]

        def then() -> None:
            # slot 0 holds shard local_rank: this rank's part, one host's sum per row, combined in host order
            rows = got[:H * n].view(H, n)
            out_flat.copy_(rows[0])
            for h in range(1, H):
                _COMBINE[op](out_flat, rows[h], out=out_flat)
            if divisor is not None:
                out_flat.div_(divisor)

        return FanfoldWork(self._submit(self._host_stage(pieces, part, bucket, op), cross, then, back), out)

    def reduce_scatter_tensors(self, tensors: Sequence[torch.Tensor], out: torch.Tensor, bucket: int | None = None,
                               *, divisor: float | None = None, settle: bool = True,
                               compress: torch.dtype | None = None) -> FanfoldWork:
        """The protocol's, through one flat copy (``settle``: always settled)."""
        return scatter_through_copy(self, check_reduce_tensors(list(tensors), compress, "reduce_scatter_tensors"),
                                    out, bucket, divisor, compress)

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor, bucket: int | None = None) -> FanfoldWork:
        """Every rank's ``tensor`` into ``out`` by rank: across hosts first (a host with fewer ranks sends zeros for
        the local ranks it lacks), then inside the host."""
        # read by the cross-host step only, before finish() writes out: out may overlap it (an in-place gather)
        flat, _ = flat_view(tensor, "all_gather")
        n, hosts = flat.numel(), len(self.layout.hosts)
        out_flat, back = flat_view(out, "all_gather (out)")
        if out_flat.numel() != n * self.world_size or out_flat.dtype != flat.dtype:
            raise ValueError(f"all_gather: out must hold world_size ({self.world_size}) x {n} elements of "
                             f"{flat.dtype}, got {out.numel()} of {out.dtype}")
        if n == 0:
            return completed_work(out)
        size = len(self.layout.hosts[self.host])
        m, slots = self._slots()
        part = torch.zeros(m * hosts * n, dtype=flat.dtype)
        whole = torch.empty(size * m * hosts * n, dtype=flat.dtype)

        def cross() -> list[Any]:
            w = hosts * n
            return [self._cross[k].allgather([list(part[j * w:(j + 1) * w].view(hosts, n).unbind())],
                                             [flat if k == self.local_rank else torch.zeros_like(flat)])
                    for j, k in enumerate(slots) if k >= 0]

        def finish() -> None:
            for h, members in enumerate(self.layout.hosts):
                for k, g in enumerate(members):
                    r, j = k % size, k // size
                    out_flat[g * n:(g + 1) * n].copy_(whole[((r * m + j) * hosts + h) * n:][:n])
            if back is not None:
                back()

        return FanfoldWork(self._submit(None, cross, lambda: self._gather.all_gather(part, whole, bucket), finish), out)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Rank ``src``'s ``tensor`` into every rank's, synchronously: across hosts, then inside each host."""
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

        self._submit(None, cross, then, back).wait()

    def barrier(self) -> None:
        """In-host barrier, a gloo barrier of the hosts' first ranks, in-host barrier."""
        def cross() -> list[Any]:
            return [self._cross[0].barrier(dist.BarrierOptions())] if self.local_rank == 0 else []

        self._submit(self._scatter.barrier, cross, self._gather.barrier, None).wait()

    def close(self) -> None:
        """Finish the queued collectives, stop the thread, close the in-host transports. Idempotent."""
        self._finalizer()

    def __repr__(self) -> str:
        return (f"HierarchicalTransport(rank={self.rank}, world_size={self.world_size}, "
                f"hosts={[len(m) for m in self.layout.hosts]}, host={self.host}, local_rank={self.local_rank})")


def _span(flats: list[torch.Tensor], lo: int, hi: int) -> list[torch.Tensor]:
    out, start = [], 0
    for f in flats:
        end = start + f.numel()
        if end > lo and start < hi:
            out.append(f[max(lo - start, 0):min(hi, end) - start])
        start = end
    return out


def _stop(steps: queue.SimpleQueue, thread: threading.Thread, scatter: ShmTransport, gather: ShmTransport) -> None:
    if thread.is_alive():
        steps.put(None)
        thread.join(5.0)
    scatter.close()
    gather.close()
