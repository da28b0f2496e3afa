"""``ShmTransport``: collectives through shared memory for ranks on one host, its argument checks, ``_reads_peers``
(the one rule choosing the ring or the peer reads) and the worker that runs the collectives in number order.
"""
from __future__ import annotations

import queue
import shutil
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ..._core.job import require_initialized
from ..._core.shm import SHM_DIR, pid_namespace
from ..protocol import FanfoldWork, StallError, completed_work
from ..timeouts import StoreGroup, bound, group_store, group_timeout, resolve_stall_timeout
from ..transport import split_into
from .engine import DTYPES, OPS, SUM, TABLE_BYTES, Claim, Collective, Engine, Op, probe, reduce_code
from .segment import Segment, SegmentSpaceError, ShmTimeoutError

__all__ = ["ShmTransport", "ShmTimeoutError", "SegmentSpaceError", "INLINE_BYTES", "SMALLEST_CHUNK", "flat_view"]

INLINE_BYTES = 64 << 10  # all_reduce(inline=True) up to this size runs on the caller's thread when nothing is queued
SMALLEST_CHUNK = 64 << 10  # a full /dev/shm: chunks shrink (by 4) down to this before the transport gives up
_SMALL_DTYPES = frozenset(DTYPES)


def flat_view(tensor: torch.Tensor, what: str) -> tuple[torch.Tensor, Callable[[], None] | None]:
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


def exchange_tensors(what: str, tensor: torch.Tensor, out: torch.Tensor, times: int = 1, per: int = 1
                     ) -> tuple[torch.Tensor, torch.Tensor, Callable[[], None] | None]:
    """The flat input and output of an exchange, and the copy back into a non-contiguous ``out`` (or None); ``out``
    holds ``times`` / ``per`` times the input's elements (``times=0``: any number)."""
    flat, _ = flat_view(tensor, f"{what} (input)")  # the engine only reads the input: a copy is all it needs
    out_flat, back = flat_view(out, f"{what} (output)")
    if out.dtype != tensor.dtype:
        raise TypeError(f"{what}: the output's dtype {out.dtype} differs from the input's {tensor.dtype}")
    if times and (tensor.numel() % per or out.numel() * per != tensor.numel() * times):
        raise ValueError(f"{what}: an input of {tensor.numel()} elements needs an output of {times}/{per} as many, "
                         f"got {out.numel()}")
    return flat, out_flat, back


def check_reduce_tensors(tensors: list[torch.Tensor], compress: torch.dtype | None, what: str = "reduce_tensors"
                         ) -> list[torch.Tensor]:
    """``what``'s tensors, checked: contiguous real CPU tensors of one dtype, not overlapping; ``compress`` only to
    bfloat16 or float16, of float32 tensors."""
    tensors = list(tensors)
    for k, t in enumerate(tensors):
        flat_view(t, f"{what} (tensor {k})")
        if not t.is_contiguous() or t.dtype != tensors[0].dtype or t.is_complex():
            raise ValueError(f"{what}: tensor {k} must be a contiguous real tensor of "
                             f"{tensors[0].dtype}, like tensor 0; got {t.dtype}, contiguous={t.is_contiguous()}")
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), k)
                   for k, t in enumerate(tensors) if t.numel())
    for (_, end, j), (start, _, k) in zip(spans, spans[1:]):
        if start < end:  # summed in place shard by shard: two names for one memory would corrupt both
            raise ValueError(f"{what}: tensors {min(j, k)} and {max(j, k)} overlap in memory")
    if compress is not None and (compress not in (torch.bfloat16, torch.float16) or
                                 any(t.dtype != torch.float32 for t in tensors)):
        raise ValueError(f"{what}: compress must be torch.bfloat16 or torch.float16, for float32 tensors; "
                         f"got {compress} for {tensors[0].dtype if tensors else 'no'} tensors")
    return tensors


def _listed(what: str, tensors: list[torch.Tensor], divisor: float | None, compress: torch.dtype | None
            ) -> tuple[list[torch.Tensor], float | None, float | None]:
    # a list of tensors to sum, checked; the divisor after the sum and the one before (float16 overflows on the sum
    # of a few large gradients: it divides first, as fp16_compress_hook does)
    reduce_code("sum", divisor, what)
    tensors = check_reduce_tensors(tensors, compress, what)
    return (tensors, divisor, None) if compress != torch.float16 else (tensors, None, divisor)


@dataclass(frozen=True, eq=False)
class Request:
    future: torch.futures.Future  # completes once the collective and ``finish`` ran
    finish: Callable[[], None] | None
    collective: Collective


class Worker:
    """Numbers a transport's collectives and runs them in number order: on its thread, or on the caller's
    (``run_small``) when nothing is queued or running. After a failure later collectives get the same error."""

    def __init__(self, engine: Engine, name: str, timeout: Callable[[], float]):
        self.engine, self._timeout = engine, timeout
        self.seq = 0  # the collectives numbered so far
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # numbering, queueing and the count of unfinished collectives, together
        self._running = threading.Lock()  # held while the engine runs: one collective at a time, in number order
        self._pending = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True, name=name)
        self._thread.start()

    def submit(self, c: Collective, finish: Callable[[], None] | None = None) -> torch.futures.Future:
        fut = torch.futures.Future()
        with self._lock:  # numbering and queueing together: the FIFO order is the numbering order
            self.seq += 1
            self._pending += 1
            self._requests.put(Request(fut, finish, replace(c, seq=self.seq, timeout=self._timeout())))
        return fut

    def run_small(self, t: torch.Tensor, divisor: float | None, bucket: int | None) -> bool:
        """``Engine.run_small`` on this thread if nothing is queued or running: True once done (raising the
        transport's error, as its handle would); False, nothing done, when it must queue."""
        with self._lock:
            if self._pending or self._error is not None:
                return False
            self.seq += 1
            seq = self.seq
            self._pending = 1
            self._running.acquire()  # nothing unfinished: the thread is idle (it releases the engine, then counts down)
        try:
            self.engine.seg.timeout = self._timeout()
            self._run(lambda: self.engine.run_small(t, divisor, seq, bucket))
        finally:
            self._running.release()
            with self._lock:
                self._pending -= 1
        return True

    def _run(self, work: Callable[[], None], finish: Callable[[], None] | None = None) -> None:
        try:
            work()
            if finish is not None:
                finish()
        except BaseException as exc:  # noqa: BLE001 - every peer must learn of the failure
            self._error = exc
            # the peers raise at once, naming the ranks this one found missing (a StallError's), if any
            self.engine.seg.abort(f"rank {self.engine.rank}: {type(exc).__name__}: {exc}",
                                  getattr(exc, "missing", None))
            raise

    def _serve(self) -> None:
        while True:
            request = self._requests.get()
            if request is None:
                return
            error = None
            with self._running:  # behind a collective running on a caller's thread, numbered before this one
                if self._error is not None:
                    error = _failed_earlier(self._error, self.engine.rank, request.collective)
                else:
                    try:
                        self._run(lambda: self.engine.run(request.collective), request.finish)
                    except BaseException as exc:  # noqa: BLE001 - every failure must reach the waiting caller
                        error = exc
            # counted done before its caller wakes, whose next small collective may then run on its own thread; and
            # completed outside the engine's lock, so that a callback may issue one there too
            with self._lock:
                self._pending -= 1
            if error is None:
                request.future.set_result(None)
            else:
                request.future.set_exception(error)

    def stop(self, segment: Segment) -> None:
        if self._thread.is_alive():
            self._requests.put(None)
            self._thread.join(5.0)
        if not self._thread.is_alive():
            self.engine.close()
            segment.close()


def _failed_earlier(earlier: BaseException, rank: int, c: Collective) -> BaseException:
    """The error of collective ``c``, queued behind one that failed with ``earlier``: a StallError naming the same
    missing ranks where a peer died or stalled (the peer is still missing: every later collective of the backend
    raises the type the first did), else a RuntimeError saying why the transport is unusable."""
    text = f"the shm transport failed earlier and cannot be used: {earlier}"
    if isinstance(earlier, StallError):
        kind = OPS.get(c.op & 0xFF, "collective")
        error: BaseException = ShmTimeoutError(
            f"fanfold shm transport: rank {rank}: {kind} #{c.seq} not run: {text}", rank=rank, seq=c.seq,
            kind=kind, bucket=c.bucket, missing=list(earlier.missing), feature=earlier.feature,
            gone=earlier.gone)
    else:
        error = RuntimeError(text)
    error.__cause__ = earlier  # what failed, for the stall inspector's diagnosis
    return error


class ShmTransport:
    """The transport interface (``protocol.Transport``) through shared memory, for ranks sharing this host's /dev/shm.
    Collective: every rank of ``group`` (None: the default group) constructs it, in the same order as its other
    transports. ``timeout`` (seconds or timedelta; default ``$FANFOLD_STALL_TIMEOUT``, else 300; at most the process
    group's timeout) bounds every wait for a peer: one that never arrives, dies or fails makes the waiting rank raise
    :class:`ShmTimeoutError` naming both ranks and the collective. ``chunk_bytes``: the pipelining unit (smaller, down
    to :data:`SMALLEST_CHUNK`, where /dev/shm has no room). ``peer_read`` (None: where the probe allows): whether ranks
    read their peers' memory. :meth:`close` when done."""

    def __init__(self, group: Any = None, timeout: float | timedelta | None = None, *, chunk_bytes: int = 1 << 20,
                 peer_read: bool | None = None):
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
        self._worker = self._segment = None
        self.peer_read = False  # every rank may read its peers' memory (probed below)
        if self.world_size > 1:
            store = group_store(group, "shm", self.rank)
            store.set(f"pidns/{self.rank}", pid_namespace())
            areas = 8 if self.world_size <= 3 else 4
            self._segment, chunk_bytes = self._map_segment(store, areas, chunk_bytes)
            ring = areas * self.world_size * chunk_bytes
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
            self._finalizer = weakref.finalize(self, self._worker.stop, self._segment)
        else:
            self._finalizer = weakref.finalize(self, lambda: None)
        self._chunk_bytes = chunk_bytes
        # the caller's-thread path: the ring's sum of one chunk (see _reads_peers)
        self._small_bytes = min(INLINE_BYTES, chunk_bytes // 4) if self.world_size > 1 else -1

    def _map_segment(self, store: Any, areas: int, chunk_bytes: int) -> tuple[Segment, int]:
        # the segment with ``chunk_bytes`` chunks or, where /dev/shm has no room, the largest of a quarter, a
        # sixteenth... down to SMALLEST_CHUNK that fits; every rank sees the same failures
        asked, tried = chunk_bytes, 0
        while True:
            size = areas * self.world_size * chunk_bytes + self.world_size * TABLE_BYTES
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
            free = shutil.disk_usage(SHM_DIR).free >> 20
            warnings.warn(f"fanfold's shm transport: {SHM_DIR} has no room for its {asked >> 10} KiB chunks "
                          f"({free} MiB free; Docker's default is 64 MB): it runs with {chunk_bytes >> 10} "
                          f"KiB chunks, slower on large tensors. Give /dev/shm more room (docker run --shm-size=1g).",
                          stacklevel=3)
        return seg, chunk_bytes

    def _reads_peers(self, nbytes: int, listed: bool = False) -> bool:
        # the one choice of algorithm (docs/shm.md), from sizes only so that every rank chooses alike
        return self.peer_read and (listed or nbytes > self._chunk_bytes // 4)

    def _submit(self, op: int, tensor: torch.Tensor | None, bucket: int | None = None, src: int = 0,
                divisor: float | None = None, reduce: int = SUM,
                finish: Callable[[], None] | None = None) -> FanfoldWork:
        flat, back = flat_view(tensor, OPS[op]) if tensor is not None else (None, None)
        if self.world_size == 1:
            if divisor is not None:
                tensor.div_(divisor)
            if finish is not None:
                finish()
            return completed_work(tensor)
        nbytes = 0 if flat is None else flat.numel() * flat.element_size()
        # a non-contiguous tensor's contiguous copy is read where it lies too: the choice is the size's alone
        if op == Op.ALL_REDUCE and self._reads_peers(nbytes):
            c = Collective(Op.REDUCE_TENSORS, 0, flat, bucket, divisor=divisor, outs=[flat], reduce=reduce)
        else:
            c = Collective(op, 0, flat, bucket, src, divisor, reduce=reduce)
        if back is not None:
            finish = back if finish is None else (lambda first=back, then=finish: (first(), then()))
        return self._enqueue(c, tensor, finish)

    def _enqueue(self, c: Collective, value: Any, finish: Callable[[], None] | None) -> FanfoldWork:
        if not self._finalizer.alive:
            raise RuntimeError(f"rank {self.rank}: {OPS[c.op]} on a closed ShmTransport")
        return FanfoldWork(self._worker.submit(c, finish), value)

    def all_reduce(self, tensor: torch.Tensor, bucket: int | None = None, divisor: float | None = None, *,
                   inline: bool = False, op: str = "sum") -> FanfoldWork:
        """The Protocol's ``all_reduce``; ``op``: "sum", "min", "max" or "product" (no divisor). ``inline``: a sum of
        at most :data:`INLINE_BYTES` runs on this thread when nothing is queued or running."""
        reduce = reduce_code(op, divisor, "all_reduce")
        if inline and reduce == SUM and self.run_small(tensor, divisor, bucket):
            return completed_work(tensor)
        return self._submit(Op.ALL_REDUCE, tensor, bucket, divisor=divisor, reduce=reduce)

    def run_small(self, tensor: torch.Tensor, divisor: float | None = None, bucket: int | None = None) -> bool:
        """Sum a contiguous CPU ``tensor`` of at most :data:`INLINE_BYTES` on this thread if nothing is queued or
        running: True once done; False, nothing done, otherwise. ``divisor`` is checked by the caller."""
        if not (tensor.is_cpu and tensor.layout is torch.strided and tensor.dtype in _SMALL_DTYPES
                and tensor.nbytes <= self._small_bytes and tensor.is_contiguous() and self._finalizer.alive):
            return False
        # detach: the sum is written into the tensor whatever autograd thinks of it (a Parameter), as gloo does
        return self._worker.run_small(tensor.detach() if tensor.requires_grad else tensor, divisor, bucket)

    def reduce_tensors(self, tensors: list[torch.Tensor], bucket: int | None = None, *,
                       divisor: float | None = None, settle: bool = True,
                       compress: torch.dtype | None = None) -> FanfoldWork:
        tensors, divisor, pre = _listed("reduce_tensors", tensors, divisor, compress)
        if not tensors:
            return completed_work(tensors)
        nbytes = sum(t.numel() for t in tensors) * tensors[0].element_size()
        if self._reads_peers(nbytes, listed=True):
            return self._enqueue(Collective(Op.REDUCE_TENSORS, 0, tensors[0].view(-1), bucket, divisor=divisor,
                                            outs=tensors, settle=bool(settle),
                                            compress=compress and (compress, pre)), tensors, None)
        flat = torch.cat([t.view(-1) for t in tensors])
        if compress is not None:
            flat = (flat if pre is None else flat.div_(pre)).to(compress)
        return self._submit(Op.ALL_REDUCE, flat, bucket, divisor=divisor,
                            finish=lambda: split_into(flat, [t.view(-1) for t in tensors]))

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        if not isinstance(src, int) or not 0 <= src < self.world_size:
            raise ValueError(f"broadcast: src must be a rank of the group (0..{self.world_size - 1}), got {src!r}")
        self._submit(Op.BROADCAST, tensor, src=src).wait()

    def barrier(self) -> None:
        self._submit(Op.BARRIER, None).wait()

    def claim(self, claim: Claim) -> None:
        """Collective: publish ``claim``, the header of a collective this rank runs elsewhere (gloo) or refuses, and
        check every rank's at one step, in issue order with this transport's collectives; returns once every rank
        claimed the same. A rank in another collective, or in this one in shared memory, raises
        :class:`ShmMismatchError` at its first step, as this rank does."""
        if self.world_size > 1:
            self._enqueue(Collective(Op.CLAIM, 0, claim=claim), None, None).wait()

    def abort(self, message: str) -> None:
        """End every rank's waits at once (they raise, naming this rank and ``message``)."""
        if self._segment is not None and self._finalizer.alive:
            self._segment.abort(f"rank {self.rank}: {message}")

    @property
    def issued(self) -> int:
        return 0 if self._worker is None else self._worker.seq

    def close(self) -> None:
        """Finish queued collectives, stop the thread, unmap the segment (idempotent)."""
        self._finalizer()

    def __enter__(self) -> ShmTransport:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ShmTransport(rank={self.rank}, world_size={self.world_size}, timeout={self.timeout:g})"

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor, bucket: int | None = None) -> FanfoldWork:
        if tensor.numel() and out.numel() and _overlaps(tensor, out) and not _own_part(tensor, out, self.rank):
            tensor = tensor.clone()  # overlapping other ranks' places in out: the engine would overwrite it
        flat, out_flat, finish = exchange_tensors("all_gather", tensor, out, times=self.world_size)
        op = Op.GATHER_PEERS if self._reads_peers(out_flat.nbytes) else Op.ALL_GATHER
        return self._exchange(Collective(op, 0, flat, bucket, out=out_flat), out, finish)

    def reduce_scatter(self, tensor: torch.Tensor, out: torch.Tensor, bucket: int | None = None, *,
                       divisor: float | None = None, op: str = "sum") -> FanfoldWork:
        reduce = reduce_code(op, divisor, "reduce_scatter")
        flat, out_flat, finish = exchange_tensors("reduce_scatter", tensor, out, per=self.world_size)
        if reduce == SUM and self._reads_peers(flat.nbytes):
            if flat.numel() and (_overlaps(flat, out_flat) or _overlaps(out_flat, flat)):
                flat = flat.clone()  # peers read the input while this rank writes its part: apart, as on every rank
            return self._enqueue(Collective(Op.SCATTER_TENSORS, 0, flat, bucket, divisor=divisor, outs=[flat],
                                            out=out_flat), out, finish)
        return self._exchange(Collective(Op.REDUCE_SCATTER, 0, flat, bucket, divisor=divisor, out=out_flat,
                                         reduce=reduce), out, finish)

    def reduce_scatter_tensors(self, tensors: list[torch.Tensor], out: torch.Tensor, bucket: int | None = None, *,
                               divisor: float | None = None, settle: bool = True,
                               compress: torch.dtype | None = None) -> FanfoldWork:
        """This rank's part of the sum of ``tensors`` laid end to end (``total`` elements) into ``out``
        (``ceil(total / world_size)`` elements, zeroed past ``total``): bitwise :meth:`reduce_scatter` of the
        zero-padded concatenation. ``settle``, ``compress``: as :meth:`reduce_tensors`; ``out`` stays float32."""
        tensors, divisor, pre = _listed("reduce_scatter_tensors", tensors, divisor, compress)
        total = sum(t.numel() for t in tensors)
        chunk = -(-total // self.world_size)
        flat_out, back = flat_view(out, "reduce_scatter_tensors (out)")
        dtype = tensors[0].dtype if tensors else out.dtype
        if back is not None or out.dtype != dtype or out.numel() != chunk:
            raise ValueError(f"reduce_scatter_tensors: out must be a contiguous {dtype} tensor of ceil({total} / "
                             f"{self.world_size}) = {chunk} elements, got {out.dtype} {tuple(out.shape)} "
                             f"contiguous={out.is_contiguous()}")
        if any(_overlaps(t, out) or _overlaps(out, t) for t in tensors if t.numel() and out.numel()):
            raise ValueError("reduce_scatter_tensors: out overlaps one of the tensors in memory")
        if not tensors:
            return completed_work(out)
        if self._reads_peers(total * tensors[0].element_size(), listed=True):
            return self._enqueue(Collective(Op.SCATTER_TENSORS, 0, tensors[0].view(-1), bucket, divisor=divisor,
                                            outs=tensors, out=flat_out, settle=bool(settle),
                                            compress=compress and (compress, pre)), out, None)
        # No peer reads: one zero-padded copy of the concatenation (rounded, if compressed) through the ring
        wide = torch.cat([t.view(-1) for t in tensors])
        stage = torch.zeros(chunk * self.world_size, dtype=compress or dtype)
        stage[:total].copy_(wide if pre is None else wide.div_(pre))
        part = flat_out if compress is None else torch.empty(chunk, dtype=compress)
        work = self.reduce_scatter(stage, part, bucket, divisor=divisor)
        return work if compress is None else FanfoldWork(work.get_future(), out, lambda: flat_out.copy_(part))

    def all_to_all(self, tensor: torch.Tensor, out: torch.Tensor, send: list[int], recv: list[int]) -> FanfoldWork:
        """Send ``send[q]`` consecutive elements of ``tensor`` to rank q and receive ``recv[p]`` from rank p into
        ``out`` (in rank order); every rank checks every pair of counts before anything moves."""
        n = self.world_size
        for name, counts in (("send", send), ("recv", recv)):
            if len(counts) != n or any(not isinstance(k, int) or k < 0 for k in counts):
                raise ValueError(f"all_to_all: {name} must be {n} non-negative element counts, got {counts!r}")
        flat, out_flat, finish = exchange_tensors("all_to_all", tensor, out, times=0)
        for name, counts, t in (("send", send, tensor), ("recv", recv, out)):
            if sum(counts) != t.numel():
                raise ValueError(f"all_to_all: {name} counts {counts} add up to {sum(counts)}, not the {t.numel()} "
                                 f"elements of the {'input' if t is tensor else 'output'}")
        scale = flat.numel() // tensor.numel() if tensor.numel() else 1  # complex: pairs of reals
        splits = (tuple(k * scale for k in send), tuple(k * scale for k in recv))
        return self._exchange(Collective(Op.ALL_TO_ALL, 0, flat, out=out_flat, splits=splits), out, finish)

    def _exchange(self, c: Collective, out: torch.Tensor, finish: Callable[[], None] | None) -> FanfoldWork:
        if 16 * self.world_size > self._chunk_bytes:  # all_to_all's table of counts, a piece per rank in a chunk
            raise ValueError(f"{OPS[c.op]}: {self.world_size} ranks need chunk_bytes >= {16 * self.world_size}")
        if self.world_size == 1:
            if c.op == Op.REDUCE_SCATTER and c.divisor is not None:
                torch.div(c.flat, c.divisor, out=c.out)
            else:
                c.out.copy_(c.flat)
            if finish is not None:
                finish()
            return completed_work(out)
        return self._enqueue(c, out, finish)


def _own_part(tensor: torch.Tensor, out: torch.Tensor, rank: int) -> bool:
    # whether ``tensor`` is exactly this rank's place in ``out`` (an in-place all_gather, as ZeRO's)
    size = tensor.numel() * tensor.element_size()
    return (tensor.is_contiguous() and out.is_contiguous() and tensor.dtype == out.dtype
            and tensor.data_ptr() == out.data_ptr() + rank * size)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    lo, hi = b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()
    return lo <= a.data_ptr() < hi
