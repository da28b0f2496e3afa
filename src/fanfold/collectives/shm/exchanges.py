"""The shared-memory transport's all_gather, reduce_scatter (of one tensor, or of private tensors laid end to end:
``reduce_scatter_tensors``) and all_to_all: argument checks and the requests.

Part of ``collectives/shm``: a base class of ``ShmTransport`` (``transport.py``), which supplies the numbering and
the thread (``_enqueue``) and the choice of algorithm (``_reads_peers``); the algorithms are ``engine.py``'s (the
ring) and ``peer.py``'s (peer reads), the flat views ``request.py``'s.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .request import (
    ALL_GATHER,
    ALL_TO_ALL,
    GATHER_PEERS,
    OPS,
    REDUCE_SCATTER,
    SCATTER_TENSORS,
    SUM,
    Collective,
    check_reduce_tensors,
    exchange_counts,
    exchange_tensors,
    flat_view,
    reduce_code,
)
from .thread import ShmWork
from .thread import completed as _completed

__all__ = ["Exchanges"]


class Exchanges:
    """all_gather, reduce_scatter and all_to_all for a transport with ``world_size``, ``_chunk_bytes``,
    ``_reads_peers(nbytes)`` and ``_enqueue(collective, value, finish)``."""

    rank: int
    world_size: int
    _chunk_bytes: int
    _enqueue: Callable[..., Any]
    _reads_peers: Callable[..., bool]

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor, bucket: int | None = None) -> ShmWork:
        """Every rank's ``tensor`` (same numel and dtype on every rank) into ``out`` (world_size times as many
        elements: rank r's at r * numel), asynchronously; ``bucket`` labels errors. Where the peers' memory is read
        (``_reads_peers``), every rank copies the peers' parts straight from their outputs."""
        if tensor.numel() and out.numel() and _overlaps(tensor, out) and not _own_part(tensor, out, self.rank):
            tensor = tensor.clone()  # overlapping other ranks' places in out: the engine would overwrite it
        flat, out_flat, finish = exchange_tensors("all_gather", tensor, out, times=self.world_size)
        peers = self.world_size > 1 and self._reads_peers(out_flat.nbytes)
        return self._exchange(Collective(GATHER_PEERS if peers else ALL_GATHER, 0, flat, bucket, out=out_flat), out,
                              finish)

    def reduce_scatter(self, tensor: torch.Tensor, out: torch.Tensor, bucket: int | None = None, *,
                       divisor: float | None = None, op: str = "sum") -> ShmWork:
        """Sum ``tensor`` (world_size x ``out``'s elements) over the group and keep this rank's shard in ``out``
        (rank r: elements r * numel .. (r + 1) * numel), asynchronously; with ``divisor``, divided by it. Summed in
        rank order: bitwise what :meth:`all_reduce` gives that shard. ``op``: "sum", "min", "max" or "product"."""
        if divisor is not None and not (isinstance(divisor, (int, float)) and divisor > 0):
            raise ValueError(f"reduce_scatter: divisor must be a positive number, got {divisor!r}")
        reduce = reduce_code(op, divisor)
        flat, out_flat, finish = exchange_tensors("reduce_scatter", tensor, out, per=self.world_size)
        if reduce == SUM and self.world_size > 1 and self._reads_peers(flat.nbytes) and flat.is_cpu and \
                not flat.is_complex() and flat.numel() and not (_overlaps(flat, out_flat) or _overlaps(out_flat, flat)):
            # Where ranks read each other's memory, each reads only its part of the peers' tensors (peer.py): no
            # copy through the ring, the same bits (ZeRO stage 2's gradients)
            return self._enqueue(Collective(SCATTER_TENSORS, 0, flat, bucket, divisor=divisor, outs=[flat],
                                            out=out_flat), out, finish)
        return self._exchange(Collective(REDUCE_SCATTER, 0, flat, bucket, divisor=divisor, out=out_flat,
                                         reduce=reduce), out, finish)

    def reduce_scatter_tensors(self, tensors: list[torch.Tensor], out: torch.Tensor, bucket: int | None = None, *,
                               divisor: float | None = None, settle: bool = True,
                               compress: torch.dtype | None = None) -> ShmWork:
        """Sum ``tensors`` (contiguous CPU tensors of one dtype, not overlapping; laid end to end, ``total`` elements
        on every rank) over the group and keep this rank's part in ``out`` (``ceil(total / world_size)`` elements:
        rank r's part is elements r * len(out) .. (r + 1) * len(out) of the concatenation; where it runs past
        ``total``, ``out`` is zeroed), asynchronously; divided by ``divisor``. Bitwise what :meth:`reduce_scatter`
        of the zero-padded concatenation gives. Where the peers' memory is read (``_reads_peers``) each
        rank reads only its part from the peers' own tensors (``peer.scatter_tensors``); ``settle=False``: the handle
        completes once ``out`` holds the result, and the tensors must stay unchanged until a later collective of
        this transport has returned. Otherwise they are copied into one buffer and reduce-scattered through the
        ring. ``compress``: as :meth:`reduce_tensors` (the compression hooks' bits); ``out`` stays float32."""
        if divisor is not None and not (isinstance(divisor, (int, float)) and divisor > 0):
            raise ValueError(f"reduce_scatter_tensors: divisor must be a positive number, got {divisor!r}")
        tensors = check_reduce_tensors(tensors, compress, "reduce_scatter_tensors")
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
            return _completed(out)
        pre = divisor if compress == torch.float16 else None  # float16 divides first, as fp16_compress_hook does
        if pre is not None:
            divisor = None
        if self.world_size > 1 and self._reads_peers(total * tensors[0].element_size(), listed=True):
            return self._enqueue(Collective(SCATTER_TENSORS, 0, tensors[0].view(-1), bucket, divisor=divisor,
                                            outs=tensors, out=flat_out, settle=bool(settle),
                                            compress=None if compress is None else (compress, pre)), out, None)
        # No peer reads: one zero-padded copy of the concatenation, reduce-scattered through the ring
        stage = torch.empty(chunk * self.world_size, dtype=compress or dtype)
        stage[total:].zero_()
        if compress is None:
            torch.cat([t.view(-1) for t in tensors], out=stage[:total])
            return self.reduce_scatter(stage, flat_out, bucket, divisor=divisor)
        wide = torch.cat([t.view(-1) for t in tensors])
        stage[:total].copy_(wide if pre is None else wide.div_(pre))
        narrow = torch.empty(chunk, dtype=compress)
        work = self.reduce_scatter(stage, narrow, bucket, divisor=divisor)
        return ShmWork(work.get_future().then(lambda _: flat_out.copy_(narrow)))

    def all_to_all(self, tensor: torch.Tensor, out: torch.Tensor, send: list[int], recv: list[int]) -> ShmWork:
        """Send ``send[q]`` consecutive elements of ``tensor`` to rank q and receive ``recv[p]`` from rank p into
        ``out`` (in rank order), asynchronously. Every rank's ``recv[p]`` must equal rank p's ``send`` to it:
        checked on every rank before anything moves."""
        flat, out_flat, finish, splits = exchange_counts(tensor, out, send, recv, self.world_size)
        return self._exchange(Collective(ALL_TO_ALL, 0, flat, out=out_flat, splits=splits), out, finish)

    def _exchange(self, c: Collective, out: torch.Tensor, finish: Callable[[], None] | None) -> ShmWork:
        if 16 * self.world_size > self._chunk_bytes:  # all_to_all's table of counts, a piece per rank in a chunk
            raise ValueError(f"{OPS[c.op]}: {self.world_size} ranks need chunk_bytes >= {16 * self.world_size}")
        if self.world_size == 1:
            if c.op == REDUCE_SCATTER and c.divisor is not None:
                torch.div(c.flat, c.divisor, out=c.out)
            else:
                c.out.copy_(c.flat)
            if finish is not None:
                finish()
            return _completed(out)
        return self._enqueue(c, out, finish)


def _own_part(tensor: torch.Tensor, out: torch.Tensor, rank: int) -> bool:
    """Whether ``tensor`` is exactly this rank's place in ``out`` (an in-place all_gather, as ZeRO's): the engine
    then leaves that place as it is."""
    size = tensor.numel() * tensor.element_size()
    return (tensor.is_contiguous() and out.is_contiguous() and tensor.dtype == out.dtype
            and tensor.data_ptr() == out.data_ptr() + rank * size)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    lo, hi = b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()
    return lo <= a.data_ptr() < hi
