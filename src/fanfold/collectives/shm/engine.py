"""The algorithms of the shared-memory transport: all_reduce, broadcast and barrier as numbered steps over the
ring of areas of a :class:`~fanfold.distributed.shm_segment.Segment`.

Layer: between ``shm_segment.py`` (memory, counters, bounded waits) and ``shm.py`` (the transport: its thread,
handles and selection). An :class:`Engine` runs on the transport's thread only.
"""
from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from typing import Any

import torch

from .peer import PeerReader
from .segment import Segment

__all__ = ["Engine", "DTYPES", "OPS", "ALL_REDUCE", "BROADCAST", "BARRIER", "SHARED_ALL_REDUCE", "REDUCE_INTO",
           "REDUCE_TENSORS"]

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8]
ALL_REDUCE, BROADCAST, BARRIER, SHARED_ALL_REDUCE, REDUCE_INTO, REDUCE_TENSORS = 1, 2, 3, 4, 5, 6
OPS = {ALL_REDUCE: "all_reduce", BROADCAST: "broadcast", BARRIER: "barrier", SHARED_ALL_REDUCE: "all_reduce",
       REDUCE_INTO: "all_reduce", REDUCE_TENSORS: "all_reduce"}
_DESC = 16  # in a rank's line, two descriptors (kind u32, numel u64) of its current collective, by seq parity
_WHERE = 48  # then, by seq parity, where a shared all_reduce's tensor lies (region << 40 | byte offset; u64)


class Engine:
    """The algorithms over one segment; runs on the transport's thread only.

    Every rank publishes numbered steps (``Segment.arrive``); step g writes area g % ``areas`` of the ring. A rank
    finishes reading step x before it publishes step x + 2 (one chunk of look-ahead: chunk i + 1 is written before
    chunk i is summed), so step g may rewrite its area once every peer's count reached g - areas + 3. With 8 areas a
    rank runs up to 5 steps ahead of a descheduled peer: the two take turns in bursts, not at every chunk.
    """

    def __init__(self, segment: Segment, rank: int, world_size: int, chunk_bytes: int, direct_bytes: int,
                 areas: int, tables: torch.Tensor | None = None):
        """``tables``: the peer-read tables' memory in the segment, when every rank may read its peers' memory
        (op REDUCE_TENSORS, ``shm_peer.py``); None otherwise."""
        self.seg, self.rank, self.n = segment, rank, world_size
        self.chunk_bytes, self.direct_bytes, self.areas = chunk_bytes, direct_bytes, areas
        self._views: dict[torch.dtype, list] = {}
        self._scratch = torch.empty(chunk_bytes // 2, dtype=torch.float32)  # a chunk of half values, widened
        self._divisor = None  # of the collective being run: its sums are divided while the chunk is in cache
        self._peer = None if tables is None else PeerReader(segment, rank, world_size, tables, chunk_bytes, self._sum)
        # Parity: a rank rewrites descriptor seq % 2 only after the first step of seq + 1 completed, which its peers
        # publish only once they have checked collective seq.
        self._desc = [[(segment.line(r, ctypes.c_uint32, _DESC + 16 * b),
                        segment.line(r, ctypes.c_uint64, _DESC + 16 * b + 8),
                        segment.line(r, ctypes.c_uint64, _WHERE + 8 * b)) for b in (0, 1)]
                      for r in range(world_size)]

    def _step(self, dtype: torch.dtype, describe: Callable) -> tuple[int, list[torch.Tensor], torch.Tensor]:
        """The next step's number, and its area's slots 0..N-1 and result, as ``dtype`` views, once reusable."""
        g = self.seg.arrived
        if g + 3 > self.areas:
            self.seg.wait_all(g + 3 - self.areas, describe)
        if dtype not in self._views:
            cap, data = self.chunk_bytes, self.seg.data
            self._views[dtype] = [[data[(b * (self.n + 1) + a) * cap:][:cap].view(dtype) for a in range(self.n + 1)]
                                  for b in range(self.areas)]
        area = self._views[dtype][g % self.areas]
        return g, area[: self.n], area[self.n]

    def _sum(self, parts: list[torch.Tensor], out: torch.Tensor) -> None:
        # Rank order, every time: the bits depend only on the inputs, not on which rank sums or how fast it is.
        if out.dtype in (torch.bfloat16, torch.float16) and len(parts) > 2:
            acc, rest = self._scratch[: out.numel()].copy_(parts[0]), parts[1:]  # several halves: in float32
        elif any(p.data_ptr() == out.data_ptr() for p in parts[2:]):
            acc, rest = parts[0] + parts[1], parts[2:]  # into rank >= 2's own copy: read it before writing it
        else:
            acc, rest = torch.add(parts[0], parts[1], out=out), parts[2:]  # two halves: float32, rounded once
        for p in rest:
            acc.add_(p)
        if self._divisor is not None:
            # Summing the whole tensor and dividing it afterwards would give the same bits, at another pass over
            # memory: here the shard was just written and is still in cache.
            # By a power of two (2, 4, 8 ranks) a multiplication by the inverse is exact, so it gives the division's
            # bits, and CPUs divide several times slower than they multiply (~6x for float32 here).
            d = self._divisor
            if math.frexp(d)[0] == 0.5:
                acc.mul_(1.0 / d)
            else:
                acc.div_(d)
        if acc is not out:
            out.copy_(acc)

    def _check(self, seq: int, kind: int, numel: int, place: int, describe: Callable) -> None:
        # After the first step of a collective every peer has announced it: catch a mismatch instead of summing
        # unrelated memory.
        for p in range(self.n):
            theirs = tuple(v.value for v in self._desc[p][seq & 1])
            if theirs != (kind, numel, place):
                what = _describe_kind(*theirs[:2])
                if theirs[:2] == (kind, numel) and kind & 15 == REDUCE_TENSORS:
                    what += f" as {theirs[2]} tensors (rank {self.rank}: {place})"
                elif theirs[:2] == (kind, numel):  # a shared all_reduce of another place in the buckets' memory
                    what += f" at {theirs[2] & ((1 << 40) - 1)} bytes into region {theirs[2] >> 40}"
                raise RuntimeError(
                    f"fanfold shm transport: rank {self.rank} is in {describe()[0]} but rank {p} is in "
                    f"{what}: every rank must issue the same collectives, with the same "
                    "shapes and dtypes, in the same order")

    def run(self, op: int, flat: torch.Tensor | None, seq: int, bucket: int | None, src: int = 0,
            shared: tuple[list[torch.Tensor], int] | None = None, divisor: float | None = None,
            outs: list[torch.Tensor] | None = None, settle: bool = True, compress: tuple | None = None) -> None:
        """Collective number ``seq``; ``shared``: (every rank's copy of ``flat``, by rank, and where it lies) for
        a tensor in memory from :meth:`ShmTransport.allocate`, summed in place without a copy into the ring;
        ``divisor``: an all-reduce's sum is divided by it (an average); ``outs`` (REDUCE_INTO of a shared tensor):
        private tensors, in order, that receive the result instead of ``flat``; REDUCE_TENSORS: ``outs`` are private
        tensors all-reduced in place by reading the peers' memory (``flat`` is the first of them); ``settle`` and
        ``compress`` (dtype, pre_divisor): see :meth:`PeerReader.run`."""
        self._divisor = divisor
        numel = sum(t.numel() for t in outs) if op == REDUCE_TENSORS else 0 if flat is None else flat.numel()
        kind = op | (0 if flat is None else DTYPES.index(flat.dtype) + 1) << 4 | src << 12
        if compress is not None:  # ranks that round to different types must not sum: part of what is checked
            kind |= (DTYPES.index(compress[0]) + 1) << 24
        place = len(outs) if op == REDUCE_TENSORS else shared[1] if shared is not None else 0
        d = self._desc[self.rank][seq & 1]
        d[0].value, d[1].value, d[2].value = kind, numel, place
        cap = self.chunk_bytes // (flat.element_size() if flat is not None else 1)
        if op == SHARED_ALL_REDUCE:
            cap *= self.n  # a chunk holds one shard of chunk_bytes per rank
        count = max(1, -(-numel // cap))
        where = f"#{seq}" + ("" if bucket is None else f" (bucket {bucket})")

        def describe(i: int) -> Callable:
            return lambda: (f"{_describe_kind(kind, numel)} {where}, chunk {i + 1} of {count}", seq, bucket)

        if op == BARRIER:
            self.seg.wait_all(self.seg.arrive(), describe(0))
            self._check(seq, kind, numel, place, describe(0))
            return
        if op == SHARED_ALL_REDUCE:
            self._shared_all_reduce(shared[0], cap, describe, (seq, kind, numel, place))
            return
        if op == REDUCE_TENSORS:
            self._peer.run(outs, describe, lambda: self._check(seq, kind, numel, place, describe(0)), settle,
                           *(compress or ()))
            return
        if op == REDUCE_INTO:
            self._reduce_into(shared[0], outs, cap, describe, (seq, kind, numel, place))
            return
        chunks = [flat[i * cap:][:cap] for i in range(count)]
        if op == ALL_REDUCE and cap * flat.element_size() > self.direct_bytes:
            for i, chunk in enumerate(chunks):
                self._reduce_scatter_gather(chunk, describe(i), i == 0 and (seq, kind, numel, place))
            return
        # Direct all-reduce, or broadcast: write chunk i + 1 before reading chunk i (look-ahead of one).
        write = self._write_slot if op == ALL_REDUCE else self._write_result if self.rank == src else self._skip
        ahead = write(chunks[0], describe(0))
        for i, chunk in enumerate(chunks):
            g, slots, result = ahead
            if i + 1 < count:
                ahead = write(chunks[i + 1], describe(i + 1))
            self.seg.wait_all(g + 1, describe(i))
            if i == 0:
                self._check(seq, kind, numel, place, describe(0))
            c = chunk.numel()
            if op == ALL_REDUCE:
                self._sum([s[:c] for s in slots], chunk)
            elif self.rank != src:
                chunk.copy_(result[:c])

    def _write_slot(self, chunk: torch.Tensor, describe: Callable) -> tuple:
        g, slots, result = self._step(chunk.dtype, describe)
        slots[self.rank][: chunk.numel()].copy_(chunk)
        self.seg.arrive()
        return g, slots, result

    def _write_result(self, chunk: torch.Tensor, describe: Callable) -> tuple:
        g, slots, result = self._step(chunk.dtype, describe)
        result[: chunk.numel()].copy_(chunk)
        self.seg.arrive()
        return g, slots, result

    def _skip(self, chunk: torch.Tensor, describe: Callable) -> tuple:
        g, slots, result = self._step(chunk.dtype, describe)
        self.seg.arrive()
        return g, slots, result

    def _reduce_scatter_gather(self, chunk: torch.Tensor, describe: Callable, check: Any) -> None:
        # Two steps, no look-ahead: the second step publishes this rank's reduced shard.
        c = chunk.numel()
        g, slots, _ = self._write_slot(chunk, describe)
        self.seg.wait_all(g + 1, describe)
        if check:
            self._check(*check, describe)
        align = max(1, 64 // chunk.element_size())  # shard edges on cache lines: no two writers share one
        per = -(-c // self.n // align) * align if c >= self.n * align else -(-c // self.n)
        lo, hi = min(c, self.rank * per), min(c, (self.rank + 1) * per)
        g, _, result = self._step(chunk.dtype, describe)
        if hi > lo:
            self._sum([s[lo:hi] for s in slots], result[lo:hi])
        self.seg.arrive()
        self.seg.wait_all(g + 1, describe)
        chunk.copy_(result[:c])

    def _shared_all_reduce(self, parts: list[torch.Tensor], cap: int, describe: Callable, check: tuple) -> None:
        # Every rank's tensor is readable by all: rank r sums shard r of each chunk from all copies into its own,
        # then copies the peers' summed shards out of theirs -- half the memory traffic of the ring (no copy in,
        # each element summed once). Shard edges sit on cache lines, so no two writers share one.
        mine, c = parts[self.rank], parts[0].numel()
        align = max(1, 64 // mine.element_size())
        per = -(-cap // self.n // align) * align
        count = max(1, -(-c // cap))
        start = self.seg.arrive()  # this rank's tensor is complete: peers may read it
        self.seg.wait_all(start, describe(0))
        self._check(*check, describe(0))

        def fetch(j: int) -> None:  # the peers' summed shards of chunk j, published at step start + j + 1
            base = j * cap
            for p in range(self.n):
                lo, hi = min(c, base + p * per), min(c, base + (p + 1) * per, base + cap)
                if p != self.rank and hi > lo:
                    mine[lo:hi].copy_(parts[p][lo:hi])

        # Summing never waits for a peer: a descheduled peer (2 cores, 4 busy threads) only delays the fetches,
        # which are done as soon as their chunk is ready, and waited for at the end.
        fetched = 0
        for i in range(count):
            lo, hi = min(c, i * cap + self.rank * per), min(c, i * cap + (self.rank + 1) * per, (i + 1) * cap)
            if hi > lo:
                self._sum([p[lo:hi] for p in parts], mine[lo:hi])
            self.seg.arrive()
            while fetched <= i and self.seg.reached(start + fetched + 1):
                fetch(fetched)
                fetched += 1
        for j in range(fetched, count):
            self.seg.wait_all(start + j + 1, describe(j))
            fetch(j)
        # A peer may still be copying this rank's shards: the caller must not touch the tensor before they are done.
        self.seg.wait_all(self.seg.arrive(), describe(count - 1))


    def _reduce_into(self, parts: list[torch.Tensor], outs: list[torch.Tensor], cap: int, describe: Callable,
                     check: tuple) -> None:
        # Every rank sums every element from all copies, in rank order, straight into its own private outputs (the
        # parameters' .grad): nothing is written back into shared memory, nothing fetched, nothing copied out
        # afterwards. Per rank that is N reads and one write per element, against the in-place algorithm's shard
        # sum, fetch and the caller's copy out: fewer bytes up to 3 ranks (the transport uses it only there).
        start = self.seg.arrive()  # this rank's copy is complete: peers may read it
        self.seg.wait_all(start, describe(0))
        self._check(*check, describe(0))
        offset = 0
        for out in outs:
            m = out.numel()
            for lo in range(0, m, cap):  # chunk by chunk: the division finds its chunk in cache
                hi = min(m, lo + cap)
                self._sum([p[offset + lo: offset + hi] for p in parts], out[lo:hi])
            offset += m
        # A peer may still be reading this rank's copy: the caller must not rewrite it before they are done.
        self.seg.wait_all(self.seg.arrive(), describe(max(0, -(-offset // cap) - 1)))


def _describe_kind(kind: int, numel: int) -> str:
    op, dtype, src, narrow = kind & 15, (kind >> 4) & 255, (kind >> 12) & 0xFFF, (kind >> 24) & 15
    name = OPS.get(op, f"an unknown collective ({kind})")
    if op == BARRIER:
        return name
    what = f"{name} of {numel} {str(DTYPES[dtype - 1]).replace('torch.', '')}" if 0 < dtype <= len(DTYPES) else name
    if 0 < narrow <= len(DTYPES):
        what += f" rounded to {str(DTYPES[narrow - 1]).replace('torch.', '')}"
    return what + (f" from rank {src}" if op == BROADCAST else "")


