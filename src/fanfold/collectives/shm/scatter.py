"""Reduce-scatter of private tensors by reading the peers' memory (``ShmTransport.reduce_scatter_tensors``, op
SCATTER_TENSORS): each rank reads only its own part of every peer's tensors, nothing goes through shared memory.

Layer: run by ``engine.py`` on the transport's thread, with ``peer.py``'s :class:`~.peer.PeerReader` (its address
tables in the segment, its cache-sized buffers, its reads and its rank-ordered sums).

Why: ZeRO stage 2 needs only this rank's part of each bucket's averaged gradient. The peer-read all-reduce
(``PeerReader.run``) sums this rank's shard and then reads every other shard back: twice the bytes. Here the
tensors, laid end to end (``total`` elements on every rank), are cut in N parts of ``chunk = ceil(total / N)``
(``BucketShard``'s layout: rank r owns elements r * chunk .. (r + 1) * chunk, the last parts short or empty); rank
r reads its part from each peer, a cache-sized piece at a time, and sums it with this rank's own in rank order
with the same float32 operations as every other algorithm (bitwise what ``reduce_scatter`` or an all-reduce gives
that part) straight into ``out``. ``out``'s elements beyond ``total`` (the padding of the last parts) are zeroed,
as a reduce-scatter of the zero-padded concatenation would give.

Two steps a round: after the first every peer has published its table (and its tensors hold their values); after
the second no peer reads this rank's tensors any more. ``settle=False`` does not wait for the second: the caller
must keep the tensors unchanged until a later collective of this transport has waited (each one's first wait
implies the step), and this rank's table is rewritten only once the peers are past that step (``PeerReader
.publish``), since they read it while they sum.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["scatter_tensors"]


def scatter_tensors(reader: Any, tensors: list[torch.Tensor], out: torch.Tensor, describe: Callable,
                    check: Callable[[], None], settle: bool, compress: torch.dtype | None = None,
                    pre_divisor: float | None = None) -> None:
    """``out`` = this rank's part of the sum of ``tensors`` over the group (rounded as ``compress`` says, see
    ``PeerReader.run``), in rounds of at most a table's worth of tensors (every rank's rounds must hold the same
    bytes: with up to ``reader.rows`` tensors, one round)."""
    reader.set_rounding(compress, pre_divisor)
    total = sum(t.numel() for t in tensors)
    chunk = -(-total // reader.n)
    lo = min(total, reader.rank * chunk)
    hi = min(total, lo + chunk)
    out[hi - lo:].zero_()
    base, rows = 0, reader.rows
    for s in range(0, max(1, len(tensors)), rows):
        group = tensors[s: s + rows]
        _round(reader, group, out, base, (lo, hi), describe, check if s == 0 else None,
               settle and s + rows >= len(tensors), s)
        base += sum(t.numel() for t in group)


def _round(reader: Any, tensors: list[torch.Tensor], out: torch.Tensor, base: int, part: tuple[int, int],
           describe: Callable, check: Callable[[], None] | None, settle: bool, first: int) -> None:
    seg, rank, n = reader.seg, reader.rank, reader.n
    mine = reader.publish(tensors, describe(0))
    start = seg.arrive()  # this rank's table is written and its tensors hold their values: peers may read
    seg.wait_all(start, describe(0))
    if check is not None:
        check()  # the headers: the same op, dtype, total elements and number of tensors on every rank
    tables, offsets = reader.peer_tables(mine)
    total = sum(nb for _, nb in mine)
    for p in range(n):
        theirs = sum(nb for _, nb in tables[p])
        if theirs != total:  # rounds beyond the first: the tensors' sizes differ by rank, not only their total
            raise RuntimeError(f"fanfold shm transport: rank {p} reduce-scatters {theirs} bytes in tensors "
                               f"{first}..{first + len(tensors) - 1} where rank {rank} has {total}, in "
                               f"{describe(0)()[0]}: every rank must pass tensors of the same sizes")
    size = tensors[0].element_size() if tensors else 1
    # this rank's part, in bytes from the start of this round's tensors
    a, b = (max(0, (x - base)) * size for x in part)
    b = min(b, total)
    steps, starts = 0, offsets[rank]
    for k, (_, nb) in enumerate(mine):
        ka, kb = max(a, starts[k]), min(b, starts[k] + nb)
        for x in range(ka, kb, reader.chunk_bytes):
            y = min(kb, x + reader.chunk_bytes)
            own = tensors[k].view(-1)[(x - starts[k]) // size: (y - starts[k]) // size]
            at = base + x // size - part[0]  # where the piece lies in this rank's part
            reader.sum_from_peers(own, x, y, (tables, offsets), out[at: at + (y - x) // size], describe(steps))
            steps += 1
    end = seg.arrive()  # this rank reads nobody's tensors any more
    if settle:
        seg.wait_all(end, describe(max(0, steps - 1)))
    else:
        reader.unsettled = end
