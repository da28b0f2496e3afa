"""The shared-memory transport's engine: the codes of its collectives and reductions, the :class:`Header` each rank
publishes for its peers to check, the ring (numbered steps over the segment's areas: each rank writes its slot, then
reads its peers') and the rank-ordered fold every algorithm sums with; :meth:`Engine.run` also starts the peer reads.
"""
from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .peer import PeerReader
from .segment import Segment

__all__ = ["Engine", "combine", "ShmMismatchError", "Collective", "Header", "DTYPES", "OPS", "reduce_code"]

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8]
# The ring's (ALL_REDUCE .. ALL_TO_ALL, through the segment's slots) and the peer reads' (REDUCE_TENSORS,
# SCATTER_TENSORS, GATHER_PEERS: straight from the peers' tensors)
(ALL_REDUCE, BROADCAST, BARRIER, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, REDUCE_TENSORS, SCATTER_TENSORS,
 GATHER_PEERS) = range(1, 10)
OPS = {ALL_REDUCE: "all_reduce", BROADCAST: "broadcast", BARRIER: "barrier", REDUCE_TENSORS: "all_reduce",
       ALL_GATHER: "all_gather", REDUCE_SCATTER: "reduce_scatter", ALL_TO_ALL: "all_to_all",
       SCATTER_TENSORS: "reduce_scatter", GATHER_PEERS: "all_gather"}
# SUM is 0: the code of a collective that reduces nothing, too
SUM, MIN, MAX, PRODUCT = range(4)
REDUCE_OPS = {SUM: "sum", MIN: "min", MAX: "max", PRODUCT: "product"}
_CODES = {name: code for code, name in REDUCE_OPS.items()}
_DESC = 16  # in a rank's line (after counter and pid), the headers of its current collective, by seq parity
_FOLD = {SUM: torch.add, MIN: torch.minimum, MAX: torch.maximum, PRODUCT: torch.mul}
_HALVES = (torch.bfloat16, torch.float16)


def reduce_code(op: str, divisor: float | None = None, what: str = "all_reduce") -> int:
    """The code of ``what``'s reduction ``op`` ("sum", "min", "max" or "product"), checked with its ``divisor`` (a
    positive number, with "sum" only)."""
    if op not in _CODES:
        raise ValueError(f"{what}: op must be one of {sorted(_CODES)}, got {op!r}")
    if divisor is not None and not (isinstance(divisor, (int, float)) and divisor > 0):
        raise ValueError(f"{what}: divisor must be a positive number, got {divisor!r}")
    if divisor is not None and op != "sum":
        raise ValueError(f"a divisor (an average) goes with op='sum' only, got op={op!r} and divisor={divisor!r}")
    return _CODES[op]


@dataclass(frozen=True, eq=False)
class Collective:
    """One collective as :meth:`Engine.run` runs it. ``flat``: the 1-d tensor it works on (the input of the exchanges;
    None for a barrier); ``seq``: its number, the same on every rank; ``outs``: the peer reads' tensors; ``out``: the
    exchanges' output; ``splits``: all_to_all's (sent, received) counts; ``timeout``: None keeps the segment's."""

    op: int
    seq: int
    flat: torch.Tensor | None = None
    bucket: int | None = None
    src: int = 0
    divisor: float | None = None
    outs: list[torch.Tensor] | None = None
    settle: bool = True
    compress: tuple[torch.dtype, float | None] | None = None
    out: torch.Tensor | None = None
    splits: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    reduce: int = SUM
    timeout: float | None = None


def _dtype_code(dtype: torch.dtype | None) -> int:
    return 0 if dtype is None else DTYPES.index(dtype) + 1


def _dtype_name(code: int) -> str:
    return str(DTYPES[code - 1]).replace("torch.", "") if 0 < code <= len(DTYPES) else f"dtype #{code}"


class Header(ctypes.Structure):
    """What a rank announces of its current collective, in its segment line: ``dtype`` and ``narrow`` (the dtype a
    compressed all-reduce rounds to) as index + 1 in DTYPES (0: none), ``src`` a broadcast's root, ``place`` how many
    tensors the peer reads sum. Each field in its own word: a mismatch names the field that differs."""

    _fields_ = [("op", ctypes.c_uint16), ("dtype", ctypes.c_uint8), ("reduce", ctypes.c_uint8),
                ("src", ctypes.c_uint16), ("narrow", ctypes.c_uint16), ("numel", ctypes.c_uint64),
                ("place", ctypes.c_uint64)]  # 24 bytes: the line's bytes 64.. are peer.py's

    def fields(self) -> tuple:
        return tuple(getattr(self, name) for name, _ in self._fields_)

    def reduce_name(self) -> str:
        return REDUCE_OPS.get(self.reduce, f"reduction #{self.reduce}").upper()  # torch's ReduceOp names

    def describe(self) -> str:
        name = OPS.get(self.op, f"an unknown collective ({self.op})")
        if self.op == BARRIER:
            return name
        if self.reduce != SUM:  # a sum goes unnamed: it is the reduction of every other collective too
            name += f" ({self.reduce_name()})"
        what = f"{name} of {self.numel} {_dtype_name(self.dtype)}" if self.dtype else name
        if self.narrow:
            what += f" rounded to {_dtype_name(self.narrow)}"
        return what + (f" from rank {self.src}" if self.op == BROADCAST else "")


def combine(parts: list[torch.Tensor], out: torch.Tensor, op: int, scratch: torch.Tensor,
            divisor: float | None = None) -> None:
    """``out`` = ``parts[0]`` op ``parts[1]`` op ... in rank order, a sum then divided by ``divisor``: the bits
    depend only on the inputs, not on which rank folds. ``out`` may be one of ``parts`` (a rank's own copy in shared
    memory); ``scratch``: float32 memory for ``out.numel()`` values, where several half-precision values are summed
    or multiplied and rounded once. MIN and MAX are exact in any dtype (a NaN on any rank gives NaN)."""
    fold = _FOLD[op]
    if op in (SUM, PRODUCT) and out.dtype in _HALVES and len(parts) > 2:
        acc, rest = scratch[: out.numel()].copy_(parts[0]), parts[1:]
    elif any(p.data_ptr() == out.data_ptr() for p in parts[2:]):
        acc, rest = fold(parts[0], parts[1]), parts[2:]  # out is a later rank's own copy: read it before writing it
    else:
        acc, rest = fold(parts[0], parts[1], out=out), parts[2:]  # two halves: computed in float32, rounded once
    for p in rest:
        fold(acc, p, out=acc)
    if divisor is not None:
        # Dividing the shard just written, still in cache, gives the bits of dividing the whole sum afterwards. By a
        # power of two a multiplication by the inverse is exact, and CPUs divide several times slower.
        if math.frexp(divisor)[0] == 0.5:
            acc.mul_(1.0 / divisor)
        else:
            acc.div_(divisor)
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
    """The algorithms over one segment, run on one thread at a time. Step g (``Segment.arrive``) writes area
    g % ``areas``; a rank finishes reading step x before it publishes x + 2 (one chunk of look-ahead), so step g may
    rewrite its area once every peer's count reached g - areas + 3. ``tables``: the peer reads' tables (or None)."""

    def __init__(self, segment: Segment, rank: int, world_size: int, chunk_bytes: int, areas: int,
                 tables: torch.Tensor | None = None):
        self.seg, self.rank, self.n = segment, rank, world_size
        self.chunk_bytes, self.areas = chunk_bytes, areas
        self._views: dict[torch.dtype, list] = {}
        self._small: dict[tuple, tuple] = {}  # the latency path's (area, dtype, shape) -> (slot views, header words)
        self._written: list[bytes | None] = [None, None]  # the latency path's header words in place, by seq parity
        self._seen = 0  # every peer's count had reached this at the last small all_reduce
        self._scratch = torch.empty(chunk_bytes // 2, dtype=torch.float32)  # a chunk of half values, widened
        self._divisor = None  # of the collective being run: its sums are divided while the chunk is in cache
        self._reduce = SUM  # of the collective being run: what sum_into computes
        self._peer = None if tables is None else PeerReader(segment, rank, world_size, tables, chunk_bytes,
                                                            self.sum_into)
        self._desc = [[segment.line(r, Header, _DESC + ctypes.sizeof(Header) * b) for b in (0, 1)]
                      for r in range(world_size)]

    def close(self) -> None:
        # the views would keep the segment mapped (Segment.close); dropping the peer reader breaks its cycle
        self._views.clear()
        self._small.clear()
        self._peer = None

    def step(self, dtype: torch.dtype, describe: Callable) -> tuple[int, list[torch.Tensor]]:
        """The next step's number, and its area (one slot per rank) as ``dtype`` views, once reusable."""
        g = self.seg.arrived
        if g + 3 > self.areas:
            self.seg.wait_all(g + 3 - self.areas, describe)
        return g, self._area(dtype, g)

    def _area(self, dtype: torch.dtype, g: int) -> list[torch.Tensor]:
        if dtype not in self._views:
            cap, data = self.chunk_bytes, self.seg.data
            self._views[dtype] = [[data[(b * self.n + a) * cap:][:cap].view(dtype) for a in range(self.n)]
                                  for b in range(self.areas)]
        return self._views[dtype][g % self.areas]

    def sum_into(self, parts: list[torch.Tensor], out: torch.Tensor) -> None:
        combine(parts, out, self._reduce, self._scratch, self._divisor)

    def check(self, seq: int, mine: Header, describe: Callable) -> None:
        # After the first step of a collective every peer has announced it: catch a mismatch instead of summing
        # unrelated memory.
        own = bytes(mine)
        for p in range(self.n):
            theirs = self._desc[p][seq & 1]
            if bytes(theirs) != own:
                what = theirs.describe()
                if theirs.reduce != mine.reduce:
                    what += f" (op {theirs.reduce_name()}; rank {self.rank}'s: {mine.reduce_name()})"
                elif theirs.fields()[:-1] == mine.fields()[:-1]:  # the peer reads': as many tensors
                    what += f" as {theirs.place} tensors (rank {self.rank}: {mine.place})"
                doing = describe()[0]
                raise ShmMismatchError(
                    f"fanfold shm transport: rank {self.rank} is in {doing} but rank {p} is in "
                    f"{what}: every rank must issue the same collectives, with the same "
                    "shapes and dtypes, in the same order", rank=self.rank, peer=p, seq=seq, seq_text=doing,
                    field=_differs(theirs, mine), detail=f"rank {p} is in {what}")

    def run(self, c: Collective) -> None:
        op, flat, seq = c.op, c.flat, c.seq
        self._divisor, self._reduce = c.divisor, c.reduce
        if c.timeout is not None:
            self.seg.timeout = c.timeout
        # all_to_all's lengths may differ by rank: its first step checks every pair of splits instead
        peer = op in (REDUCE_TENSORS, SCATTER_TENSORS)  # c.outs: the tensors, read where they lie
        numel = (sum(t.numel() for t in c.outs) if peer else 0 if flat is None or op == ALL_TO_ALL else flat.numel())
        # by seq parity: rewritten at seq + 2, after the first step of seq + 1, which a peer reaches only once it
        # has checked collective seq
        header = self._desc[self.rank][seq & 1]
        header.op, header.reduce, header.src, header.numel = op, c.reduce, c.src, numel
        header.dtype = _dtype_code(flat.dtype if flat is not None else None)
        header.narrow = _dtype_code(c.compress[0] if c.compress else None)
        header.place = len(c.outs) if peer else 0
        self._written[seq & 1] = None
        where = _where(seq, c.bucket)
        if op in _RING:
            _RING[op](self, c, header, where)
            return
        cap = self.chunk_bytes // (flat.element_size() if flat is not None else 1)
        describe = _describe(header, where, max(1, -(-numel // cap)), c.bucket, seq)
        check = lambda: self.check(seq, header, describe(0))  # noqa: E731
        if op == BARRIER:
            self.seg.wait_all(self.seg.arrive(), describe(0))
            check()
        elif op == GATHER_PEERS:
            self._peer.all_gather(flat, c.out, describe, check)
        elif op == REDUCE_TENSORS:
            self._peer.all_reduce(c.outs, describe, check, c.settle, *(c.compress or ()))
        else:
            self._peer.reduce_scatter(c.outs, c.out, describe, check, c.settle, *(c.compress or ()))

    def run_small(self, t: torch.Tensor, divisor: float | None, seq: int, bucket: int | None) -> None:
        """The latency path: collective ``seq``, an all_reduce of contiguous ``t`` (at most a quarter chunk) on the
        calling thread, step for step the ring's (a peer running ``run`` meets it), with nothing made per call but a
        closure: the slot views and the header words are made once per area, dtype and shape."""
        seg, g = self.seg, self.seg.arrived
        key = (g % self.areas, t.dtype, t.shape)
        views = self._small.get(key)
        if views is None:
            if len(self._small) > 512:
                self._small.clear()
            words = bytes(Header(op=ALL_REDUCE, dtype=_dtype_code(t.dtype), numel=t.numel()))
            views = self._small[key] = ([s[: t.numel()].view(t.shape) for s in self._area(t.dtype, g)], words)
        slots, words = views
        mine = self._desc[self.rank][seq & 1]
        describe = lambda: _describe(mine, _where(seq, bucket), 1, bucket, seq)(0)()  # noqa: E731 - on an error only
        if g + 3 - self.areas > self._seen:  # the area's last readers (see Engine.step): seen done last time
            seg.wait_all(g + 3 - self.areas, describe)
        if self._written[seq & 1] is not words:  # the same small collective again: its words are in place
            ctypes.memmove(ctypes.addressof(mine), words, len(words))
            self._written[seq & 1] = words
        slots[self.rank].copy_(t)
        seg.arrive()
        seg.wait_all(g + 1, describe)
        self._seen = g + 1
        self.check(seq, mine, describe)
        if self.n == 2 and divisor is None:
            torch.add(slots[0], slots[1], out=t)  # Engine.sum_into's two-part case, without its checks
        else:
            combine(slots, t, SUM, self._scratch, divisor)


def _where(seq: int, bucket: int | None) -> str:
    return f"#{seq}" + ("" if bucket is None else f" (bucket {bucket})")


def _describe(header: Header, where: str, count: int, bucket: int | None, seq: int) -> Callable:
    def describe(i: int) -> Callable:
        return lambda: (f"{header.describe()} {where}, chunk {i + 1} of {count}", seq, bucket)
    return describe


def _pipeline(engine: Any, c: Collective, header: Header, where: str, count: int, write: Callable, read: Callable,
              checked: bool = True) -> None:
    # ``count`` steps, each rank ``write(i, its slot)``, then ``read(i, every rank's slot)``. Step i + 1 is written
    # before step i is read (look-ahead of one): a rank finishes reading step x before it publishes step x + 2, the
    # engine's rule for reusing an area.
    describe = _describe(header, where, count, c.bucket, c.seq)

    def post(i: int) -> tuple[int, list[torch.Tensor]]:
        g, area = engine.step(c.flat.dtype, describe(i))
        write(i, area[engine.rank])
        engine.seg.arrive()
        return g, area

    ahead = post(0)
    for i in range(count):
        g, slots = ahead
        if i + 1 < count:
            ahead = post(i + 1)
        engine.seg.wait_all(g + 1, describe(i))
        if i == 0 and checked:
            engine.check(c.seq, header, describe(0))
        read(i, slots)


def _by_chunks(engine: Any, c: Collective, header: Header, where: str, read: Callable, writes: bool = True) -> None:
    # all_reduce, broadcast and all_gather: chunk i of ``flat`` into this rank's slot (if it ``writes``), then
    # ``read(chunk, its offset, every rank's slot)``
    flat = c.flat
    cap = engine.chunk_bytes // flat.element_size()

    def write(i: int, slot: torch.Tensor) -> None:
        if writes:
            part = flat[i * cap:][:cap]
            slot[: part.numel()].copy_(part)

    _pipeline(engine, c, header, where, max(1, -(-flat.numel() // cap)), write,
              lambda i, slots: read(flat[i * cap:][:cap], i * cap, slots))


def _all_reduce(engine: Any, c: Collective, header: Header, where: str) -> None:
    # every rank sums every slot into its own chunk, in rank order
    _by_chunks(engine, c, header, where, lambda part, lo, slots: engine.sum_into([s[: part.numel()] for s in slots],
                                                                                  part))


def _broadcast(engine: Any, c: Collective, header: Header, where: str) -> None:
    def read(part: torch.Tensor, lo: int, slots: list[torch.Tensor]) -> None:
        if engine.rank != c.src:
            part.copy_(slots[c.src][: part.numel()])

    _by_chunks(engine, c, header, where, read, writes=engine.rank == c.src)


def _all_gather(engine: Any, c: Collective, header: Header, where: str) -> None:
    flat, out, m = c.flat, c.out, c.flat.numel()
    # in place (flat is this rank's part of out): that part already holds what its slot would give back
    own = flat.data_ptr() == out.data_ptr() + engine.rank * m * flat.element_size() if m else False

    def read(part: torch.Tensor, lo: int, slots: list[torch.Tensor]) -> None:
        for p in range(engine.n):
            if not (own and p == engine.rank):
                out[p * m + lo:][: part.numel()].copy_(slots[p][: part.numel()])

    _by_chunks(engine, c, header, where, read)


def _reduce_scatter(engine: Any, c: Collective, header: Header, where: str) -> None:
    flat, out, n, rank = c.flat, c.out, engine.n, engine.rank
    m = out.numel()
    k = engine.chunk_bytes // flat.element_size() // n  # a step carries k elements of each destination's shard

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

    _pipeline(engine, c, header, where, max(1, -(-m // k)), write, read)


def _all_to_all(engine: Any, c: Collective, header: Header, where: str) -> None:
    flat, out, n, rank = c.flat, c.out, engine.n, engine.rank
    send, recv = c.splits
    # First step: every rank publishes what it sends to and expects from each rank, so that every rank checks
    # every pair (and all raise the same error) before any data moves.
    describe = _describe(header, where, 1, c.bucket, c.seq)
    g, slots = engine.step(torch.int64, describe(0))
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

    def write(i: int, slot: torch.Tensor) -> None:
        for q in range(n):
            size = max(0, min(k, send[q] - i * k))
            slot[q * k:][:size].copy_(flat[send_at[q] + i * k:][:size])

    def read(i: int, slots: list[torch.Tensor]) -> None:
        for p in range(n):
            size = max(0, min(k, recv[p] - i * k))
            out[recv_at[p] + i * k:][:size].copy_(slots[p][rank * k:][:size])

    _pipeline(engine, c, header, where, count, write, read, checked=False)


_RING = {ALL_REDUCE: _all_reduce, BROADCAST: _broadcast, ALL_GATHER: _all_gather, REDUCE_SCATTER: _reduce_scatter,
         ALL_TO_ALL: _all_to_all}
