"""``ShmTransport``: collectives through one shared-memory segment for ranks that share a host, and the one rule
that chooses between its two algorithms (``_reads_peers``): the ring through the segment's slots (``engine.py``),
and direct reads of the peers' tensors where the kernel allows them (``peer.py``).

Layer: the top of ``shm/``; used by the ``fanfold`` backend (``backend.py``), the transport choice (``select.py``)
and fanfold's DDP. Below it ``exchanges.py`` (all_gather, reduce_scatter, all_to_all), ``thread.py`` (the thread
that runs requests in FIFO order, so several buckets are in flight while backward runs) and ``segment.py`` (the
memory and the bounded waits). Only the segment's name and each rank's host identity travel through the group's
store.
"""
from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ..._core.job import require_initialized
from ..store import StoreGroup, group_store
from ..timeouts import bound, group_timeout, resolve_stall_timeout
from .engine import Engine
from .exchanges import Exchanges
from .peer import TABLE_BYTES, probe
from .request import (
    ALL_REDUCE,
    BARRIER,
    BROADCAST,
    DTYPES,
    OPS,
    REDUCE_TENSORS,
    SUM,
    Collective,
    check_reduce_tensors,
    flat_view,
    reduce_code,
    split_into,
)
from .segment import SHM_DIR, Segment, SegmentSpaceError, ShmTimeoutError, pid_namespace
from .thread import ShmWork, Worker
from .thread import completed as _completed

__all__ = ["ShmTransport", "ShmWork", "ShmTimeoutError", "SegmentSpaceError", "INLINE_BYTES", "SMALLEST_CHUNK"]

INLINE_BYTES = 64 << 10  # all_reduce(inline=True) up to this size runs on the caller's thread when nothing is queued
SMALLEST_CHUNK = 64 << 10  # a full /dev/shm: chunks shrink (by 4) down to this before the transport gives up
_SMALL_DTYPES = frozenset(DTYPES)


def _free_mib() -> float:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0.0
    return st.f_bavail * st.f_frsize / 2**20


class ShmTransport(Exchanges):
    """The transport interface (``protocol.Transport``) through shared memory, for ranks sharing this host's /dev/shm.
    Collective: every rank of ``group`` (None: the default group) constructs it, in the same order as its other
    transports. ``timeout`` (seconds or timedelta; default ``$FANFOLD_STALL_TIMEOUT``, else 300; at most the
    process group's timeout; a ``stall_timeout`` block replaces it for the collectives started in it) bounds every
    wait for a peer; a peer that never arrives, dies or fails makes the waiting rank raise
    :class:`ShmTimeoutError` naming both ranks and the collective. ``chunk_bytes`` is the pipelining unit (where
    /dev/shm has no room for the segment, smaller ones, down to :data:`SMALLEST_CHUNK`, announced once; then
    :class:`SegmentSpaceError`);
    ``direct_bytes`` (default: no limit up to 3 ranks, else 64 KiB) the largest tensor whose ring all_reduce every
    rank sums whole instead of by shards; ``peer_read`` (None: where the probe allows) whether ranks read their
    peers' memory.
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
        self._base, self._limit = resolve_stall_timeout(timeout), group_timeout(group)
        self.timeout = bound(self._base, self._limit)
        if direct_bytes is None:  # up to 3 ranks, summing everything on every rank moves fewer bytes
            direct_bytes = 1 << 62 if self.world_size <= 3 else 64 << 10
        self._direct_bytes = direct_bytes
        self._worker = self._segment = None
        self.peer_read = False  # every rank may read its peers' memory (probed below)
        self._regions: list[Segment] = []  # allocate()'s, closed with the transport
        self._regions_full = False  # allocate() found /dev/shm full (every rank alike): ordinary memory from then on
        if self.world_size > 1:
            store = group_store(group, "shm", self.rank)
            store.set(f"pidns/{self.rank}", pid_namespace())
            areas = 8 if self.world_size <= 3 else 4
            self._segment, chunk_bytes = self._map_segment(store, areas, chunk_bytes)
            ring = areas * (self.world_size + 1) * chunk_bytes
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
            tables = self._segment.data[ring:] if self.peer_read else None
            engine = Engine(self._segment, self.rank, self.world_size, chunk_bytes, areas, tables)
            self._worker = Worker(engine, f"fanfold-shm-rank{self.rank}", partial(bound, self._base, self._limit))
            self._finalizer = weakref.finalize(self, self._worker.stop, self._segment, self._regions)
        else:
            self._finalizer = weakref.finalize(self, lambda: None)
        self._chunk_bytes = chunk_bytes
        # the caller's-thread path: the ring's direct sum of one chunk (see _submit)
        self._small_bytes = min(INLINE_BYTES, chunk_bytes // 4, direct_bytes) if self.world_size > 1 else -1

    def _map_segment(self, store: Any, areas: int, chunk_bytes: int) -> tuple[Segment, int]:
        """The segment, with ``chunk_bytes`` chunks or, where /dev/shm has no room for it (Docker gives a container
        64 MB), the largest of a quarter, a sixteenth... down to SMALLEST_CHUNK that fits: announced once, by rank
        0. Collective: every rank sees the same failures (the segment's reports), so all take the same size."""
        asked, tried = chunk_bytes, 0
        while True:
            size = areas * (self.world_size + 1) * chunk_bytes + self.world_size * TABLE_BYTES
            try:
                # each try meets under its own keys: the failed one's are spent
                seg = Segment(store if tried == 0 else dist.PrefixStore(f"retry{tried}/", store), self.rank,
                              self.world_size, size, self.timeout, check_pids=False)
                break
            except SegmentSpaceError as exc:
                if chunk_bytes // 4 < SMALLEST_CHUNK:
                    raise SegmentSpaceError(
                        f"rank {self.rank}: {SHM_DIR} has no room for the shm transport's segment even with "
                        f"{chunk_bytes >> 10} KiB chunks ({size / 2**20:.1f} MiB): give it more (docker run "
                        f"--shm-size=1g) or set FANFOLD_TRANSPORT=torch. {exc}") from exc
                chunk_bytes = chunk_bytes // 4 // 4096 * 4096
                tried += 1
        if chunk_bytes != asked and self.rank == 0:
            warnings.warn(f"fanfold's shm transport: {SHM_DIR} has no room for its {asked >> 10} KiB chunks "
                          f"({_free_mib():.0f} MiB free; Docker's default is 64 MB): it runs with {chunk_bytes >> 10} "
                          f"KiB chunks, slower on large tensors. Give /dev/shm more room (docker run --shm-size=1g).",
                          stacklevel=3)
        return seg, chunk_bytes

    def _reads_peers(self, nbytes: int, listed: bool = False) -> bool:
        """The one choice between the two algorithms, for every collective that has both (all_reduce,
        reduce_tensors, reduce_scatter_tensors, all_gather): read the peers' tensors where they lie when every rank
        may (``peer_read``) and the data is a list of tensors (``listed``: gathering it into one buffer for the ring
        would cost a copy each way) or one tensor above a quarter chunk; the ring through the segment otherwise
        (below a quarter chunk its one synchronisation beats a system call per peer). It depends on sizes only, so
        every rank makes the same choice."""
        return self.peer_read and (listed or nbytes > self._chunk_bytes // 4)

    def _submit(self, op: int, tensor: torch.Tensor | None, bucket: int | None = None, src: int = 0,
                divisor: float | None = None, inline: bool = False, reduce: int = SUM,
                finish: Callable[[], None] | None = None) -> ShmWork:
        flat, back = flat_view(tensor, OPS[op]) if tensor is not None else (None, None)
        if self.world_size == 1:
            if divisor is not None:
                tensor.div_(divisor)
            if finish is not None:
                finish()
            return _completed(tensor)
        nbytes = 0 if flat is None else flat.numel() * flat.element_size()
        if op == ALL_REDUCE and back is None and self._reads_peers(nbytes):
            c = Collective(REDUCE_TENSORS, 0, flat, bucket, divisor=divisor, outs=[flat], reduce=reduce)
        else:  # the ring; an all_reduce above direct_bytes is summed by shards (engine.py)
            c = Collective(op, 0, flat, bucket, src, nbytes > self._direct_bytes, divisor, reduce=reduce)
        if back is not None:
            finish = back if finish is None else (lambda first=back, then=finish: (first(), then()))
        return self._enqueue(c, tensor, finish, inline and nbytes <= INLINE_BYTES)

    def _enqueue(self, c: Collective, value: Any, finish: Callable[[], None] | None, inline: bool = False
                 ) -> ShmWork:
        """Number ``c`` and run it (``Worker.submit``); the handle's future yields ``value``."""
        if not self._finalizer.alive:
            raise RuntimeError(f"rank {self.rank}: {OPS[c.op]} on a closed ShmTransport")
        return ShmWork(self._worker.submit(c, value, finish, inline))

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """A zeroed 1-d tensor of ``numel`` ``dtype`` in a shared-memory region of its own (ordinary memory for one
        rank, an unsupported dtype, not CPU), reduced like any other tensor. Collective: every rank allocates the
        same sizes in the same order. The region lives until close() and the last tensor viewing it (DDP's buckets,
        ``.grad`` views of them), whichever comes last (``_core.shm.map_tensor``)."""
        if self.world_size == 1 or dtype not in DTYPES or numel <= 0 or torch.device(device).type != "cpu":
            return torch.zeros(numel, dtype=dtype, device=device)
        if not self._finalizer.alive:
            raise RuntimeError(f"rank {self.rank}: allocate on a closed ShmTransport")
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        stride = -(-nbytes // 4096) * 4096
        store = group_store(self.group, "region", self.rank)
        if self._regions_full:
            return torch.zeros(numel, dtype=dtype)
        try:
            region = Segment(store, self.rank, self.world_size, self.world_size * stride, self.timeout,
                             check_pids=False)
        except ShmTimeoutError:
            raise
        except SegmentSpaceError:  # every rank gets it: all keep to ordinary memory from now on, said once
            self._regions_full = True
            if self.rank == 0:
                warnings.warn(f"fanfold's shm transport: {SHM_DIR} is full ({_free_mib():.0f} MiB free; Docker's "
                              "default is 64 MB): allocate() falls back to ordinary memory from now on (DDP's "
                              "buckets are copied into the segment by chunks). Give /dev/shm more room (docker run "
                              "--shm-size=1g).", stacklevel=2)
            return torch.zeros(numel, dtype=dtype)
        except RuntimeError as exc:  # every rank gets this error: all fall back to the ring
            warnings.warn(f"ShmTransport.allocate({numel}, {dtype}) falls back to ordinary memory: {exc}",
                          stacklevel=2)
            return torch.zeros(numel, dtype=dtype)
        self._regions.append(region)
        return region.data[self.rank * stride:][:nbytes].view(dtype)

    def all_reduce(self, tensor: torch.Tensor, bucket: int | None = None, divisor: float | None = None, *,
                   inline: bool = False, op: str = "sum") -> ShmWork:
        """Sum ``tensor`` over the group, in place, asynchronously; ``bucket`` labels errors. With ``divisor`` the
        result is the sum divided by it (bitwise what dividing afterwards gives), at no extra pass over memory.
        ``op``: "sum", or "min", "max", "product" (in rank order as the sum; no divisor). ``inline``: a sum of at
        most :data:`INLINE_BYTES` is done on this thread before the call returns when no collective is queued or
        running (the latency path, :meth:`run_small`); otherwise it is queued as usual."""
        if divisor is not None and not (isinstance(divisor, (int, float)) and divisor > 0):
            raise ValueError(f"all_reduce: divisor must be a positive number, got {divisor!r}")
        reduce = reduce_code(op, divisor)
        if inline and reduce == SUM and self.run_small(tensor, divisor, bucket):
            return _completed(tensor)
        return self._submit(ALL_REDUCE, tensor, bucket, divisor=divisor, reduce=reduce)

    def run_small(self, tensor: torch.Tensor, divisor: float | None = None, bucket: int | None = None) -> bool:
        """The latency path: sum a contiguous CPU ``tensor`` of at most :data:`INLINE_BYTES` (the ring's direct sum
        of one chunk) in place, on this thread, now, if nothing is queued or running -- True once done. False
        (nothing done) for anything else; the caller then queues it as usual. ``divisor`` is checked by the
        caller."""
        if not (tensor.is_cpu and tensor.layout is torch.strided and tensor.dtype in _SMALL_DTYPES
                and tensor.nbytes <= self._small_bytes and tensor.is_contiguous() and self._finalizer.alive):
            return False
        # detach: the sum is written into the tensor whatever autograd thinks of it (a Parameter), as gloo does
        return self._worker.run_small(tensor.detach() if tensor.requires_grad else tensor, divisor, bucket)

    def reduce_tensors(self, tensors: list[torch.Tensor], bucket: int | None = None, *,
                       divisor: float | None = None, settle: bool = True,
                       compress: torch.dtype | None = None) -> ShmWork:
        """The Protocol's ``reduce_tensors`` (CPU tensors). Where the peers' memory is read (``_reads_peers``)
        nothing is copied into shared memory: each rank sums its shard from the peers' own tensors and copies the
        other shards from theirs (DDP's gradients, straight from autograd); ``settle=False``: the handle completes
        once this rank has its result, while peers may still read its tensors (one synchronisation less).
        Otherwise the tensors are laid end to end in one buffer, all-reduced through the ring and copied back.
        ``compress``: bitwise fanfold's compression hooks (cast -- float16 after dividing by ``divisor`` --,
        all-reduce, cast back); with peer reads every rank rounds the values as it reads them."""
        if divisor is not None and not (isinstance(divisor, (int, float)) and divisor > 0):
            raise ValueError(f"reduce_tensors: divisor must be a positive number, got {divisor!r}")
        tensors = check_reduce_tensors(tensors, compress)
        if not tensors:
            return _completed(tensors)
        # float16 overflows on the sum of a few large gradients: it divides first (as fp16_compress_hook does)
        pre = divisor if compress == torch.float16 else None
        if pre is not None:
            divisor = None
        nbytes = sum(t.numel() for t in tensors) * tensors[0].element_size()
        if self.world_size > 1 and self._reads_peers(nbytes, listed=True):
            return self._enqueue(Collective(REDUCE_TENSORS, 0, tensors[0].view(-1), bucket, divisor=divisor,
                                            outs=tensors, settle=bool(settle),
                                            compress=None if compress is None else (compress, pre)), tensors, None)
        flat = torch.cat([t.view(-1) for t in tensors])
        if compress is not None:
            flat = (flat if pre is None else flat.div_(pre)).to(compress)
        return self._submit(ALL_REDUCE, flat, bucket, divisor=divisor,
                            finish=lambda: split_into(flat, [t.view(-1) for t in tensors]))

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Copy rank ``src``'s ``tensor`` into every rank's, in place (after the collectives queued before it)."""
        if not isinstance(src, int) or not 0 <= src < self.world_size:
            raise ValueError(f"broadcast: src must be a rank of the group (0..{self.world_size - 1}), got {src!r}")
        self._submit(BROADCAST, tensor, src=src, inline=True).wait()  # waited for at once: small ones on this thread

    def barrier(self) -> None:
        """Return once every rank has reached this barrier (and finished the collectives queued before it)."""
        self._submit(BARRIER, None).wait()

    def abort(self, message: str) -> None:
        """End every rank's waits in this transport at once (its collectives and its peers' raise, naming this rank
        and ``message``): the answer to the group's stall alarm, and to a failure in a layer above (the hierarchical
        transport's cross-host step), so that the ranks of this host learn it now rather than at their timeout. The
        transport is unusable after."""
        if self._segment is not None and self._finalizer.alive:
            self._segment.abort(f"rank {self.rank}: {message}")

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
