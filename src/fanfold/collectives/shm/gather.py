"""all_gather by reading the peers' memory (op GATHER_PEERS): each rank reads every peer's part straight from the
peer's own output tensor into its own, nothing goes through shared memory.

Layer: run by ``engine.py`` on the transport's thread, with ``peer.py``'s :class:`~.peer.PeerReader` (its address
tables and reads); ``exchanges.py`` picks it for outputs above a quarter chunk where every rank may read its peers.

Why: ZeRO stage 2 gathers the parameters in place after each step (every rank's updated part into every rank's flat
bucket). Through the ring each rank copies its part into the segment and every part out of it, a step per chunk;
here each rank copies only its peers' parts, once, with one ``process_vm_readv`` per peer. Each rank first puts its
own part in its place of its output (nothing to do in place), publishes where the output lies, and after one step
reads the peers'. Settled: the handle completes only once every peer is done reading this rank's part, so the
caller may change it at once (the next optimizer step), as after any all_gather.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["gather_from_peers"]


def gather_from_peers(reader: Any, part: torch.Tensor, out: torch.Tensor, describe: Callable,
                      check: Callable[[], None]) -> None:
    """``out`` (contiguous, N parts of ``part``'s length) = every rank's ``part``, by rank."""
    seg, rank, n = reader.seg, reader.rank, reader.n
    m = part.numel()
    own = out[rank * m:][:m]
    if m and part.data_ptr() != own.data_ptr():
        own.copy_(part)
    mine = reader.publish([out], describe(0))
    start = seg.arrive()  # this rank's part is in place and its address published: peers may read it
    seg.wait_all(start, describe(0))
    check()  # the headers: every rank gathers parts of the same length and dtype
    tables, _ = reader.peer_tables(mine)
    nb = m * out.element_size()
    for p in range(n):
        if p != rank and nb:
            reader.read(p, [(out.data_ptr() + p * nb, tables[p][0][0] + p * nb, nb)], describe(0))
    seg.wait_all(seg.arrive(), describe(0))  # every peer has read this rank's part
