"""What describes one collective of the shm transport: the request a caller hands to the transport's thread
(:class:`Request` holding a :class:`Collective`), and the :class:`Header` every rank publishes in its segment line
so that its peers can check they run the same collective.

Layer: the bottom of ``shm/`` beside ``segment`` (no imports from the package); ``engine`` runs a
:class:`Collective`, ``thread`` serves :class:`Request` objects, ``transport`` builds both.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .reduce_ops import REDUCE_OPS, SUM

__all__ = ["DTYPES", "OPS", "ALL_REDUCE", "BROADCAST", "BARRIER", "SHARED_ALL_REDUCE", "REDUCE_INTO",
           "REDUCE_TENSORS", "ALL_GATHER", "REDUCE_SCATTER", "ALL_TO_ALL", "SCATTER_TENSORS", "GATHER_PEERS",
           "Collective", "Request", "Header", "HeaderWords", "HEADER_BYTES"]

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8]
(ALL_REDUCE, BROADCAST, BARRIER, SHARED_ALL_REDUCE, REDUCE_INTO, REDUCE_TENSORS, ALL_GATHER, REDUCE_SCATTER,
 ALL_TO_ALL, SCATTER_TENSORS, GATHER_PEERS) = range(1, 12)
OPS = {ALL_REDUCE: "all_reduce", BROADCAST: "broadcast", BARRIER: "barrier", SHARED_ALL_REDUCE: "all_reduce",
       REDUCE_INTO: "all_reduce", REDUCE_TENSORS: "all_reduce", ALL_GATHER: "all_gather",
       REDUCE_SCATTER: "reduce_scatter", ALL_TO_ALL: "all_to_all", SCATTER_TENSORS: "reduce_scatter",
       GATHER_PEERS: "all_gather"}


@dataclass(frozen=True, eq=False)
class Collective:
    """One collective as the engine runs it (``Engine.run``).

    ``flat``: the contiguous 1-d tensor it works on (the input of all_gather, reduce_scatter and all_to_all; None
    for a barrier). ``seq``: its number, the same on every rank. ``bucket`` labels errors. ``src``: a broadcast's
    root. ``shared``: (every rank's copy of ``flat``, by rank; where it lies) for memory from
    ``ShmTransport.allocate``. ``divisor``: sums are divided by it (an average). ``outs``: REDUCE_INTO's private
    outputs, or REDUCE_TENSORS' and SCATTER_TENSORS' tensors. ``settle``, ``compress`` (dtype, pre_divisor): see
    ``PeerReader.run``. ``out``: the 1-d output of all_gather, reduce_scatter (SCATTER_TENSORS too) and all_to_all.
    ``splits``: all_to_all's element counts (sent to each rank, received from each rank). ``reduce``: the
    reduction's code (``reduce_ops``: SUM, MIN, MAX, PRODUCT) of an all_reduce or reduce_scatter; a divisor goes
    with SUM only."""

    op: int
    seq: int
    flat: torch.Tensor | None = None
    bucket: int | None = None
    src: int = 0
    shared: tuple[list[torch.Tensor], int] | None = None
    divisor: float | None = None
    outs: list[torch.Tensor] | None = None
    settle: bool = True
    compress: tuple[torch.dtype, float | None] | None = None
    out: torch.Tensor | None = None
    splits: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    reduce: int = SUM


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
    all-reduce rounds to, 0: none), ``numel`` and ``place`` (where a shared all-reduce's tensor lies, or how many
    tensors REDUCE_TENSORS or SCATTER_TENSORS sums), ``reduce`` (the reduction, ``reduce_ops``)."""

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
