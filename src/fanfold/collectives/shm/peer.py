"""The peer reads: all-reduce, reduce-scatter and all_gather of private tensors by reading the peers' memory where
it lies (``process_vm_readv``), summed in rank order with the ring's fold (the same bits); and :func:`probe`, which
tells whether every rank may read every peer (docs/shm.md).
"""
from __future__ import annotations

import bisect
import ctypes
import errno
import os
from collections.abc import Callable
from itertools import accumulate
from typing import Any

import torch

__all__ = ["probe", "allow_peers", "PeerReader", "TABLE_BYTES"]

TABLE_BYTES = 64 << 10  # per rank: (address, bytes) pairs, 4096 tensors a round; longer lists take several rounds
PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, 2**64 - 1  # <linux/prctl.h>; ANY is (unsigned long)-1
_IOV_MAX = 1024  # the kernel's limit on iovecs per call, on each side
_PROBE_ADDR, _PROBE_OK = 64, 72  # offsets in a rank's segment line (0-63: counter, pid, collective descriptors)


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _readv_fn() -> Any:
    fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                   ctypes.c_ulong]
    return fn


def _copy(fn: Any, pid: int, pieces: list[tuple[int, int, int]]) -> None:
    # (local address, remote address, bytes) pieces from process ``pid``; OSError on a short read
    for s in range(0, len(pieces), _IOV_MAX):
        batch = pieces[s: s + _IOV_MAX]
        local = (_Iovec * len(batch))(*[(a, n) for a, _, n in batch])
        remote = (_Iovec * len(batch))(*[(b, n) for _, b, n in batch])
        want = sum(n for *_, n in batch)
        got = fn(pid, local, len(batch), remote, len(batch), 0)
        if got != want:
            err = ctypes.get_errno() if got < 0 else 0
            raise OSError(err, f"process_vm_readv from pid {pid} copied {got} of {want} bytes"
                               + (f": {os.strerror(err)}" if err else ""))


def _pieces(table: list[tuple[int, int]], starts: list[int], lo: int, hi: int):
    # (address, logical offset, bytes) of the parts of ``table`` ((address, bytes) laid end to end from
    # ``starts``) that cover logical bytes [lo, hi)
    k = bisect.bisect_right(starts, lo) - 1
    while lo < hi:
        addr, n = table[k]
        start = starts[k]
        take = min(hi, start + n) - lo
        if take > 0:
            yield addr + lo - start, lo, take
            lo += take
        k += 1


def allow_peers(seg: Any, rank: int, world_size: int) -> None:
    """Let the peers read this process's memory under Yama's ptrace_scope=1 (Ubuntu's default): PR_SET_PTRACER names
    the peer itself with two ranks, else any process of this user (what ptrace_scope=0 allows). No-op without Yama."""
    libc = ctypes.CDLL(None, use_errno=True)
    tracer = seg.pid(1 - rank) if world_size == 2 else PR_SET_PTRACER_ANY
    if libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(tracer), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        if err != errno.EINVAL:  # EINVAL: a kernel without Yama, where nothing needs allowing
            raise OSError(err, f"prctl(PR_SET_PTRACER): {os.strerror(err)}")


def probe(seg: Any, rank: int, world_size: int, enabled: bool = True) -> tuple[bool, str]:
    """Collective: whether every rank can read every peer's memory (and has ``enabled`` it), and if not why: each
    rank publishes a word's address, reads each peer's word and publishes the outcome (two steps of ``seg``)."""
    word = ctypes.c_uint64(0x5EED0000 ^ os.getpid())
    why = "" if enabled else "disabled (peer_read=False)"
    try:
        if enabled:  # before arriving: no peer reads before every rank has allowed it
            allow_peers(seg, rank, world_size)
    except (OSError, AttributeError) as exc:
        why = f"rank {rank} could not allow its peers to read its memory: {exc}"
    seg.line(rank, ctypes.c_uint64, _PROBE_ADDR).value = ctypes.addressof(word)
    seg.wait_all(seg.arrive(), lambda: ("the peer-read probe", 0, None))
    try:
        fn = _readv_fn()
        for p in range(world_size):
            if p != rank and not why:
                got = ctypes.c_uint64(0)
                _copy(fn, seg.pid(p), [(ctypes.addressof(got), seg.line(p, ctypes.c_uint64, _PROBE_ADDR).value, 8)])
                if got.value != 0x5EED0000 ^ seg.pid(p):
                    why = f"rank {rank} read a wrong value from rank {p}'s memory"
    except (OSError, AttributeError) as exc:  # EPERM, ENOSYS, another pid namespace (ESRCH), no such libc function
        why = f"rank {rank} may not read its peers' memory (process_vm_readv: {exc})"
    seg.line(rank, ctypes.c_uint32, _PROBE_OK).value = 2 if why else 1
    seg.wait_all(seg.arrive(), lambda: ("the peer-read probe", 0, None))  # peers are done reading `word` too
    failed = [p for p in range(world_size) if seg.line(p, ctypes.c_uint32, _PROBE_OK).value != 1]
    if failed and not why:
        why = f"rank(s) {failed} may not read their peers' memory"
    return not failed, why


class PeerReader:
    """The peer reads, on the transport's thread: ``data`` holds the tables (where each rank's tensors lie),
    ``chunk_bytes`` is the unit read from a peer at a time, ``summer`` the engine's rank-ordered fold."""

    def __init__(self, seg: Any, rank: int, world_size: int, data: torch.Tensor, chunk_bytes: int,
                 summer: Callable[[list[torch.Tensor], torch.Tensor], None]):
        self.seg, self.rank, self.n, self.chunk_bytes, self._sum = seg, rank, world_size, chunk_bytes, summer
        self._tables = [data[p * TABLE_BYTES:][:TABLE_BYTES].view(torch.int64).view(-1, 2) for p in range(world_size)]
        self._fn = _readv_fn()
        self._bufs = torch.empty((world_size, chunk_bytes), dtype=torch.uint8)
        self._narrow: torch.Tensor | None = None  # compress: every rank's chunk and the result, rounded
        self._compress: torch.dtype | None = None
        self._pre: float | None = None
        self.rows = self._tables[0].shape[0]  # tensors a round takes
        self.unsettled: int | None = None  # step after which peers may still read this rank's table (reduce_scatter)

    def all_reduce(self, tensors: list[torch.Tensor], describe: Callable, check: Callable[[], None], settle: bool,
                   compress: torch.dtype | None = None, pre_divisor: float | None = None) -> None:
        """All-reduce ``tensors`` in place, a table's worth of tensors a round: rank r sums shard r from every rank's
        tensors into its own, then copies every other shard from its owner's. ``settle``: return only once no peer
        reads them any more (else once this rank's next collective has waited). ``compress``: every rank's values
        divided by ``pre_divisor`` (if given) and rounded to that dtype as they are read, summed, rounded again: the
        compression hooks' bits."""
        self._compress, self._pre = compress, pre_divisor
        rows, n = self.rows, self.n
        for s in range(0, max(1, len(tensors)), rows):
            group = tensors[s: s + rows]
            mine, tables = self._open(group, describe, check if s == 0 else None, "all-reduces", s)
            total = sum(nb for _, nb in mine)
            per = -(-total // n // 64) * 64  # shard edges on cache lines: no two writers share one
            shards = [(min(total, p * per), min(total, (p + 1) * per)) for p in range(n)]
            steps = self._sum_part(group, mine, tables, *shards[self.rank], lambda own, x, y: own, describe)
            done = self.seg.arrive()  # this rank's shard holds the result
            self.seg.wait_all(done, describe(steps))
            for p in range(n):  # the other shards, from their owners' tensors straight into this rank's
                plo, phi = shards[p]
                if p == self.rank or phi <= plo:
                    continue
                pieces = []
                for laddr, off, m in _pieces(mine, tables[1][self.rank], plo, phi):
                    for raddr, roff, rm in _pieces(tables[0][p], tables[1][p], off, off + m):
                        pieces.append((laddr + roff - off, raddr, rm))
                self.read(p, pieces, describe(steps))
            # Peers may still be reading this rank's shard. This rank's table may be rewritten already (every peer
            # had read it before it summed its shard), but the tensors must not change before the peers are done: a
            # peer arrives at the next step only then, and any later wait of this rank for it implies that step.
            end = self.seg.arrive()
            if settle or s + rows < len(tensors):
                self.seg.wait_all(end, describe(steps))

    def reduce_scatter(self, tensors: list[torch.Tensor], out: torch.Tensor, describe: Callable,
                       check: Callable[[], None], settle: bool, compress: torch.dtype | None = None,
                       pre_divisor: float | None = None) -> None:
        """``out`` = this rank's part (of ``ceil(total / N)``, zeroed past ``total``: ZeRO's layout) of the sum of
        ``tensors`` laid end to end, read only from that part of each peer's. ``settle``, ``compress``: as
        :meth:`all_reduce`; unsettled, this rank's table is rewritten only once the peers are past it."""
        self._compress, self._pre = compress, pre_divisor
        total = sum(t.numel() for t in tensors)
        lo = min(total, self.rank * -(-total // self.n))
        hi = min(total, lo + -(-total // self.n))
        out[hi - lo:].zero_()
        base, rows = 0, self.rows
        for s in range(0, max(1, len(tensors)), rows):
            group = tensors[s: s + rows]
            mine, tables = self._open(group, describe, check if s == 0 else None, "reduce-scatters", s)
            size = group[0].element_size() if group else 1
            a, b = (max(0, x - base) * size for x in (lo, hi))  # this rank's part, in bytes of this round

            def into(own: torch.Tensor, x: int, y: int, base: int = base, size: int = size) -> torch.Tensor:
                at = base + x // size - lo  # where the piece lies in this rank's part
                return out[at: at + (y - x) // size]

            steps = self._sum_part(group, mine, tables, a, min(b, sum(nb for _, nb in mine)), into, describe)
            end = self.seg.arrive()  # this rank reads nobody's tensors any more
            if settle and s + rows >= len(tensors):
                self.seg.wait_all(end, describe(max(0, steps - 1)))
            else:
                self.unsettled = end
            base += sum(t.numel() for t in group)

    def all_gather(self, part: torch.Tensor, out: torch.Tensor, describe: Callable, check: Callable[[], None]
                   ) -> None:
        """``out`` = every rank's ``part``, by rank, each read straight from the peer's ``out``; returns once every
        peer has read this rank's part, so the caller may change it at once (ZeRO's next optimizer step)."""
        m = part.numel()
        own = out[self.rank * m:][:m]
        if m and part.data_ptr() != own.data_ptr():
            own.copy_(part)
        tables = self._open([out], describe, check, "gathers into", 0)[1][0]
        nb = m * out.element_size()
        for p in range(self.n):
            if p != self.rank and nb:
                self.read(p, [(out.data_ptr() + p * nb, tables[p][0][0] + p * nb, nb)], describe(0))
        self.seg.wait_all(self.seg.arrive(), describe(0))  # every peer has read this rank's part

    def publish(self, tensors: list[torch.Tensor], describe: Callable) -> list[tuple[int, int]]:
        """Write where ``tensors`` lie into this rank's table, once the peers are done with its last contents; their
        (address, bytes)."""
        if self.unsettled is not None:
            self.seg.wait_all(self.unsettled, describe)
            self.unsettled = None
        mine = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]
        if mine:
            self._tables[self.rank][: len(mine)] = torch.tensor(mine, dtype=torch.int64)
        return mine

    def _open(self, tensors: list[torch.Tensor], describe: Callable, check: Callable[[], None] | None, verb: str,
              first: int) -> tuple[list[tuple[int, int]], tuple[list, list]]:
        # A round's first step: this rank's table published, every peer's read (with their offsets) once every
        # rank has published. Every rank passes as many tensors (the header), but only the bytes must agree.
        mine = self.publish(tensors, describe(0))
        start = self.seg.arrive()  # the table is written and the tensors hold this rank's values: peers may read
        self.seg.wait_all(start, describe(0))
        if check is not None:
            check()
        tables = [mine if p == self.rank else [tuple(r) for r in self._tables[p][: len(mine)].tolist()]
                  for p in range(self.n)]
        total = sum(nb for _, nb in mine)
        for p in range(self.n):
            theirs = sum(nb for _, nb in tables[p])
            if theirs != total:
                raise RuntimeError(f"fanfold shm transport: rank {p} {verb} {theirs} bytes in tensors {first}.."
                                   f"{first + len(tensors) - 1} where rank {self.rank} has {total}, in "
                                   f"{describe(0)()[0]}: every rank must pass tensors of the same sizes")
        return mine, (tables, [list(accumulate((n for _, n in t), initial=0)) for t in tables])

    def _sum_part(self, tensors: list[torch.Tensor], mine: list[tuple[int, int]], tables: tuple, a: int, b: int,
                  into: Callable, describe: Callable) -> int:
        # bytes [a, b) of this round's tensors laid end to end, a chunk at a time: this rank's values and every
        # peer's, folded in rank order into ``into(own, x, y)``; the number of chunks
        starts, steps = tables[1][self.rank], 0
        size = tensors[0].element_size() if tensors else 1
        for k, (_, nb) in enumerate(mine):
            end = min(b, starts[k] + nb)
            for x in range(max(a, starts[k]), end, self.chunk_bytes):
                y = min(end, x + self.chunk_bytes)
                own = tensors[k].view(-1)[(x - starts[k]) // size: (y - starts[k]) // size]
                self._sum_chunk(own, x, y, tables, into(own, x, y), describe(steps))
                steps += 1
        return steps

    def _sum_chunk(self, own: torch.Tensor, x: int, y: int, tables: tuple, into: torch.Tensor,
                   describe: Callable) -> None:
        # ``into`` = the rank-ordered fold of bytes [x, y) of every rank's tensors, this rank's being ``own``; each
        # peer's read into its buffer, rounded first where the collective is compressed
        parts = []
        for p in range(self.n):
            if p == self.rank:
                parts.append(own)
                continue
            buf = self._bufs[p]
            self.read(p, [(buf.data_ptr() + off - x, raddr, m)
                          for raddr, off, m in _pieces(tables[0][p], tables[1][p], x, y)], describe)
            parts.append(buf[: y - x].view(own.dtype))
        if self._compress is None:
            self._sum(parts, into)
            return
        m = into.numel()
        if self._narrow is None or self._narrow.dtype != self._compress:
            self._narrow = torch.empty((self.n + 1, self.chunk_bytes // 4), dtype=self._compress)
        narrow = [self._narrow[i][:m].copy_(p if self._pre is None else p / self._pre) for i, p in enumerate(parts)]
        result = self._narrow[self.n][:m]
        self._sum(narrow, result)
        into.copy_(result)

    def read(self, p: int, pieces: list[tuple[int, int, int]], describe: Callable) -> None:
        try:
            _copy(self._fn, self.seg.pid(p), pieces)
        except OSError as exc:
            self.seg.peer_failed(p, describe, exc)  # raises: ShmTimeoutError naming p where p died
