"""The algorithms of the shared-memory transport: all_reduce, broadcast and barrier as numbered steps over the
ring of areas of a :class:`~fanfold.collectives.shm.segment.Segment` (all_gather, reduce_scatter and all_to_all
are in ``exchange.py``, on the same steps).

Layer: between ``segment.py`` (memory, counters, bounded waits) and ``thread.py`` / ``transport.py`` (the thread
that runs it, the transport that queues collectives). An :class:`Engine` runs on one thread at a time.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from .exchange import run_exchange
from .gather import gather_from_peers
from .peer import PeerReader
from .reduce_ops import SUM, combine
from .request import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    BARRIER,
    GATHER_PEERS,
    HEADER_BYTES,
    REDUCE_INTO,
    REDUCE_SCATTER,
    REDUCE_TENSORS,
    SCATTER_TENSORS,
    SHARED_ALL_REDUCE,
    Collective,
    Header,
    HeaderWords,
)
from .scatter import scatter_tensors
from .segment import Segment

__all__ = ["Engine"]

_DESC = 16  # in a rank's line (after counter and pid), the headers of its current collective, by seq parity


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
        self.written: list[Header | None] = [None, None]  # the latency path's header in place, by seq parity
        self._scratch = torch.empty(chunk_bytes // 2, dtype=torch.float32)  # a chunk of half values, widened
        self._divisor = None  # of the collective being run: its sums are divided while the chunk is in cache
        self._reduce = SUM  # of the collective being run: what sum_into computes (reduce_ops.py)
        self._peer = None if tables is None else PeerReader(segment, rank, world_size, tables, chunk_bytes,
                                                            self.sum_into)
        # Parity: a rank rewrites descriptor seq % 2 only after the first step of seq + 1 completed, which its peers
        # publish only once they have checked collective seq.
        self._desc = [[segment.line(r, HeaderWords, _DESC + HEADER_BYTES * b) for b in (0, 1)]
                      for r in range(world_size)]

    def close(self) -> None:
        """Drop this engine's views of the segment (they would keep it mapped: ``Segment.close``); the peer reader
        goes too, which also breaks its reference cycle through ``sum_into``. The engine runs nothing after this."""
        self._views.clear()
        self._peer = None

    def step(self, dtype: torch.dtype, describe: Callable) -> tuple[int, list[torch.Tensor], torch.Tensor]:
        """The next step's number, and its area's slots 0..N-1 and result, as ``dtype`` views, once reusable."""
        g = self.seg.arrived
        if g + 3 > self.areas:
            self.seg.wait_all(g + 3 - self.areas, describe)
        area = self.area(dtype, g)
        return g, area[: self.n], area[self.n]

    def area(self, dtype: torch.dtype, g: int) -> list[torch.Tensor]:
        # step g's area: slots 0..N-1 and the result, as ``dtype`` views (made once per dtype)
        if dtype not in self._views:
            cap, data = self.chunk_bytes, self.seg.data
            self._views[dtype] = [[data[(b * (self.n + 1) + a) * cap:][:cap].view(dtype) for a in range(self.n + 1)]
                                  for b in range(self.areas)]
        return self._views[dtype][g % self.areas]

    def desc_words(self, seq: int) -> HeaderWords:
        """This rank's header words for collective ``seq`` (by parity)."""
        return self._desc[self.rank][seq & 1]

    def set_sum(self, divisor: float | None) -> None:
        """What ``sum_into`` computes next: the sum (divided by ``divisor``), whatever the last collective was."""
        self._divisor, self._reduce = divisor, SUM

    def sum_into(self, parts: list[torch.Tensor], out: torch.Tensor) -> None:
        # Rank order, every time: the bits depend only on the inputs, not on which rank sums or how fast it is.
        if self._reduce != SUM:  # MIN, MAX, PRODUCT: the same rank order and rounding rule, no divisor
            combine(parts, out, self._reduce, self._scratch)
            return
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

    def check(self, seq: int, mine: Header, describe: Callable) -> None:
        # After the first step of a collective every peer has announced it: catch a mismatch instead of summing
        # unrelated memory.
        own = bytes(self._desc[self.rank][seq & 1])  # what this rank published: ``mine``
        for p in range(self.n):
            if bytes(self._desc[p][seq & 1]) == own:  # one compare of the words, no objects: the common case
                continue
            theirs = Header.read(self._desc[p][seq & 1])
            if theirs != mine:
                what = theirs.describe()
                same = replace(theirs, place=mine.place) == mine
                if theirs.reduce != mine.reduce:
                    what += f" (op {theirs.reduce_name()}; rank {self.rank}'s: {mine.reduce_name()})"
                elif same and mine.op in (REDUCE_TENSORS, SCATTER_TENSORS):
                    what += f" as {theirs.place} tensors (rank {self.rank}: {mine.place})"
                elif same:  # a shared all_reduce of another place in the buckets' memory
                    what += f" at {theirs.place & ((1 << 40) - 1)} bytes into region {theirs.place >> 40}"
                raise RuntimeError(
                    f"fanfold shm transport: rank {self.rank} is in {describe()[0]} but rank {p} is in "
                    f"{what}: every rank must issue the same collectives, with the same "
                    "shapes and dtypes, in the same order")

    def run(self, c: Collective) -> None:
        """Run collective ``c`` (see :class:`~fanfold.collectives.shm.request.Collective` for its fields)."""
        op, flat, seq = c.op, c.flat, c.seq
        self._divisor, self._reduce = c.divisor, c.reduce
        # all_to_all's lengths may differ by rank: its first step checks every pair of splits instead
        peer = op in (REDUCE_TENSORS, SCATTER_TENSORS)  # c.outs: the tensors, read where they lie
        numel = (sum(t.numel() for t in c.outs) if peer else 0 if flat is None or op == ALL_TO_ALL else flat.numel())
        place = len(c.outs) if peer else c.shared[1] if c.shared is not None else 0
        header = Header.of(c, numel, place)
        header.write(self._desc[self.rank][seq & 1])
        self.written[seq & 1] = None
        cap = self.chunk_bytes // (flat.element_size() if flat is not None else 1)
        if op == SHARED_ALL_REDUCE:
            cap *= self.n  # a chunk holds one shard of chunk_bytes per rank
        count = max(1, -(-numel // cap))
        where = f"#{seq}" + ("" if c.bucket is None else f" (bucket {c.bucket})")
        if op in (ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL):
            run_exchange(self, c, header, where)
            return

        def describe(i: int) -> Callable:
            return lambda: (f"{header.describe()} {where}, chunk {i + 1} of {count}", seq, c.bucket)

        if op == GATHER_PEERS:
            gather_from_peers(self._peer, flat, c.out, describe, lambda: self.check(seq, header, describe(0)))
            return
        if op == BARRIER:
            self.seg.wait_all(self.seg.arrive(), describe(0))
            self.check(seq, header, describe(0))
            return
        if op == SHARED_ALL_REDUCE:
            self._shared_all_reduce(c.shared[0], cap, describe, (seq, header))
            return
        if peer:
            check = lambda: self.check(seq, header, describe(0))  # noqa: E731
            if op == REDUCE_TENSORS:
                self._peer.run(c.outs, describe, check, c.settle, *(c.compress or ()))
            else:
                scatter_tensors(self._peer, c.outs, c.out, describe, check, c.settle, *(c.compress or ()))
            return
        if op == REDUCE_INTO:
            self._reduce_into(c.shared[0], c.outs, cap, describe, (seq, header))
            return
        chunks = [flat[i * cap:][:cap] for i in range(count)]
        if op == ALL_REDUCE and cap * flat.element_size() > self.direct_bytes:
            for i, chunk in enumerate(chunks):
                self._reduce_scatter_gather(chunk, describe(i), i == 0 and (seq, header))
            return
        # Direct all-reduce, or broadcast: write chunk i + 1 before reading chunk i (look-ahead of one).
        src = c.src
        write = self._write_slot if op == ALL_REDUCE else self._write_result if self.rank == src else self._skip
        ahead = write(chunks[0], describe(0))
        for i, chunk in enumerate(chunks):
            g, slots, result = ahead
            if i + 1 < count:
                ahead = write(chunks[i + 1], describe(i + 1))
            self.seg.wait_all(g + 1, describe(i))
            if i == 0:
                self.check(seq, header, describe(0))
            m = chunk.numel()
            if op == ALL_REDUCE:
                self.sum_into([s[:m] for s in slots], chunk)
            elif self.rank != src:
                chunk.copy_(result[:m])

    def _write_slot(self, chunk: torch.Tensor, describe: Callable) -> tuple:
        g, slots, result = self.step(chunk.dtype, describe)
        slots[self.rank][: chunk.numel()].copy_(chunk)
        self.seg.arrive()
        return g, slots, result

    def _write_result(self, chunk: torch.Tensor, describe: Callable) -> tuple:
        g, slots, result = self.step(chunk.dtype, describe)
        result[: chunk.numel()].copy_(chunk)
        self.seg.arrive()
        return g, slots, result

    def _skip(self, chunk: torch.Tensor, describe: Callable) -> tuple:
        g, slots, result = self.step(chunk.dtype, describe)
        self.seg.arrive()
        return g, slots, result

    def _reduce_scatter_gather(self, chunk: torch.Tensor, describe: Callable, check: Any) -> None:
        # Two steps, no look-ahead: the second step publishes this rank's reduced shard.
        c = chunk.numel()
        g, slots, _ = self._write_slot(chunk, describe)
        self.seg.wait_all(g + 1, describe)
        if check:
            self.check(*check, describe)
        align = max(1, 64 // chunk.element_size())  # shard edges on cache lines: no two writers share one
        per = -(-c // self.n // align) * align if c >= self.n * align else -(-c // self.n)
        lo, hi = min(c, self.rank * per), min(c, (self.rank + 1) * per)
        g, _, result = self.step(chunk.dtype, describe)
        if hi > lo:
            self.sum_into([s[lo:hi] for s in slots], result[lo:hi])
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
        self.check(*check, describe(0))

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
                self.sum_into([p[lo:hi] for p in parts], mine[lo:hi])
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
        self.check(*check, describe(0))
        offset = 0
        for out in outs:
            m = out.numel()
            for lo in range(0, m, cap):  # chunk by chunk: the division finds its chunk in cache
                hi = min(m, lo + cap)
                self.sum_into([p[offset + lo: offset + hi] for p in parts], out[lo:hi])
            offset += m
        # A peer may still be reading this rank's copy: the caller must not rewrite it before they are done.
        self.seg.wait_all(self.seg.arrive(), describe(max(0, -(-offset // cap) - 1)))

