"""What describes one collective of the shm transport: the tensors as the engine sees them (checked, contiguous
1-d views in a supported dtype), the reduction's code, the request a caller hands to the transport's thread
(:class:`Request` holding a :class:`Collective`), and the :class:`Header` every rank publishes in its segment line
so that its peers can check they run the same collective.

Layer: the bottom of ``shm/`` beside ``segment`` (no imports from the package); ``engine`` and ``peer`` run a
:class:`Collective`, ``thread`` serves :class:`Request` objects, ``transport`` and ``exchanges`` build both.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DTYPES", "OPS", "ALL_REDUCE", "BROADCAST", "BARRIER", "REDUCE_TENSORS", "ALL_GATHER", "REDUCE_SCATTER",
           "ALL_TO_ALL", "SCATTER_TENSORS", "GATHER_PEERS", "SUM", "MIN", "MAX", "PRODUCT", "REDUCE_OPS", "reduce_code",
           "Collective", "Request", "Header", "HeaderWords", "HEADER_BYTES", "flat_view", "split_into",
           "exchange_tensors", "exchange_counts", "check_reduce_tensors"]

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8]
# The ring's (ALL_REDUCE .. ALL_TO_ALL, through the segment's slots) and the peer reads' (REDUCE_TENSORS,
# SCATTER_TENSORS, GATHER_PEERS: straight from the peers' tensors)
(ALL_REDUCE, BROADCAST, BARRIER, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, REDUCE_TENSORS, SCATTER_TENSORS,
 GATHER_PEERS) = range(1, 10)
OPS = {ALL_REDUCE: "all_reduce", BROADCAST: "broadcast", BARRIER: "barrier", REDUCE_TENSORS: "all_reduce",
       ALL_GATHER: "all_gather", REDUCE_SCATTER: "reduce_scatter", ALL_TO_ALL: "all_to_all",
       SCATTER_TENSORS: "reduce_scatter", GATHER_PEERS: "all_gather"}
# The reductions: every rank folds the ranks' values in rank order (the sum with its divisor for averages; MIN, MAX
# and PRODUCT by ``engine.combine``), so the bits depend only on the inputs. SUM is 0: the code of a collective
# that reduces nothing, too.
SUM, MIN, MAX, PRODUCT = range(4)
REDUCE_OPS = {SUM: "sum", MIN: "min", MAX: "max", PRODUCT: "product"}
_CODES = {name: code for code, name in REDUCE_OPS.items()}


def reduce_code(op: str, divisor: float | None = None) -> int:
    """The code of reduction ``op`` ("sum", "min", "max" or "product"); a ``divisor`` goes with "sum" only."""
    if op not in _CODES:
        raise ValueError(f"op must be one of {sorted(_CODES)}, got {op!r}")
    if divisor is not None and op != "sum":
        raise ValueError(f"a divisor (an average) goes with op='sum' only, got op={op!r} and divisor={divisor!r}")
    return _CODES[op]


@dataclass(frozen=True, eq=False)
class Collective:
    """One collective as the engine runs it (``Engine.run``).

    ``flat``: the contiguous 1-d tensor it works on (the input of all_gather, reduce_scatter and all_to_all; None
    for a barrier). ``seq``: its number, the same on every rank. ``bucket`` labels errors. ``src``: a broadcast's
    root. ``shards``: the ring's all_reduce sums by shards (each rank one shard, then every rank copies the
    result) rather than every rank summing everything. ``divisor``: sums are divided by it (an average). ``outs``:
    REDUCE_TENSORS' and SCATTER_TENSORS' tensors. ``settle``, ``compress`` (dtype, pre_divisor): see
    ``PeerReader.run``. ``out``: the 1-d output of all_gather, reduce_scatter (SCATTER_TENSORS too) and all_to_all.
    ``splits``: all_to_all's element counts (sent to each rank, received from each rank). ``reduce``: the
    reduction's code (SUM, MIN, MAX, PRODUCT) of an all_reduce or reduce_scatter; a divisor goes
    with SUM only. ``timeout``: seconds any of its waits for a peer may take (set when it is numbered, from the
    caller's ``stall_timeout`` block if any; None: the segment's)."""

    op: int
    seq: int
    flat: torch.Tensor | None = None
    bucket: int | None = None
    src: int = 0
    shards: bool = False
    divisor: float | None = None
    outs: list[torch.Tensor] | None = None
    settle: bool = True
    compress: tuple[torch.dtype, float | None] | None = None
    out: torch.Tensor | None = None
    splits: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    reduce: int = SUM
    timeout: float | None = None


@dataclass(frozen=True, eq=False)
class Request:
    """A collective queued for the transport's thread: once it has run (and ``finish``, if any), ``future`` gets
    ``value``, or the error."""

    future: torch.futures.Future
    value: Any
    finish: Callable[[], None] | None
    collective: Collective


class HeaderWords(ctypes.Structure):
    """A :class:`Header` in a rank's segment line (``Segment.line(rank, HeaderWords, offset)``)."""

    # Each field in its own word: a peer reads them one by one, and a mismatch names the field that differs.
    # dtype and reduce share what was dtype's word: the header stays 24 bytes (the line's bytes 64.. are peer.py's)
    _fields_ = [("op", ctypes.c_uint16), ("dtype", ctypes.c_uint8), ("reduce", ctypes.c_uint8),
                ("src", ctypes.c_uint16), ("narrow", ctypes.c_uint16), ("numel", ctypes.c_uint64),
                ("place", ctypes.c_uint64)]


HEADER_BYTES = ctypes.sizeof(HeaderWords)


def _dtype_code(dtype: torch.dtype | None) -> int:
    return 0 if dtype is None else DTYPES.index(dtype) + 1


def _dtype_name(code: int) -> str:
    return str(DTYPES[code - 1]).replace("torch.", "") if 0 < code <= len(DTYPES) else f"dtype #{code}"


@dataclass(frozen=True)
class Header:
    """What a rank announces of its current collective, compared by every peer after the first step: ``op``,
    ``dtype`` (index + 1 in DTYPES, 0: none), ``src`` (a broadcast's root), ``narrow`` (the dtype a compressed
    all-reduce rounds to, 0: none), ``numel`` and ``place`` (how many tensors REDUCE_TENSORS or SCATTER_TENSORS
    sums), ``reduce`` (the reduction's code)."""

    op: int
    dtype: int = 0
    src: int = 0
    narrow: int = 0
    numel: int = 0
    place: int = 0
    reduce: int = SUM

    @staticmethod
    def of(c: Collective, numel: int, place: int) -> Header:
        return Header(c.op, _dtype_code(None if c.flat is None else c.flat.dtype), c.src,
                      _dtype_code(None if c.compress is None else c.compress[0]), numel, place, c.reduce)

    def write(self, words: Any) -> None:
        words.op, words.dtype, words.src, words.narrow = self.op, self.dtype, self.src, self.narrow
        words.numel, words.place, words.reduce = self.numel, self.place, self.reduce

    @staticmethod
    def read(words: Any) -> Header:
        return Header(words.op, words.dtype, words.src, words.narrow, words.numel, words.place, words.reduce)

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


def split_into(flat: torch.Tensor, outs: list[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` into ``outs``, in order."""
    offset = 0
    for out in outs:
        out.copy_(flat[offset: offset + out.numel()])
        offset += out.numel()


def exchange_tensors(what: str, tensor: torch.Tensor, out: torch.Tensor, times: int = 1, per: int = 1
                     ) -> tuple[torch.Tensor, torch.Tensor, Callable[[], None] | None]:
    """The flat input and output of all_gather, reduce_scatter or all_to_all, and what to run once the engine has
    written the output (the copy back into a non-contiguous ``out``); ``out`` must hold ``times`` / ``per`` times
    the input's elements."""
    flat, _ = flat_view(tensor, f"{what} (input)")  # the engine only reads the input: a copy is all it needs
    out_flat, back = flat_view(out, f"{what} (output)")
    if out.dtype != tensor.dtype:
        raise TypeError(f"{what}: the output's dtype {out.dtype} differs from the input's {tensor.dtype}")
    if tensor.numel() % per or out.numel() * per != tensor.numel() * times:
        raise ValueError(f"{what}: an input of {tensor.numel()} elements needs an output of {times}/{per} as many, "
                         f"got {out.numel()}")
    return flat, out_flat, back


def exchange_counts(tensor: torch.Tensor, out: torch.Tensor, send: list[int], recv: list[int], n: int) -> tuple:
    """all_to_all's flat input and output, the copy back (or None) and the element counts (sent to each rank,
    received from each rank) in the flat views' elements."""
    for name, counts in (("send", send), ("recv", recv)):
        if len(counts) != n or any(not isinstance(k, int) or k < 0 for k in counts):
            raise ValueError(f"all_to_all: {name} must be {n} non-negative element counts, got {counts!r}")
    flat, _ = flat_view(tensor, "all_to_all (input)")
    out_flat, back = flat_view(out, "all_to_all (output)")
    if out.dtype != tensor.dtype:
        raise TypeError(f"all_to_all: the output's dtype {out.dtype} differs from the input's {tensor.dtype}")
    for name, counts, t in (("send", send, tensor), ("recv", recv, out)):
        if sum(counts) != t.numel():
            raise ValueError(f"all_to_all: {name} counts {counts} add up to {sum(counts)}, not the {t.numel()} "
                             f"elements of the {'input' if t is tensor else 'output'}")
    scale = flat.numel() // tensor.numel() if tensor.numel() else 1  # complex: pairs of reals
    return flat, out_flat, back, (tuple(k * scale for k in send), tuple(k * scale for k in recv))


def check_reduce_tensors(tensors: list[torch.Tensor], compress: torch.dtype | None, what: str = "reduce_tensors"
                         ) -> list[torch.Tensor]:
    """``ShmTransport.reduce_tensors``' (or ``what``'s) tensors, checked: contiguous real CPU tensors of one dtype,
    not overlapping; ``compress`` only to bfloat16 or float16, of float32 tensors."""
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
