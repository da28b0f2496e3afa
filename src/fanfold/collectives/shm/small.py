"""The latency path of the shm transport: a small all_reduce run on the caller's thread with nothing made per call
but a closure -- the slot views and the header are made once per area, dtype and shape.

Layer: beside ``engine.py``, whose ring of areas, header check and rank-ordered sum it uses (the same steps as
``Engine.run``'s direct all-reduce of one chunk, so a peer running either one meets it); ``thread.Worker.run_small``
runs it.
"""
from __future__ import annotations

import torch

from .engine import Engine
from .request import ALL_REDUCE, DTYPES, Header

__all__ = ["SmallAllReduce"]


class SmallAllReduce:
    """All-reduces of at most a quarter chunk, in place, on ``engine``'s segment (one thread at a time, as the
    engine)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._views: dict[tuple, tuple] = {}  # (area, dtype, shape) -> (slot views by rank, header)
        self._seen = 0  # every peer's count had reached this at the last small collective

    def run(self, t: torch.Tensor, divisor: float | None, seq: int, bucket: int | None) -> None:
        """Collective number ``seq``: contiguous ``t`` becomes the sum over the ranks (divided by ``divisor``)."""
        e = self.engine
        seg, g = e.seg, e.seg.arrived
        key = (g % e.areas, t.dtype, t.shape)
        views = self._views.get(key)
        if views is None:
            if len(self._views) > 512:
                self._views.clear()
            m = t.numel()
            views = self._views[key] = ([s[:m].view(t.shape) for s in e.area(t.dtype, g)[: e.n]],
                                        Header(ALL_REDUCE, DTYPES.index(t.dtype) + 1, 0, 0, m, 0))
        slots, header = views
        describe = lambda: self._describe(header, seq, bucket)  # noqa: E731 - only called on an error
        if g + 3 - e.areas > self._seen:  # the area's last readers (see Engine.step): seen done last time
            seg.wait_all(g + 3 - e.areas, describe)
        if e.written[seq & 1] is not header:  # the same small collective again: its words are in place
            header.write(e.desc_words(seq))
            e.written[seq & 1] = header
        slots[e.rank].copy_(t)
        seg.arrive()
        seg.wait_all(g + 1, describe)
        self._seen = g + 1
        e.check(seq, header, describe)
        if e.n == 2 and divisor is None:
            torch.add(slots[0], slots[1], out=t)  # Engine.sum_into's two-part case, without its checks
        else:
            e.set_sum(divisor)
            e.sum_into(slots, t)

    @staticmethod
    def _describe(header: Header, seq: int, bucket: int | None) -> tuple:
        where = f"#{seq}" + ("" if bucket is None else f" (bucket {bucket})")
        return f"{header.describe()} {where}, chunk 1 of 1", seq, bucket
