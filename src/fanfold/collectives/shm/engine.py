"""The shared-memory transport's ring: all_reduce, broadcast, barrier, all_gather, reduce_scatter and all_to_all as
numbered steps over the ring of areas of a :class:`~fanfold.collectives.shm.segment.Segment` (each rank writes its
slot, then reads what its peers wrote), the small all_reduce on the caller's thread, and the rank-ordered folds
that every algorithm sums with; the peer reads (``peer.py``) are dispatched from here too.

Layer: between ``segment.py`` / ``peer.py`` and ``thread.py`` (the thread that runs it). An :class:`Engine` runs on
one thread at a time.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from .peer import PeerReader, gather_from_peers, scatter_tensors
from .request import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    BARRIER,
    DTYPES,
    GATHER_PEERS,
    HEADER_BYTES,
    MAX,
    MIN,
    PRODUCT,
    REDUCE_SCATTER,
    REDUCE_TENSORS,
    SCATTER_TENSORS,
    SUM,
    Collective,
    Header,
    HeaderWords,
)
from .segment import Segment

__all__ = ["Engine", "combine", "ShmMismatchError"]

_DESC = 16  # in a rank's line (after counter and pid), the headers of its current collective, by seq parity
_FOLD = {MIN: torch.minimum, MAX: torch.maximum, PRODUCT: torch.mul}
_HALVES = (torch.bfloat16, torch.float16)


def combine(parts: list[torch.Tensor], out: torch.Tensor, op: int, scratch: torch.Tensor) -> None:
    """``out`` = ``parts[0]`` op ``parts[1]`` op ... in rank order, for op MIN, MAX or PRODUCT. ``out`` may be one
    of ``parts`` (a rank's own copy in shared memory); ``scratch``: float32 memory for at least ``out.numel()``
    values. MIN and MAX are exact in any dtype (a NaN on any rank gives NaN, as ``torch.minimum``); PRODUCT rounds
    like the sum: several half-precision values are multiplied in float32 and rounded once."""
    fold = _FOLD[op]
    if op == PRODUCT and out.dtype in _HALVES and len(parts) > 2:
        acc, rest = scratch[: out.numel()].copy_(parts[0]), parts[1:]  # several halves: in float32, rounded once
    elif any(p.data_ptr() == out.data_ptr() for p in parts[2:]):
        acc, rest = fold(parts[0], parts[1]), parts[2:]  # out is a later rank's own copy: read it before writing it
    else:
        acc, rest = fold(parts[0], parts[1], out=out), parts[2:]
    for p in rest:
        fold(acc, p, out=acc)
    if acc is not out:
        out.copy_(acc)


class ShmMismatchError(RuntimeError):
    """Rank ``rank``, in collective ``seq_text`` (what, number, chunk), found rank ``peer`` in another one under
    the same number: ``field`` says what differs ("collective", "op", "dtype", "size", "tensors", "root",
    "compression"), ``detail`` both sides."""

    def __init__(self, message: str, *, rank: int, peer: int, seq: int, seq_text: str, field: str, detail: str):
        super().__init__(message)
        self.rank, self.peer, self.seq, self.seq_text = rank, peer, seq, seq_text
        self.field, self.detail = field, detail


def _differs(theirs: Header, mine: Header) -> str:
    for field, name in (("op", "collective"), ("reduce", "op"), ("dtype", "dtype"), ("numel", "size"),
                        ("place", "tensors"), ("src", "root"), ("narrow", "compression")):
        if getattr(theirs, field) != getattr(mine, field):
            return name
    return "collective"


class Engine:
    """The algorithms over one segment; runs on the transport's thread only.

    Every rank publishes numbered steps (``Segment.arrive``); step g writes area g % ``areas`` of the ring. A rank
    finishes reading step x before it publishes step x + 2 (one chunk of look-ahead: chunk i + 1 is written before
    chunk i is summed), so step g may rewrite its area once every peer's count reached g - areas + 3. With 8 areas a
    rank runs up to 5 steps ahead of a descheduled peer: the two take turns in bursts, not at every chunk.
    """

    def __init__(self, segment: Segment, rank: int, world_size: int, chunk_bytes: int, areas: int,
                 tables: torch.Tensor | None = None):
        """``tables``: the peer-read tables' memory in the segment, when every rank may read its peers' memory
        (``peer.py``); None otherwise."""
        self.seg, self.rank, self.n = segment, rank, world_size
        self.chunk_bytes, self.areas = chunk_bytes, areas
        self._views: dict[torch.dtype, list] = {}
        self.written: list[Header | None] = [None, None]  # the latency path's header in place, by seq parity
        self._small: dict[tuple, tuple] = {}  # the latency path's (area, dtype, shape) -> (slot views, header)
        self._seen = 0  # every peer's count had reached this at the last small all_reduce
        self._scratch = torch.empty(chunk_bytes // 2, dtype=torch.float32)  # a chunk of half values, widened
        self._divisor = None  # of the collective being run: its sums are divided while the chunk is in cache
        self._reduce = SUM  # of the collective being run: what sum_into computes (request.py)
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
        self._small.clear()
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
                elif same:  # REDUCE_TENSORS, SCATTER_TENSORS: as many tensors
                    what += f" as {theirs.place} tensors (rank {self.rank}: {mine.place})"
                doing = describe()[0]
                raise ShmMismatchError(
                    f"fanfold shm transport: rank {self.rank} is in {doing} but rank {p} is in "
                    f"{what}: every rank must issue the same collectives, with the same "
                    "shapes and dtypes, in the same order", rank=self.rank, peer=p, seq=seq, seq_text=doing,
                    field=_differs(theirs, mine), detail=f"rank {p} is in {what}")

    def run(self, c: Collective) -> None:
        """Run collective ``c`` (see :class:`~fanfold.collectives.shm.request.Collective` for its fields)."""
        op, flat, seq = c.op, c.flat, c.seq
        self._divisor, self._reduce = c.divisor, c.reduce
        if c.timeout is not None:
            self.seg.timeout = c.timeout
        # all_to_all's lengths may differ by rank: its first step checks every pair of splits instead
        peer = op in (REDUCE_TENSORS, SCATTER_TENSORS)  # c.outs: the tensors, read where they lie
        numel = (sum(t.numel() for t in c.outs) if peer else 0 if flat is None or op == ALL_TO_ALL else flat.numel())
        place = len(c.outs) if peer else 0
        header = Header.of(c, numel, place)
        header.write(self._desc[self.rank][seq & 1])
        self.written[seq & 1] = None
        cap = self.chunk_bytes // (flat.element_size() if flat is not None else 1)
        count = max(1, -(-numel // cap))
        where = f"#{seq}" + ("" if c.bucket is None else f" (bucket {c.bucket})")
        if op in (ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL):
            _EXCHANGES[op](self, c, header, where)
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
        if peer:
            check = lambda: self.check(seq, header, describe(0))  # noqa: E731
            if op == REDUCE_TENSORS:
                self._peer.run(c.outs, describe, check, c.settle, *(c.compress or ()))
            else:
                scatter_tensors(self._peer, c.outs, c.out, describe, check, c.settle, *(c.compress or ()))
            return
        chunks = [flat[i * cap:][:cap] for i in range(count)]
        if op == ALL_REDUCE and c.shards:
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

    def run_small(self, t: torch.Tensor, divisor: float | None, seq: int, bucket: int | None) -> None:
        """The latency path: collective number ``seq``, an all_reduce of contiguous ``t`` (at most a quarter chunk;
        the ring's direct sum of one chunk, step for step, so a peer running ``run`` meets it) on the calling
        thread, with nothing made per call but a closure: the slot views and the header are made once per area,
        dtype and shape."""
        seg, g = self.seg, self.seg.arrived
        key = (g % self.areas, t.dtype, t.shape)
        views = self._small.get(key)
        if views is None:
            if len(self._small) > 512:
                self._small.clear()
            m = t.numel()
            views = self._small[key] = ([s[:m].view(t.shape) for s in self.area(t.dtype, g)[: self.n]],
                                        Header(ALL_REDUCE, DTYPES.index(t.dtype) + 1, 0, 0, m, 0))
        slots, header = views
        describe = lambda: self._describe_small(header, seq, bucket)  # noqa: E731 - only called on an error
        if g + 3 - self.areas > self._seen:  # the area's last readers (see Engine.step): seen done last time
            seg.wait_all(g + 3 - self.areas, describe)
        if self.written[seq & 1] is not header:  # the same small collective again: its words are in place
            header.write(self.desc_words(seq))
            self.written[seq & 1] = header
        slots[self.rank].copy_(t)
        seg.arrive()
        seg.wait_all(g + 1, describe)
        self._seen = g + 1
        self.check(seq, header, describe)
        if self.n == 2 and divisor is None:
            torch.add(slots[0], slots[1], out=t)  # Engine.sum_into's two-part case, without its checks
        else:
            self.set_sum(divisor)
            self.sum_into(slots, t)

    @staticmethod
    def _describe_small(header: Header, seq: int, bucket: int | None) -> tuple:
        where = f"#{seq}" + ("" if bucket is None else f" (bucket {bucket})")
        return f"{header.describe()} {where}, chunk 1 of 1", seq, bucket


def _describe(header: Header, where: str, count: int, bucket: int | None, seq: int) -> Callable:
    def describe(i: int) -> Callable:
        return lambda: (f"{header.describe()} {where}, chunk {i + 1} of {count}", seq, bucket)
    return describe


def _pipeline(engine: Any, dtype: torch.dtype, count: int, write: Callable, read: Callable, describe: Callable,
              check: Callable[[], None]) -> None:
    # Step i + 1 is written before step i is read (look-ahead of one), as the direct all-reduce does: a rank
    # finishes reading step x before it publishes step x + 2, the engine's rule for reusing an area.
    def post(i: int) -> tuple[int, list[torch.Tensor]]:
        g, slots, _ = engine.step(dtype, describe(i))
        write(i, slots[engine.rank])
        engine.seg.arrive()
        return g, slots

    ahead = post(0)
    for i in range(count):
        g, slots = ahead
        if i + 1 < count:
            ahead = post(i + 1)
        engine.seg.wait_all(g + 1, describe(i))
        if i == 0:
            check()
        read(i, slots)


def _all_gather(engine: Any, c: Collective, header: Header, where: str) -> None:
    flat, out, n = c.flat, c.out, engine.n
    m, cap = flat.numel(), engine.chunk_bytes // flat.element_size()
    count = max(1, -(-m // cap))
    describe = _describe(header, where, count, c.bucket, c.seq)

    def write(i: int, slot: torch.Tensor) -> None:
        part = flat[i * cap:][:cap]
        slot[: part.numel()].copy_(part)

    # in place (flat is this rank's part of out): that part already holds what its slot would give back
    own = flat.data_ptr() == out.data_ptr() + engine.rank * m * flat.element_size() if m else False

    def read(i: int, slots: list[torch.Tensor]) -> None:
        lo = i * cap
        size = max(0, min(cap, m - lo))
        for p in range(n):
            if not (own and p == engine.rank):
                out[p * m + lo:][:size].copy_(slots[p][:size])

    _pipeline(engine, flat.dtype, count, write, read, describe, lambda: engine.check(c.seq, header, describe(0)))


def _reduce_scatter(engine: Any, c: Collective, header: Header, where: str) -> None:
    flat, out, n, rank = c.flat, c.out, engine.n, engine.rank
    m = out.numel()
    k = engine.chunk_bytes // flat.element_size() // n  # a step carries k elements of each destination's shard
    count = max(1, -(-m // k))
    describe = _describe(header, where, count, c.bucket, c.seq)

    def write(i: int, slot: torch.Tensor) -> None:
        lo = i * k
        size = max(0, min(k, m - lo))
        for q in range(n):
            slot[q * k:][:size].copy_(flat[q * m + lo:][:size])

    def read(i: int, slots: list[torch.Tensor]) -> None:
        lo = i * k
        size = max(0, min(k, m - lo))
        if size:  # rank order, as an all_reduce sums this shard
            engine.sum_into([s[rank * k:][:size] for s in slots], out[lo:][:size])

    _pipeline(engine, flat.dtype, count, write, read, describe, lambda: engine.check(c.seq, header, describe(0)))


def _all_to_all(engine: Any, c: Collective, header: Header, where: str) -> None:
    flat, out, n, rank = c.flat, c.out, engine.n, engine.rank
    send, recv = c.splits
    # First step: every rank publishes what it sends to and expects from each rank, so that every rank checks
    # every pair (and all raise the same error) before any data moves.
    describe = _describe(header, where, 1, c.bucket, c.seq)
    g, slots, _ = engine.step(torch.int64, describe(0))
    slots[rank][: 2 * n].copy_(torch.tensor(list(send) + list(recv), dtype=torch.int64))
    engine.seg.arrive()
    engine.seg.wait_all(g + 1, describe(0))
    engine.check(c.seq, header, describe(0))
    table = [slots[p][: 2 * n].tolist() for p in range(n)]
    for p in range(n):
        for q in range(n):
            if table[p][q] != table[q][n + p]:
                raise RuntimeError(
                    f"fanfold shm transport: all_to_all #{c.seq}: rank {p} sends {table[p][q]} elements to rank {q}, "
                    f"which expects {table[q][n + p]} from it: every rank's output splits must match what the "
                    "others send it")
    k = engine.chunk_bytes // flat.element_size() // n  # a step carries k elements for each destination
    count = max(-(-table[p][q] // k) for p in range(n) for q in range(n))
    if count == 0:
        return
    send_at = [sum(send[:q]) for q in range(n)]
    recv_at = [sum(recv[:p]) for p in range(n)]
    describe = _describe(header, where, count, c.bucket, c.seq)

    def write(i: int, slot: torch.Tensor) -> None:
        for q in range(n):
            size = max(0, min(k, send[q] - i * k))
            slot[q * k:][:size].copy_(flat[send_at[q] + i * k:][:size])

    def read(i: int, slots: list[torch.Tensor]) -> None:
        for p in range(n):
            size = max(0, min(k, recv[p] - i * k))
            out[recv_at[p] + i * k:][:size].copy_(slots[p][rank * k:][:size])

    _pipeline(engine, flat.dtype, count, write, read, describe, lambda: None)


_EXCHANGES = {ALL_GATHER: _all_gather, REDUCE_SCATTER: _reduce_scatter, ALL_TO_ALL: _all_to_all}
