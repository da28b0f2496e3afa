"""all_gather, reduce_scatter and all_to_all over the engine's ring of areas: each a pipeline of numbered steps in
which every rank writes its slot (for all_to_all and reduce_scatter: one piece per destination rank), then reads
what its peers wrote.

Layer: called by ``engine.Engine.run`` on the transport's thread, with the engine's steps, header check and
rank-ordered sums (``Engine.sum_into``), so a reduce_scatter's shard has bitwise the bits an all_reduce of the same
data gives that shard.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .request import ALL_GATHER, ALL_TO_ALL, REDUCE_SCATTER, Collective, Header

__all__ = ["run_exchange"]


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


def run_exchange(engine: Any, c: Collective, header: Header, where: str) -> None:
    """Run all_gather, reduce_scatter or all_to_all ``c`` on ``engine`` (its header already published)."""
    _EXCHANGES[c.op](engine, c, header, where)
