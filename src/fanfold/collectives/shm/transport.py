"""``ShmTransport``: collectives through one shared-memory segment for ranks that share a host (the choice between it
and torch's collectives is ``collectives/select.py``).

Layer: the collective interface (``collectives/protocol.py``), used by the reducer and DDP; below it ``engine.py``
(the algorithms) and ``segment.py`` (the memory and the bounded waits). Process groups, rendezvous and launching
stay torch.distributed's: only the segment's name and each rank's host identity travel, through the group's store.

all_reduce goes chunk by chunk (``chunk_bytes``, 1 MiB) through a ring of shared areas: every rank copies its chunk
into its slot, then either every rank sums all slots into its own tensor (up to 3 ranks: one synchronisation a
chunk, fewest bytes moved), or rank r sums shard r into a result area that every rank then copies out
(reduce-scatter + all-gather, more ranks). Either way each element is summed in rank order 0..N-1 with the same
float32 operations, so every rank gets the same bits, run after run; bf16/fp16 are summed in float32 and rounded
once. A tensor in memory from :meth:`ShmTransport.allocate` (every rank maps every rank's copy) skips the ring:
each rank sums its shard of each chunk from all copies into its own, in the same rank order, and copies the other
shards from the peers' copies -- no copy in, half the memory traffic. Private tensors (a plain all_reduce above a
quarter chunk, :meth:`ShmTransport.reduce_tensors`: DDP's gradients) skip the copy too where every rank may read its
peers' memory (``process_vm_readv``, probed at start-up: ``peer_read``; ``peer.py``), else ``reduce_tensors``
copies into memory from allocate() kept per bucket label. Requests run in FIFO order on one background thread per
transport, so a reducer keeps several buckets in flight while backward runs; every wait for a peer is bounded.
"""
from __future__ import annotations

import os
import queue
import threading
import warnings
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..._core.group import require_initialized
from ..store import StoreGroup, group_store
from ..timeouts import ENV_VAR as STALL_ENV_VAR
from ..timeouts import resolve_stall_timeout
from .engine import ALL_REDUCE, BARRIER, BROADCAST, DTYPES, OPS, REDUCE_INTO, REDUCE_TENSORS, SHARED_ALL_REDUCE, Engine
from .peer import TABLE_BYTES, probe
from .segment import Segment, ShmTimeoutError, pid_namespace
from .thread import ShmWork
from .thread import completed as _completed
from .thread import serve as _serve
from .thread import stop as _stop

__all__ = ["ShmTransport", "ShmWork", "ShmTimeoutError"]


def _flat(tensor: torch.Tensor, what: str) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """A contiguous 1-d view of ``tensor`` in a supported dtype, and the copy back when it had to be a copy."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} needs a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"the shm transport works on CPU tensors; {what} got one on {tensor.device}")
    t = torch.view_as_real(tensor) if tensor.is_complex() else tensor
    if t.dtype not in DTYPES:
        raise TypeError(f"{what}: dtype {tensor.dtype} is not supported by the shm transport ({DTYPES})")
    if t.is_contiguous():
        return t.view(-1), None
    flat = t.contiguous().view(-1)
    return flat, lambda: t.copy_(flat.view_as(t))


def _split_into(flat: torch.Tensor, outs: list[torch.Tensor]) -> None:
    offset = 0
    for out in outs:
        out.copy_(flat[offset: offset + out.numel()])
        offset += out.numel()


class ShmTransport:
    """The transport interface (``protocol.Transport``) through shared memory, for ranks sharing this host's /dev/shm.
    Collective: every rank of ``group`` (None: the default group) constructs it, in the same order as its other
    transports. ``timeout`` (seconds or timedelta; default ``$FANFOLD_STALL_TIMEOUT``, else the process group's
    timeout) bounds every wait for a peer; a peer that never arrives, dies or fails makes the waiting rank raise
    :class:`ShmTimeoutError` naming both ranks and the collective. ``chunk_bytes`` is the pipelining unit;
    ``direct_bytes`` (default: a whole chunk up to 3 ranks, else 64 KiB) the largest chunk that every rank sums
    whole instead of by shards; ``peer_read`` (None: where the probe allows) whether ranks read their peers' memory.
    Call :meth:`close` when done (also run when the object is collected)."""

    def __init__(self, group: Any = None, timeout: float | timedelta | None = None, *, chunk_bytes: int = 1 << 20,
                 direct_bytes: int | None = None, peer_read: bool | None = None):
        own = isinstance(group, StoreGroup)  # a group under construction (the fanfold backend's)
        if not own:
            require_initialized("ShmTransport")
        if chunk_bytes < 4096 or chunk_bytes % 4096:
            raise ValueError(f"chunk_bytes must be a positive multiple of 4096, got {chunk_bytes!r}")
        self.group = group
        self.rank, self.world_size = (group.rank, group.world_size) if own else (dist.get_rank(group),
                                                                                 dist.get_world_size(group))
        if timeout is None and not os.environ.get(STALL_ENV_VAR):  # the process group's own timeout
            timeout = (group.store if own else dist.distributed_c10d._get_default_store()).timeout
        self.timeout = resolve_stall_timeout(timeout)
        self._seq, self._lock, self._chunk_bytes = 0, threading.Lock(), chunk_bytes
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = self._segment = None
        self.peer_read = False  # reduce_tensors reads the peers' memory (probed below)
        self._stages: dict[tuple, torch.Tensor] = {}  # without peer reads: reduce_tensors' copies, by bucket label
        self._regions: list[tuple[int, int, list[torch.Tensor], Segment]] = []  # from allocate(), see _shared
        if self.world_size > 1:
            store = group_store(group, "shm", self.rank)
            store.set(f"pidns/{self.rank}", pid_namespace())
            areas = 8 if self.world_size <= 3 else 4
            ring = areas * (self.world_size + 1) * chunk_bytes
            self._segment = Segment(store, self.rank, self.world_size, ring + self.world_size * TABLE_BYTES,
                                    self.timeout, check_pids=False)
            # Collective whatever this rank's peer_read: every rank takes the probe's steps.
            self.peer_read, why = probe(self._segment, self.rank, self.world_size, peer_read is not False)
            if peer_read is None and not self.peer_read:
                warnings.warn(f"rank {self.rank}: fanfold's shm transport copies private tensors into shared memory "
                              f"(the slower path): {why}", stacklevel=2)
            if peer_read and not self.peer_read:
                self._segment.close()
                raise RuntimeError(f"rank {self.rank}: ShmTransport(peer_read=True), but some rank of the group "
                                   "may not read its peers' memory (process_vm_readv: ptrace rights, seccomp)")
            # Liveness checks by pid only make sense when every rank sees the same pids.
            spaces = {store.get(f"pidns/{r}") for r in range(self.world_size)}
            self._segment.check_pids = len(spaces) == 1 and b"" not in spaces
            if direct_bytes is None:  # up to 3 ranks, summing everything on every rank moves fewer bytes
                direct_bytes = chunk_bytes if self.world_size <= 3 else 64 << 10
            tables = self._segment.data[ring:] if self.peer_read else None
            engine = Engine(self._segment, self.rank, self.world_size, chunk_bytes, direct_bytes, areas, tables)
            self._thread = threading.Thread(target=_serve, args=(self._requests, engine), daemon=True,
                                            name=f"fanfold-shm-rank{self.rank}")
            self._thread.start()
        self._finalizer = weakref.finalize(self, _stop, self._requests, self._thread, self._segment, self._regions)

    def _submit(self, op: int, tensor: torch.Tensor | None, bucket: int | None = None, src: int = 0,
                divisor: float | None = None, outs: list[torch.Tensor] | None = None) -> ShmWork:
        flat, finish = _flat(tensor, OPS[op]) if tensor is not None else (None, None)
        contiguous = finish is None
        if outs is not None:  # reduce_into: the result goes to outs, whichever algorithm runs
            if not contiguous or op != ALL_REDUCE:
                raise ValueError("reduce_into needs a contiguous tensor")
            finish = lambda: _split_into(flat, outs)  # noqa: E731 - dropped below when the sum writes outs itself
        if self.world_size == 1:
            if divisor is not None:
                tensor.div_(divisor)
            return _completed(tensor)
        if not self._finalizer.alive:
            raise RuntimeError(f"rank {self.rank}: {OPS[op]} on a closed ShmTransport")
        # Small tensors (up to a quarter chunk) take the ring even from shared memory: one synchronisation, not 3.
        big = op == ALL_REDUCE and contiguous and flat.numel() * flat.element_size() > self._chunk_bytes // 4
        shared = self._shared(flat) if big and self._regions else None
        if shared is not None and outs is not None and self.world_size <= 3:
            op, finish = REDUCE_INTO, None
        elif shared is not None:
            op = SHARED_ALL_REDUCE
        targets = outs  # the engine's: reduce_into's outputs, or the tensors that a peer-read all-reduce sums
        if shared is None and big and self.peer_read:  # private memory the peers can read: no copy
            op, targets = REDUCE_TENSORS, [flat]  # into the ring; reduce_into's outs are filled by `finish`
        fut = torch.futures.Future()
        with self._lock:  # numbering and queueing together: the FIFO order is the numbering order
            self._seq += 1
            self._requests.put((fut, tensor, finish, (op, flat, self._seq, bucket, src, shared, divisor, targets)))
        return ShmWork(fut)

    def _shared(self, flat: torch.Tensor) -> tuple[list[torch.Tensor], int] | None:
        """Every rank's copy of ``flat`` (by rank) and where it lies, when it lies in memory from allocate()."""
        nbytes = flat.numel() * flat.element_size()
        for index, (start, size, views, _) in enumerate(self._regions):
            offset = flat.data_ptr() - start
            if 0 <= offset and offset + nbytes <= size:
                return [v[offset: offset + nbytes].view(flat.dtype) for v in views], index << 40 | offset
        return None

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """A zeroed 1-d tensor of ``numel`` ``dtype`` in memory every rank can read (ordinary memory where that
        brings nothing: one rank, an unsupported dtype, not CPU). An all_reduce of it (or of a contiguous part of it)
        sums in place, each rank reading its peers' copies: no copy into the ring, half the memory traffic.
        Collective: every rank allocates the same sizes in the same order; lives until close() and its last user."""
        if self.world_size == 1 or dtype not in DTYPES or numel <= 0 or torch.device(device).type != "cpu":
            return torch.zeros(numel, dtype=dtype, device=device)
        if not self._finalizer.alive:
            raise RuntimeError(f"rank {self.rank}: allocate on a closed ShmTransport")
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        stride = -(-nbytes // 4096) * 4096
        store = group_store(self.group, "region", self.rank)
        try:
            region = Segment(store, self.rank, self.world_size, self.world_size * stride, self.timeout,
                             check_pids=False)
        except ShmTimeoutError:
            raise
        except RuntimeError as exc:  # every rank gets this error (/dev/shm full): all fall back to the ring
            warnings.warn(f"ShmTransport.allocate({numel}, {dtype}) falls back to ordinary memory: {exc}",
                          stacklevel=2)
            return torch.zeros(numel, dtype=dtype)
        views = [region.data[r * stride:][:nbytes] for r in range(self.world_size)]
        self._regions.append((views[self.rank].data_ptr(), nbytes, views, region))
        return views[self.rank].view(dtype)

    def all_reduce(self, tensor: torch.Tensor, bucket: int | None = None, divisor: float | None = None) -> ShmWork:
        """Sum ``tensor`` over the group, in place, asynchronously; ``bucket`` labels errors. With ``divisor`` the
        result is the sum divided by it (bitwise what dividing afterwards gives), at no extra pass over memory."""
        if divisor is not None and not (isinstance(divisor, (int, float)) and divisor > 0):
            raise ValueError(f"all_reduce: divisor must be a positive number, got {divisor!r}")
        return self._submit(ALL_REDUCE, tensor, bucket, divisor=divisor)

    def reduce_into(self, tensor: torch.Tensor, outs: list[torch.Tensor], bucket: int | None = None, *,
                    divisor: float | None = None) -> ShmWork:
        """All-reduce contiguous ``tensor`` into ``outs`` (contiguous tensors of its dtype whose lengths add up to
        its length, in order); what ``tensor`` holds afterwards is unspecified. For memory from :meth:`allocate` up to 3
        ranks, each rank sums straight from every copy into ``outs``: the fewest bytes moved (``reduce_tensors``
        without peer reads). Otherwise an all_reduce in place, then a copy into ``outs``."""
        if divisor is not None and not (isinstance(divisor, (int, float)) and divisor > 0):
            raise ValueError(f"reduce_into: divisor must be a positive number, got {divisor!r}")
        outs = [o.view(-1) for o in outs]
        if sum(o.numel() for o in outs) != tensor.numel() or any(o.dtype != tensor.dtype for o in outs):
            raise ValueError(f"reduce_into: outs must add up to the tensor's {tensor.numel()} {tensor.dtype} "
                             f"elements, got {[(o.numel(), o.dtype) for o in outs]}")
        if self.world_size == 1:
            _split_into(tensor.view(-1) if divisor is None else tensor.view(-1) / divisor, outs)
            return _completed(tensor)
        return self._submit(ALL_REDUCE, tensor, bucket, divisor=divisor, outs=outs)

    def reduce_tensors(self, tensors: list[torch.Tensor], bucket: int | None = None, *,
                       divisor: float | None = None, settle: bool = True,
                       compress: torch.dtype | None = None) -> ShmWork:
        """The Protocol's ``reduce_tensors`` (CPU tensors). Where every rank may read its peers' memory
        (``peer_read``) nothing is copied into shared memory: each rank sums its shard from the peers' own tensors
        and copies the other shards from theirs (DDP's gradients, straight from autograd); ``settle=False``: the
        handle completes once this rank has its result, while peers may still read its tensors (one
        synchronisation less). Otherwise the tensors are copied into this bucket label's memory from
        :meth:`allocate` (kept, grown as needed), all-reduced and copied back. ``compress``: bitwise fanfold's
        compression hooks (cast -- float16 after dividing by ``divisor`` --, all-reduce, cast back); with peer reads
        every rank rounds the values as it reads them, at no extra pass over memory."""
        if divisor is not None and not (isinstance(divisor, (int, float)) and divisor > 0):
            raise ValueError(f"reduce_tensors: divisor must be a positive number, got {divisor!r}")
        tensors = list(tensors)
        for k, t in enumerate(tensors):
            _flat(t, f"reduce_tensors (tensor {k})")
            if not t.is_contiguous() or t.dtype != tensors[0].dtype or t.is_complex():
                raise ValueError(f"reduce_tensors: tensor {k} must be a contiguous real tensor of "
                                 f"{tensors[0].dtype}, like tensor 0; got {t.dtype}, contiguous={t.is_contiguous()}")
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), k)
                       for k, t in enumerate(tensors) if t.numel())
        for (_, end, j), (start, _, k) in zip(spans, spans[1:]):
            if start < end:  # summed in place shard by shard: two names for one memory would corrupt both
                raise ValueError(f"reduce_tensors: tensors {min(j, k)} and {max(j, k)} overlap in memory")
        if compress is not None and (compress not in (torch.bfloat16, torch.float16) or
                                     any(t.dtype != torch.float32 for t in tensors)):
            raise ValueError(f"reduce_tensors: compress must be torch.bfloat16 or torch.float16, for float32 tensors; "
                             f"got {compress} for {tensors[0].dtype if tensors else 'no'} tensors")
        # float16 overflows on the sum of a few large gradients: it divides first (as fp16_compress_hook does)
        pre = divisor if compress == torch.float16 else None
        if pre is not None:
            divisor = None
        if not tensors or self.world_size == 1 or not self.peer_read:
            if not tensors:
                return _completed(tensors)
            numel = sum(t.numel() for t in tensors)
            if compress is None:
                flat = torch.cat([t.view(-1) for t in tensors], out=self._stage(bucket, numel, tensors[0].dtype))
                return self.reduce_into(flat, tensors, bucket, divisor=divisor)
            flat = torch.cat([t.view(-1) for t in tensors])
            narrow = self._stage(bucket, numel, compress).copy_(flat if pre is None else flat.div_(pre))
            work = self.all_reduce(narrow, bucket, divisor=divisor)
            return ShmWork(work.get_future().then(lambda _: _split_into(narrow, [t.view(-1) for t in tensors])))
        if not self._finalizer.alive:
            raise RuntimeError(f"rank {self.rank}: reduce_tensors on a closed ShmTransport")
        fut = torch.futures.Future()
        with self._lock:
            self._seq += 1
            self._requests.put((fut, tensors, None,
                                (REDUCE_TENSORS, tensors[0].view(-1), self._seq, bucket, 0, None, divisor, tensors,
                                 bool(settle), None if compress is None else (compress, pre))))
        return ShmWork(fut)

    def _stage(self, bucket: int | None, numel: int, dtype: torch.dtype) -> torch.Tensor:
        # Collective like allocate(): every rank reduces the same bucket labels with the same sizes in order.
        if bucket is None or self.world_size == 1 or numel * dtype.itemsize <= self._chunk_bytes // 4:
            return torch.empty(numel, dtype=dtype)  # small: the ring is faster than shared memory anyway
        stage = self._stages.get((bucket, dtype))
        if stage is None or stage.numel() < numel:
            stage = self._stages[(bucket, dtype)] = self.allocate(numel, dtype)
        return stage[:numel]

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Copy rank ``src``'s ``tensor`` into every rank's, in place (after the collectives queued before it)."""
        if not isinstance(src, int) or not 0 <= src < self.world_size:
            raise ValueError(f"broadcast: src must be a rank of the group (0..{self.world_size - 1}), got {src!r}")
        self._submit(BROADCAST, tensor, src=src).wait()

    def barrier(self) -> None:
        """Return once every rank has reached this barrier (and finished the collectives queued before it)."""
        self._submit(BARRIER, None).wait()

    def close(self) -> None:
        """Finish queued collectives, stop the thread and unmap the segment. Idempotent."""
        self._finalizer()

    def __enter__(self) -> ShmTransport:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ShmTransport(rank={self.rank}, world_size={self.world_size}, timeout={self.timeout:g})"
