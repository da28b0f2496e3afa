"""The shared-memory transport's engine: the collectives' codes, the :class:`Header` each rank publishes for its
peers to check, the rank-ordered fold, and the two algorithms: the ring (numbered steps over the segment's areas) and
the peer reads (``process_vm_readv`` of the peers' tensors where they lie, where :func:`probe` finds it allowed).
"""
from __future__ import annotations

import bisect
import ctypes
import errno
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from itertools import accumulate
from typing import Any

import torch

from .segment import Segment

__all__ = ["Engine", "combine", "ShmMismatchError", "Collective", "Header", "DTYPES", "OPS", "Op", "SUM",
           "reduce_code", "probe", "allow_peers", "PeerReader", "TABLE_BYTES", "Claim", "GLOO", "REFUSED"]

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8]


class Op(IntEnum):
    """The collectives' codes: the ring's (through the segment's slots), then the peer reads' (the peers' tensors),
    then the claim: one step that only publishes and checks the header of a collective run elsewhere."""

    (ALL_REDUCE, BROADCAST, BARRIER, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, REDUCE_TENSORS, SCATTER_TENSORS,
     GATHER_PEERS, CLAIM) = range(1, 11)


OPS = {op: op.name.lower() for op in Op} | {Op.REDUCE_TENSORS: "all_reduce", Op.SCATTER_TENSORS: "reduce_scatter",
                                            Op.GATHER_PEERS: "all_gather"}
SUM, MIN, MAX, PRODUCT = range(4)  # SUM is 0: the code of a collective that reduces nothing, too
REDUCE_OPS = {SUM: "sum", MIN: "min", MAX: "max", PRODUCT: "product"}
# the header's codes of the reductions only gloo computes (a claim's)
_GLOO_REDUCE_OPS = {4: "band", 5: "bor", 6: "bxor", 7: "premul_sum", 8: "another reduction"}
# A claim's header marks the collective's code with how this rank runs it: it never equals a header of a collective
# run in shared memory, nor one of a rank that runs it the other way.
GLOO, REFUSED = 0x100, 0x200
# the dtypes of claims besides DTYPES, numbered from _OTHER_CODE (the last: any other dtype)
_OTHER_DTYPES = (torch.bool, torch.complex32, torch.complex64, torch.complex128, torch.uint16, torch.uint32,
                 torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2)
_OTHER_CODE = 0x80
_CODES = {name: code for code, name in REDUCE_OPS.items()}
_DESC = 16  # in a rank's line (after counter and pid), the headers of its current collective, by seq parity
_FOLD = {SUM: torch.add, MIN: torch.minimum, MAX: torch.maximum, PRODUCT: torch.mul}
_HALVES = (torch.bfloat16, torch.float16)
TABLE_BYTES = 64 << 10  # per rank: (address, bytes) pairs, 4096 tensors a round; longer lists take several rounds
PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, 2**64 - 1  # <linux/prctl.h>; ANY is (unsigned long)-1
_IOV_MAX = 1024  # the kernel's limit on iovecs per call, on each side
_PROBE_ADDR, _PROBE_OK = 64, 72  # offsets in a rank's segment line (0-63: counter, pid, collective descriptors)


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
    """One collective as :meth:`Engine.run` runs it: ``flat`` its 1-d input (None for a barrier), ``outs`` the peer
    reads' tensors, ``splits`` all_to_all's (sent, received) counts, ``timeout`` None to keep the segment's."""

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
    claim: Claim | None = None


@dataclass(frozen=True)
class Claim:
    """What a rank publishes of a collective it does not run in shared memory (``Op.CLAIM``), for every rank to check
    against its own at one step: ``op`` the collective's code marked ``GLOO`` (handed to gloo) or ``REFUSED`` (its
    tensors do not fit together), ``dtype`` and ``numel`` as the shared-memory path would publish them, ``reduce``
    a code of REDUCE_OPS or a gloo-only one, ``tensors`` how many the call passes where not one."""

    op: int
    dtype: torch.dtype | None
    numel: int
    reduce: int = SUM
    src: int = 0
    tensors: int = 0


def _dtype_code(dtype: torch.dtype | None) -> int:
    if dtype is None:
        return 0
    if dtype in DTYPES:
        return DTYPES.index(dtype) + 1
    return _OTHER_CODE + (_OTHER_DTYPES.index(dtype) if dtype in _OTHER_DTYPES else len(_OTHER_DTYPES))


def _dtype_name(code: int) -> str:
    if 0 < code <= len(DTYPES):
        return str(DTYPES[code - 1]).replace("torch.", "")
    if 0 <= code - _OTHER_CODE < len(_OTHER_DTYPES):
        return str(_OTHER_DTYPES[code - _OTHER_CODE]).replace("torch.", "")
    return "another dtype" if code == _OTHER_CODE + len(_OTHER_DTYPES) else f"dtype #{code}"


class Header(ctypes.Structure):
    """What a rank announces of its current collective in its segment line: dtypes as index + 1 in DTYPES (0: none;
    ``narrow``: compress's), ``place`` how many tensors the peer reads sum. A mismatch names the field that differs."""

    _fields_ = [("op", ctypes.c_uint16), ("dtype", ctypes.c_uint8), ("reduce", ctypes.c_uint8),
                ("src", ctypes.c_uint16), ("narrow", ctypes.c_uint16), ("numel", ctypes.c_uint64),
                ("place", ctypes.c_uint64)]  # 24 bytes: the line's bytes 64.. are the probe's

    def reduce_name(self) -> str:
        names = REDUCE_OPS | _GLOO_REDUCE_OPS
        return names.get(self.reduce, f"reduction #{self.reduce}").upper()  # torch's ReduceOp names

    def describe(self) -> str:
        code = self.op & 0xFF  # a claim's: the collective it stands for
        name = OPS.get(code, f"an unknown collective ({self.op})")
        if code == Op.BARRIER:
            return name
        if self.reduce != SUM:  # a sum goes unnamed: it is the reduction of every other collective too
            name += f" ({self.reduce_name()})"
        what = f"{name} of {self.numel} {_dtype_name(self.dtype)}" if self.dtype else name
        if self.place and self.op & (GLOO | REFUSED):
            what += f" in {self.place} tensors"
        if self.narrow:
            what += f" rounded to {_dtype_name(self.narrow)}"
        what += f" from rank {self.src}" if code == Op.BROADCAST else ""
        if self.op & GLOO:
            what += " (handed to gloo)"
        elif self.op & REFUSED:
            what += " (refused: its tensors do not fit together)"
        return what


def combine(parts: list[torch.Tensor], out: torch.Tensor, op: int, scratch: torch.Tensor,
            divisor: float | None = None) -> None:
    """``out`` = ``parts[0]`` op ``parts[1]`` op ... in rank order (a sum then divided by ``divisor``): the same bits
    on every rank. ``out`` may be one of ``parts``; ``scratch``: float32 room for ``out.numel()`` values, where several
    half-precision values are summed or multiplied and rounded once."""
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
    """Rank ``rank``, in collective ``seq_text``, found rank ``peer`` in another one under the same number: ``field``
    says what differs ("collective", "op", "dtype", "size", "root", "compression", "tensors", "device"), ``detail``
    both sides."""

    def __init__(self, message: str, *, rank: int, peer: int, seq: int, seq_text: str, field: str, detail: str):
        super().__init__(message)
        self.rank, self.peer, self.seq, self.seq_text = rank, peer, seq, seq_text
        self.field, self.detail = field, detail


def _differs(theirs: Header, mine: Header) -> str:
    # the first field that differs, the collective by its name (the ring's and the peer reads' alike)
    if OPS.get(theirs.op & 0xFF) != OPS.get(mine.op & 0xFF):
        return "collective"
    for field, name in (("reduce", "op"), ("dtype", "dtype"), ("numel", "size"), ("src", "root"),
                        ("narrow", "compression"), ("place", "tensors")):
        if getattr(theirs, field) != getattr(mine, field):
            return name
    if (theirs.op | mine.op) & REFUSED:
        return "size"  # a rank whose output does not fit its input, or whose splits do not describe its tensors
    # handed to gloo by one rank only, all else equal: a tensor on another device, or sparse
    return "device" if (theirs.op ^ mine.op) & GLOO else "collective"


class Engine:
    """The algorithms over one segment, one thread at a time. Step g writes area g % ``areas``; a rank finishes
    reading step x before it publishes x + 2: step g may rewrite its area once every peer reached g - areas + 3."""

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
        # the next step's number, and its area (one slot per rank) as ``dtype`` views, once reusable
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
                what, field = theirs.describe(), _differs(theirs, mine)
                if field == "op":
                    what += f" (op {theirs.reduce_name()}; rank {self.rank}'s: {mine.reduce_name()})"
                elif field == "tensors":  # the peer reads': as many tensors
                    what += f" as {theirs.place} tensors (rank {self.rank}: {mine.place})"
                doing = describe()[0]
                raise ShmMismatchError(
                    f"fanfold shm transport: rank {self.rank} is in {doing} but rank {p} is in "
                    f"{what}: every rank must issue the same collectives, with the same "
                    "shapes and dtypes, in the same order", rank=self.rank, peer=p, seq=seq, seq_text=doing,
                    field=field, detail=f"rank {p} is in {what}")

    def run(self, c: Collective) -> None:
        op, flat, seq = c.op, c.flat, c.seq
        self._divisor, self._reduce = c.divisor, c.reduce
        if c.timeout is not None:
            self.seg.timeout = c.timeout
        # all_to_all's lengths may differ by rank: its first step checks every pair of splits instead
        peer = op in (Op.REDUCE_TENSORS, Op.SCATTER_TENSORS)  # c.outs: the tensors, read where they lie
        numel = sum(t.numel() for t in c.outs) if peer else 0 if flat is None or op == Op.ALL_TO_ALL else flat.numel()
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
        if op == Op.CLAIM:  # one step, like every collective's first: a peer in any collective checks it there
            k = c.claim
            header.op, header.reduce, header.src, header.numel = k.op, k.reduce, k.src, k.numel
            header.dtype, header.place = _dtype_code(k.dtype), k.tensors
            describe = _describe(header, where, 1, c.bucket, seq)
            self.seg.wait_all(self.seg.arrive(), describe(0))
            self.check(seq, header, describe(0))
            return
        cap = self.chunk_bytes // (flat.element_size() if flat is not None else 1)
        describe = _describe(header, where, max(1, -(-numel // cap)), c.bucket, seq)
        check = lambda: self.check(seq, header, describe(0))  # noqa: E731
        if op == Op.BARRIER:
            self.seg.wait_all(self.seg.arrive(), describe(0))
            check()
        elif op == Op.GATHER_PEERS:
            self._peer.all_gather(flat, c.out, describe, check)
        else:  # REDUCE_TENSORS in place, SCATTER_TENSORS into c.out
            self._peer.reduce(c.outs, c.out, describe, check, c.settle, *(c.compress or ()))

    def run_small(self, t: torch.Tensor, divisor: float | None, seq: int, bucket: int | None) -> None:
        # the latency path: the ring's all_reduce of ``t`` on the calling thread, its slot views and header words
        # made once per area, dtype and shape
        seg, g = self.seg, self.seg.arrived
        key = (g % self.areas, t.dtype, t.shape)
        views = self._small.get(key)
        if views is None:
            if len(self._small) > 512:
                self._small.clear()
            words = bytes(Header(op=Op.ALL_REDUCE, dtype=_dtype_code(t.dtype), numel=t.numel()))
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
                detail = f"rank {p} sends {table[p][q]} elements to rank {q}, which expects {table[q][n + p]} from it"
                raise ShmMismatchError(
                    f"fanfold shm transport: all_to_all #{c.seq}: {detail}: every rank's output splits must match "
                    "what the others send it", rank=rank, peer=p if p != rank else q, seq=c.seq,
                    seq_text=describe(0)()[0], field="size", detail=detail)
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


_RING = {Op.ALL_REDUCE: _all_reduce, Op.BROADCAST: _broadcast, Op.ALL_GATHER: _all_gather,
         Op.REDUCE_SCATTER: _reduce_scatter, Op.ALL_TO_ALL: _all_to_all}


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


def _parts(total: int, n: int) -> list[tuple[int, int]]:
    # rank p's part of ``total`` elements: [p * ceil(total / n), (p + 1) * ceil(total / n)), cut at ``total``
    per = -(-total // n)
    return [(min(total, p * per), min(total, (p + 1) * per)) for p in range(n)]


class PeerReader:
    """The peer reads: ``data`` holds the tables (where each rank's tensors lie), ``summer`` the rank-ordered fold."""

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
        self.unsettled: int | None = None  # the step after which peers may still read this rank's table and tensors

    def reduce(self, tensors: list[torch.Tensor], out: torch.Tensor | None, describe: Callable,
               check: Callable[[], None], settle: bool, compress: torch.dtype | None = None,
               pre_divisor: float | None = None) -> None:
        """Sum ``tensors`` laid end to end over the ranks in rank order: this rank's part (``ceil(total / N)``
        elements, zeroed past ``total``) into ``out``, or with ``out`` None every part in place (each rank sums its
        own, then copies the others'). ``pre_divisor`` divides every rank's values before they are rounded."""
        self._compress, self._pre = compress, pre_divisor
        lo, hi = _parts(sum(t.numel() for t in tensors), self.n)[self.rank]
        if out is not None:
            out[hi - lo:].zero_()
        base, rows = 0, self.rows
        for s in range(0, max(1, len(tensors)), rows):
            group = tensors[s: s + rows]
            verb = "all-reduces" if out is None else "reduce-scatters"
            mine, tables = self._open(group, describe, check if s == 0 else None, verb, s)
            size, count = (group[0].element_size() if group else 1), sum(t.numel() for t in group)
            if out is None:  # every round in parts: each rank sums its part of every round
                parts = _parts(count, self.n)
                a, b = parts[self.rank]
                steps = self._sum_part(group, mine, tables, a * size, b * size, lambda own, x, y: own, describe)
                self.seg.wait_all(self.seg.arrive(), describe(steps))  # every part holds its result
                for p, (plo, phi) in enumerate(parts):  # the other parts, from their owners' tensors into this rank's
                    if p != self.rank and phi > plo:
                        pieces = []
                        for laddr, off, m in _pieces(mine, tables[1][self.rank], plo * size, phi * size):
                            for raddr, roff, rm in _pieces(tables[0][p], tables[1][p], off, off + m):
                                pieces.append((laddr + roff - off, raddr, rm))
                        self.read(p, pieces, describe(steps))
            else:
                def into(own: torch.Tensor, x: int, y: int, base: int = base, size: int = size) -> torch.Tensor:
                    at = base + x // size - lo  # where the piece lies in this rank's part
                    return out[at: at + (y - x) // size]

                a, b = max(0, lo - base), max(0, min(hi - base, count))
                steps = self._sum_part(group, mine, tables, a * size, b * size, into, describe)
            # Peers may still read this rank's tensors (its table was read before they summed): they arrive at this
            # step once done, and the next publish, or any later wait of this rank, waits for that.
            end = self.seg.arrive()
            if settle and s + rows >= len(tensors):
                self.seg.wait_all(end, describe(max(0, steps - 1)))
            else:
                self.unsettled = end
            base += count

    def all_gather(self, part: torch.Tensor, out: torch.Tensor, describe: Callable, check: Callable[[], None]
                   ) -> None:
        """``out`` = every rank's ``part``, read from the peers' ``out``; returns once every peer has read this
        rank's part (ZeRO's next optimizer step may change it at once)."""
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

    def _open(self, tensors: list[torch.Tensor], describe: Callable, check: Callable[[], None] | None, verb: str,
              first: int) -> tuple[list[tuple[int, int]], tuple[list, list]]:
        # A round's first step: this rank's table published (once the peers are done with its last contents), every
        # peer's read once every rank has published. Every rank passes as many tensors (the header); the bytes must
        # agree.
        if self.unsettled is not None:
            self.seg.wait_all(self.unsettled, describe(0))
            self.unsettled = None
        mine = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]
        if mine:
            self._tables[self.rank][: len(mine)] = torch.tensor(mine, dtype=torch.int64)
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
