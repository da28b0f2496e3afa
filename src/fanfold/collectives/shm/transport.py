"""``ShmTransport``: collectives through one shared-memory segment for ranks that share a host.

Layer: the top of ``shm/``; used by the ``fanfold`` backend (``backend.py``), the transport choice (``select.py``)
and fanfold's DDP. Below it ``thread.py`` (the thread that runs requests in FIFO order, so several buckets are in
flight while backward runs), ``engine.py`` / ``exchange.py`` (the algorithms: rank-ordered sums, bitwise equal on
every rank) and ``segment.py`` (the memory and the bounded waits). Process groups, rendezvous and launching stay
torch.distributed's: only the segment's name and each rank's host identity travel, through the group's store.
Private tensors above a quarter chunk skip the copy into the ring where every rank may read its peers' memory
(``process_vm_readv``, probed at start-up: ``peer_read``; ``peer.py``), else ``reduce_tensors`` copies them into
memory from :meth:`ShmTransport.allocate` kept per bucket label; memory from allocate() skips the copy always.
With peer reads ``reduce_scatter_tensors`` (``exchanges.py``, ``scatter.py``) and large all_gathers
(``gather.py``) read the peers' tensors where they lie too.
"""
from __future__ import annotations

import os
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
from .engine import Engine
from .exchanges import Exchanges
from .peer import TABLE_BYTES, probe
from .reduce_ops import SUM, reduce_code
from .request import (
    ALL_REDUCE,
    BARRIER,
    BROADCAST,
    DTYPES,
    OPS,
    REDUCE_INTO,
    REDUCE_TENSORS,
    SHARED_ALL_REDUCE,
    Collective,
)
from .segment import Segment, ShmTimeoutError, pid_namespace
from .tensors import check_reduce_tensors, flat_view, split_into
from .thread import ShmWork, Worker
from .thread import completed as _completed

__all__ = ["ShmTransport", "ShmWork", "ShmTimeoutError", "INLINE_BYTES"]

INLINE_BYTES = 64 << 10  # all_reduce(inline=True) up to this size runs on the caller's thread
_SMALL_DTYPES = frozenset(DTYPES)


class ShmTransport(Exchanges):
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
        self._chunk_bytes = chunk_bytes
        # the latency path's limit; small tensors take the ring, whatever memory they lie in (see _submit)
        self._small_bytes = min(INLINE_BYTES, chunk_bytes // 4) if self.world_size > 1 else -1
        self._worker = self._segment = None
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
            self._worker = Worker(engine, f"fanfold-shm-rank{self.rank}")
            self._finalizer = weakref.finalize(self, self._worker.stop, self._segment, self._regions,
                                              self._stages)
        else:
            self._finalizer = weakref.finalize(self, lambda: None)

    def _submit(self, op: int, tensor: torch.Tensor | None, bucket: int | None = None, src: int = 0,
                divisor: float | None = None, outs: list[torch.Tensor] | None = None, inline: bool = False,
                reduce: int = SUM) -> ShmWork:
        flat, finish = flat_view(tensor, OPS[op]) if tensor is not None else (None, None)
        contiguous = finish is None
        if outs is not None:  # reduce_into: the result goes to outs, whichever algorithm runs
            if not contiguous or op != ALL_REDUCE:
                raise ValueError("reduce_into needs a contiguous tensor")
            finish = lambda: split_into(flat, outs)  # noqa: E731 - dropped below when the sum writes outs itself
        if self.world_size == 1:
            if divisor is not None:
                tensor.div_(divisor)
            return _completed(tensor)
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
        inline = inline and op in (ALL_REDUCE, BROADCAST) and outs is None and \
            flat.numel() * flat.element_size() <= INLINE_BYTES
        return self._enqueue(Collective(op, 0, flat, bucket, src, shared, divisor, targets, reduce=reduce), tensor,
                             finish, inline)

    def _enqueue(self, c: Collective, value: Any, finish: Callable[[], None] | None, inline: bool = False
                 ) -> ShmWork:
        """Number ``c`` and run it (``Worker.submit``); the handle's future yields ``value``."""
        if not self._finalizer.alive:
            raise RuntimeError(f"rank {self.rank}: {OPS[c.op]} on a closed ShmTransport")
        return ShmWork(self._worker.submit(c, value, finish, inline))

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

    def all_reduce(self, tensor: torch.Tensor, bucket: int | None = None, divisor: float | None = None, *,
                   inline: bool = False, op: str = "sum") -> ShmWork:
        """Sum ``tensor`` over the group, in place, asynchronously; ``bucket`` labels errors. With ``divisor`` the
        result is the sum divided by it (bitwise what dividing afterwards gives), at no extra pass over memory.
        ``op``: "sum", or "min", "max", "product" (in rank order as the sum, ``reduce_ops.py``; no divisor).
        ``inline``: a tensor of at most :data:`INLINE_BYTES` is summed on this thread before the call returns when
        no collective is queued or running (the latency path: no hand-off to the transport's thread)."""
        if divisor is not None and not (isinstance(divisor, (int, float)) and divisor > 0):
            raise ValueError(f"all_reduce: divisor must be a positive number, got {divisor!r}")
        reduce = reduce_code(op, divisor)
        if inline and reduce == SUM and self.run_small(tensor, divisor, bucket):
            return _completed(tensor)
        return self._submit(ALL_REDUCE, tensor, bucket, divisor=divisor, inline=inline, reduce=reduce)

    def run_small(self, tensor: torch.Tensor, divisor: float | None = None, bucket: int | None = None) -> bool:
        """The latency path: sum a contiguous CPU ``tensor`` of at most :data:`INLINE_BYTES` in place, on this
        thread, now, if nothing is queued or running -- True once done. False (nothing done) for anything else; the
        caller then queues it as usual. ``divisor`` is checked by the caller."""
        if not (tensor.is_cpu and tensor.layout is torch.strided and tensor.dtype in _SMALL_DTYPES
                and tensor.nbytes <= self._small_bytes and tensor.is_contiguous() and self._finalizer.alive):
            return False
        # detach: the sum is written into the tensor whatever autograd thinks of it (a Parameter), as gloo does
        return self._worker.run_small(tensor.detach() if tensor.requires_grad else tensor, divisor, bucket)

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
            split_into(tensor.view(-1) if divisor is None else tensor.view(-1) / divisor, outs)
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
        tensors = check_reduce_tensors(tensors, compress)
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
            return ShmWork(work.get_future().then(lambda _: split_into(narrow, [t.view(-1) for t in tensors])))
        return self._enqueue(Collective(REDUCE_TENSORS, 0, tensors[0].view(-1), bucket, divisor=divisor, outs=tensors,
                                        settle=bool(settle), compress=None if compress is None else (compress, pre)),
                             tensors, None)

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
        self._submit(BROADCAST, tensor, src=src, inline=True).wait()  # waited for at once: small ones inline

    def barrier(self) -> None:
        """Return once every rank has reached this barrier (and finished the collectives queued before it)."""
        self._submit(BARRIER, None).wait()

    @property
    def issued(self) -> int:
        """How many collectives this rank has issued on the transport (run or queued)."""
        return 0 if self._worker is None else self._worker.seq

    def close(self) -> None:
        """Finish queued collectives, stop the thread and unmap the segment. Idempotent."""
        self._finalizer()

    def __enter__(self) -> ShmTransport:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ShmTransport(rank={self.rank}, world_size={self.world_size}, timeout={self.timeout:g})"
