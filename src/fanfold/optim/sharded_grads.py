"""ZeRO stage 2's gradients: the reducer's strategy that reduce-scatters each bucket as soon as it is full and keeps
only this rank's part of the average, and the optimizer's pieces laid out after those parts.

``GradientShards`` implements the reducer's ``GradientStrategy`` (``distributed/reducer.py``). Bucket ``b`` of ``L``
elements is cut into ``N`` equal parts of ``ceil(L / N)``: rank ``r`` owns elements ``r * chunk`` to ``(r + 1) *
chunk`` of the bucket's flat layout, so the transport's ``reduce_scatter`` hands each rank exactly its part. Memory
after a synchronised backward: this rank's parts (about ``P / N``) and one staging buffer of the largest bucket; no
``.grad`` and no full bucket. Through the staging buffer one bucket is in flight at a time (the next one's copy waits
for it, while the backward computes in between).
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

import torch

from ..distributed.comm_hooks import GradBucket
from ..distributed.reducer import BUILT_IN, Reducer
from .layout import Piece
from .param_gather import ParamGather

__all__ = ["BucketShard", "GradientShards", "bucket_pieces", "check_shards"]


@dataclass(frozen=True)
class BucketShard:
    """Bucket ``index``: reducer parameters ``members`` at ``offsets`` (``numels`` long) of ``numel`` flat elements,
    of which each rank owns ``chunk`` and this one ``lo:hi`` (the last ranks' parts are short or empty)."""

    index: int
    members: tuple[int, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    numel: int
    chunk: int
    lo: int
    hi: int
    dtype: torch.dtype
    device: torch.device

    def spans(self, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
        """The members under flat positions ``lo:hi``: ``(k, a, b, at)`` for member ``k``'s elements ``a:b``, found
        at ``at`` from ``lo``."""
        out, k = [], max(0, bisect_right(self.offsets, lo) - 1)
        while k < len(self.members) and self.offsets[k] < hi:
            start = self.offsets[k]
            a, b = max(lo, start), min(hi, start + self.numels[k])
            if a < b:
                out.append((k, a - start, b - start, a - lo))
            k += 1
        return out


@dataclass
class _Flight:
    """The bucket whose reduction is under way: its handle and where its result lands (this rank's part, or a
    temporary added to what the part holds: ``accumulate``)."""

    bucket: int
    handle: Any
    result: torch.Tensor
    accumulate: bool


class _Done:
    def wait(self) -> None:
        return None


class GradientShards:
    """This rank's parts of every bucket's averaged gradient: filled by ``reducer`` (as its gradient strategy), read
    by the optimizer; ``module``: where reads of the parameters wait for their gather (``param_gather.py``)."""

    def __init__(self, reducer: Reducer, module: torch.nn.Module | None = None):
        self.reducer, self.params, self.module = reducer, reducer.params, module
        t = reducer.transport
        self.rank, self.world_size = t.rank, t.world_size
        n, self.layout = self.world_size, []
        for b, members in enumerate(reducer.buckets):
            numels = tuple(self.params[i].numel() for i in members)
            offsets = tuple(sum(numels[:k]) for k in range(len(numels)))
            total, p = sum(numels), self.params[members[0]]
            chunk = -(-total // n)
            lo = min(self.rank * chunk, total)
            self.layout.append(BucketShard(b, tuple(members), offsets, numels, total, chunk, lo,
                                           min(lo + chunk, total), p.dtype, p.device))
        self.parts = [torch.zeros(s.chunk, dtype=s.dtype, device=s.device) for s in self.layout]
        self.filled = [False] * len(self.layout)  # parts[b] holds gradients not yet zeroed: they accumulate
        self.present = [False] * len(self.params)  # parameter i has a gradient: some rank used it
        self._staging: dict[tuple, torch.Tensor] = {}  # one buffer per (dtype, device): the largest bucket
        self._flight: _Flight | None = None
        self._launched: list[int] = []
        self.gather: ParamGather | None = None  # the parameters laid flat (lay_flat) and their gather

    # ---- the reducer's side (GradientStrategy): launch, finish, write-back --------------------------------------
    def _stage(self, s: BucketShard, dtype: torch.dtype | None = None) -> torch.Tensor:
        key = (dtype or s.dtype, s.device)
        if key not in self._staging:
            size = max(x.chunk for x in self.layout if (x.dtype, x.device) == (s.dtype, s.device)) * self.world_size
            self._staging[key] = torch.empty(size, dtype=key[0], device=s.device)
        return self._staging[key][:s.chunk * self.world_size]

    def launch(self, b: int) -> None:
        """Bucket ``b`` is full: its gradients into the staging buffer (their ``.grad`` freed), its reduction
        started. Called in bucket order on every rank, as every collective must be."""
        r, s = self.reducer, self.layout[b]
        self._launched.append(b)
        self.finish()  # the bucket in flight gives the staging buffer back
        flat = self._stage(s)
        for k, i in enumerate(s.members):
            p, view = self.params[i], flat[s.offsets[k]:s.offsets[k] + s.numels[k]]
            if p.grad is None:
                view.zero_()  # unused here (find_unused_parameters): contributes zeros
            else:
                view.copy_(p.grad.reshape(-1))
                p.grad = None
        flat[s.numel:].zero_()
        accumulate = self.filled[b]
        if r.hook in BUILT_IN:
            narrow, divisor = BUILT_IN[r.hook], r.hook_divisor
            send = flat
            if narrow is not None:
                if narrow == torch.float16:  # divide first: the sum of N gradients could overflow float16
                    flat.div_(divisor)
                    divisor = None
                send = self._stage(s, narrow).copy_(flat)
            out = self.parts[b] if narrow is None and not accumulate else \
                torch.empty(s.chunk, dtype=send.dtype, device=s.device)
            if self.world_size == 1:  # no collective: the part is the whole bucket
                out.copy_(send if divisor is None else send / divisor)
                handle: Any = _Done()
            else:
                handle = r.transport.reduce_scatter(send, out, b, divisor=divisor)
        else:  # any other hook reduces the whole bucket; this rank keeps its part
            out = torch.empty(s.chunk, dtype=s.dtype, device=s.device)
            handle = _HookPart(r, b, s, flat, out)
        self._flight = _Flight(b, handle, out, accumulate)

    def finish(self) -> None:
        """Wait for the bucket in flight; its result into this rank's part."""
        f, self._flight = self._flight, None
        if f is None:
            return
        f.handle.wait()
        part = self.parts[f.bucket]
        if f.accumulate:
            part.add_(f.result.to(part.dtype))
        elif f.result is not part:
            part.copy_(f.result)
        self.filled[f.bucket] = True

    def write_back(self, used: list[float] | None) -> None:
        """End of a synchronised backward: every launched bucket's result is in; ``used[i]``: how many ranks used
        parameter i (None: all did). A parameter no rank used keeps no gradient, as in a single process."""
        self.finish()
        for b in self._launched:
            for i in self.layout[b].members:
                if used is None or used[i] > 0:
                    self.present[i] = True
        self._launched = []
        for key in [k for k in self._staging if k[0] not in {s.dtype for s in self.layout}]:
            del self._staging[key]  # one staging buffer stays (the next backward's); compression's narrow ones go

    # ---- the optimizer's side: read the parts, gather the parameters ----------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's ``zero_grad``: torch's meaning for this rank's parts."""
        if set_to_none:
            self.present = [False] * len(self.params)
            self.filled = [False] * len(self.layout)
        else:
            for part in self.parts:
                part.zero_()

    def grad(self, i: int, b: int, offset: int, numel: int) -> torch.Tensor | None:
        """Parameter ``i``'s averaged gradient at ``offset:offset + numel`` of this rank's part of bucket ``b``."""
        return self.parts[b][offset:offset + numel] if self.present[i] else None

    def lay_flat(self) -> None:
        """The parameters become views of one flat tensor per bucket, so that their gathers write straight into them
        (``param_gather.py``). Call before taking views of them."""
        if self.gather is None:
            self.gather = ParamGather(self.layout, self.params, self.reducer.transport, self.module)

    def gather_params(self) -> None:
        """Every rank's part of every parameter to every rank (collective), issued per bucket; returns with the
        gathers in flight where every read of a parameter waits for its bucket (``param_gather.py``)."""
        self.lay_flat()
        self.gather.issue()

    def settle(self) -> None:
        """Wait for the gathers in flight (before the optimizer steps the parameters again)."""
        if self.gather is not None:
            self.gather.wait_all()


class _HookPart:
    """A user's comm hook on bucket ``b`` (staged in ``flat``); ``wait()`` leaves this rank's part in ``out``."""

    def __init__(self, reducer: Reducer, b: int, s: BucketShard, flat: torch.Tensor, out: torch.Tensor):
        whole = flat[:s.numel]
        views = [whole[o:o + m].view(reducer.params[i].shape) for i, o, m in zip(s.members, s.offsets, s.numels)]
        bucket = GradBucket(b, whole, [reducer.params[i] for i in s.members], views, b == len(reducer.buckets) - 1,
                            reducer.hook_divisor, reducer.all_reduce)
        self._future, self._whole, self._out, self._s = reducer.hook(reducer.hook_state, bucket), whole, out, s

    def wait(self) -> None:
        result = self._future.wait()
        if isinstance(result, (list, tuple)):  # a torch future of a c10d work yields [tensor]
            result = result[0]
        result = result.reshape(-1) if isinstance(result, torch.Tensor) else self._whole
        s = self._s
        self._out[:s.hi - s.lo].copy_(result[s.lo:s.hi])


def check_shards(shards: GradientShards, params: list[torch.Tensor], rank: int, world_size: int) -> list[int]:
    """The optimizer's index of each of the reducer's parameters; ValueError unless both hold the same parameters
    over the same ranks."""
    if (shards.rank, shards.world_size) != (rank, world_size):
        raise ValueError(f"ZeroRedundancyOptimizer (rank {rank} of {world_size}): the DistributedDataParallel is rank "
                         f"{shards.rank} of {shards.world_size}; both must use the same process group")
    index = {id(p): k for k, p in enumerate(params)}
    if len(index) != len(params):
        raise ValueError(f"ZeroRedundancyOptimizer (rank {rank}): a parameter appears twice in the optimizer")
    mine = [index.get(id(p)) for p in shards.params]
    missing = [k for k, m in enumerate(mine) if m is None]
    if missing or len(shards.params) != len(params):
        extra = sorted(set(range(len(params))) - {m for m in mine if m is not None})
        raise ValueError(f"ZeroRedundancyOptimizer (rank {rank}): sharded gradients need the optimizer over exactly "
                         f"the DistributedDataParallel's trainable parameters; {len(missing)} of DDP's are not in the "
                         f"optimizer, and optimizer parameters {extra[:10]} are not trained by DDP")
    return mine


def bucket_pieces(shards: GradientShards, opt_index: list[int], groups: list[int]) -> list[Piece]:
    """This rank's pieces, bucket by bucket: ``Piece.space`` is the bucket, ``Piece.offset`` the place in this rank's
    part of it (what :meth:`GradientShards.grad` takes)."""
    out = []
    for s in shards.layout:
        for k, a, b, at in s.spans(s.lo, s.hi):
            i = opt_index[s.members[k]]
            out.append(Piece(i, groups[i], s.index, a, b, at))
    return out
