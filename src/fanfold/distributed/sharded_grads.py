"""ZeRO stage 2 on the reducer's side: each bucket is reduce-scattered as soon as it is full, this rank keeps only
the averaged gradient of its own part of it, and every full ``.grad`` of the bucket is freed; after the optimizer's
step the updated parts are all-gathered back into the parameters, which lie flat per bucket for that, overlapped
with the next forward (``param_gather.py``).

Layer: ``distributed``, beside ``reducer.py``, which hands its buckets over through a few marked lines (``Reducer.
shards``: launch, wait, write-back). The optimizer above (``fanfold.optim.ZeroRedundancyOptimizer``) is reached only
through :class:`ShardConsumer`. Bucket ``b`` of ``L`` elements is cut into ``N`` equal parts of ``ceil(L / N)``:
rank ``r`` owns elements ``r * chunk`` to ``(r + 1) * chunk`` of the bucket's flat layout, so a true reduce-scatter
(``shard_collectives.py``) hands each rank exactly its part. The buckets are frozen when stage 2 starts (no rebuild
from the first backward's order), since the optimizer's state is laid out after them.

Memory after a synchronised backward: this rank's parts (``sum ceil(L / N)``, about ``P / N``) and one staging
buffer of the largest bucket; no ``.grad`` and no full bucket. Through the staging buffer one bucket is in flight
at a time (the next one's copy waits for it, while the backward computes in between). The shm transport where
ranks read each other's memory needs no staging: each rank reads only its part of every peer's ``.grad`` tensors
(``ShmTransport.reduce_scatter_tensors``) straight into its part, every launched bucket in flight at once; the
``.grad`` tensors are let go once no peer reads them any more (see :meth:`GradientShards._finish`).
"""
from __future__ import annotations

from bisect import bisect_right
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .bucket_paths import BUILT_IN
from .comm_hooks import GradBucket
from .param_gather import ParamGather
from .shard_collectives import completed, reads_peers, reduce_scatter, scatter_tensors

__all__ = ["BucketShard", "GradientShards", "ShardConsumer", "shard_gradients"]


class ShardConsumer(Protocol):
    """An optimizer that steps this rank's parts of the gradients (``fanfold.ZeroRedundancyOptimizer``)."""

    def use_gradient_shards(self, shards: GradientShards) -> None:
        """Accept (or raise), call ``shards.lay_flat()``, then take views of the parameters."""


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
    """The bucket whose reduction is under way: its handle, where its result lands (this rank's part, or a temporary
    to add to what the part holds: ``accumulate``); ``held``: the gradients the peers read where they lie, and
    whether the reduction waits for them to be done (``settled``)."""

    bucket: int
    handle: Any
    result: torch.Tensor
    accumulate: bool
    held: list[torch.Tensor] | None = None
    settled: bool = True


class GradientShards:
    """This rank's parts of every bucket's averaged gradient, filled by the reducer, read by the optimizer."""

    def __init__(self, reducer: Any, module: torch.nn.Module | None = None):
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
        self._flights: deque[_Flight] = deque()  # launched, not yet finished, in bucket order
        self._held: list[torch.Tensor] | None = None  # a finished bucket's .grad tensors that peers may still read
        self._launched: list[int] = []
        self.gather: ParamGather | None = None  # the parameters laid flat (lay_flat) and their gather

    # ---- the reducer's side: launch, wait, write-back -------------------------------------------------------
    def _stage(self, s: BucketShard, dtype: torch.dtype | None = None) -> torch.Tensor:
        key = (dtype or s.dtype, s.device)
        if key not in self._staging:
            size = max(x.chunk for x in self.layout if (x.dtype, x.device) == (s.dtype, s.device)) * self.world_size
            self._staging[key] = torch.empty(size, dtype=key[0], device=s.device)
        return self._staging[key][:s.chunk * self.world_size]

    def _in_place(self, s: BucketShard) -> bool:
        # A transport that reads the peers' tensors where they lie (ShmTransport reading its peers' memory): nothing
        # is copied into a staging buffer or the ring; each rank reads only its part of each peer's gradients.
        t, narrow = self.reducer.transport, BUILT_IN.get(self.reducer.hook)
        return reads_peers(t) and self.reducer.hook in BUILT_IN and (narrow is None or s.dtype == torch.float32) \
            and s.device.type == "cpu" and self.world_size > 1

    def launch(self, b: int) -> None:
        """Bucket ``b`` is full: its gradients into the staging buffer (their ``.grad`` freed), its reduction
        started. Called in bucket order on every rank, as every collective must be."""
        r, s = self.reducer, self.layout[b]
        self._launched.append(b)
        if self._in_place(s):  # no staging buffer: every bucket in flight until the end of backward
            self._launch_in_place(s)
            return
        self.finish()  # the bucket in flight gives the staging buffer back
        flat = self._stage(s)
        for k, i in enumerate(s.members):
            p, view = self.params[i], flat[s.offsets[k]:s.offsets[k] + s.numels[k]]
            g = None if r._shadowing else p.grad
            if g is None:
                view.zero_()  # unused here (find_unused_parameters): contributes zeros
            else:
                view.copy_(g.reshape(-1))
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
            handle = reduce_scatter(r.transport, out, send, b, divisor)
        else:  # any other hook reduces the whole bucket; this rank keeps its part
            out = torch.empty(s.chunk, dtype=s.dtype, device=s.device)
            handle = _HookPart(r, b, s, flat, out)
        self._flights.append(_Flight(b, handle, out, accumulate))

    def _launch_in_place(self, s: BucketShard) -> None:
        r, b = self.reducer, s.index
        self.finish(only_done=True)  # the buckets already reduced: their .grad tensors may go
        tensors = []
        for i in s.members:
            g = None if r._shadowing else self.params[i].grad
            if g is None or not g.is_contiguous() or g.dtype != s.dtype:
                fresh = torch.empty(self.params[i].shape, dtype=s.dtype, device=s.device)  # contiguous
                g = fresh.zero_() if g is None else fresh.copy_(g)
            if not r._shadowing:
                self.params[i].grad = None  # the flight holds the tensor until the peers are done reading it
            tensors.append(g.view(-1))
        accumulate = self.filled[b]
        out = torch.empty(s.chunk, dtype=s.dtype, device=s.device) if accumulate else self.parts[b]
        # Only the last bucket (every bucket, if some are skipped) waits for the peers to finish reading this rank's
        # gradients: for the others the next bucket's reduction waits for it (see _finish), one wait less each.
        settle = b == len(self.layout) - 1 or r.skip_unused
        handle = scatter_tensors(r.transport, tensors, out, b, r.hook_divisor, settle, BUILT_IN[r.hook])
        self._flights.append(_Flight(b, handle, out, accumulate, tensors, settle))

    def finish(self, only_done: bool = False) -> None:
        """Wait for the buckets in flight (``only_done``: take those already complete, in order); their results into
        this rank's parts."""
        while self._flights and (not only_done or completed(self._flights[0].handle)):
            self._finish(self._flights.popleft())

    def _finish(self, f: _Flight) -> None:
        f.handle.wait()
        part = self.parts[f.bucket]
        if f.accumulate:
            part.add_(f.result.to(part.dtype))
        elif f.result is not part:
            part.copy_(f.result)
        self.filled[f.bucket] = True
        # Gradients read where they lie: peers read this rank's until they pass the reduction's last step, which an
        # unsettled reduction does not wait for. Every later collective of the transport waits for it at its first
        # step (a peer-read reduce-scatter before it even rewrites its address table), so once this bucket's
        # reduction is complete the earlier buckets' gradients may go; its own, only if it settled. Until then they
        # must not be freed: the allocator would hand their memory to the backward while a peer still reads it.
        self._held = None if f.settled else f.held

    def write_back(self, used: list[float] | None) -> None:
        """End of a synchronised backward: every launched bucket's result is in; ``used[i]``: how many ranks used
        parameter i (None: all did). A parameter no rank used keeps no gradient, as in a single process."""
        self.finish()
        if self.reducer._graph_grads:
            raise RuntimeError(f"DistributedDataParallel (rank {self.rank}): backward(create_graph=True) is not "
                               "supported with sharded gradients (shard_gradients): the full gradients are freed")
        for b in self._launched:
            for i in self.layout[b].members:
                if used is None or used[i] > 0:
                    self.present[i] = True
        self._launched = []
        self._drop_staging()

    def _drop_staging(self) -> None:  # one staging buffer stays (the next backward's); compression's narrow ones go
        for key in [k for k in self._staging if k[0] not in {s.dtype for s in self.layout}]:
            del self._staging[key]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's ``zero_grad``: torch's meaning for this rank's parts."""
        if set_to_none:
            self.present = [False] * len(self.params)
            self.filled = [False] * len(self.layout)
        else:
            for part in self.parts:
                part.zero_()

    # ---- the optimizer's side: read the parts, gather the parameters ----------------------------------------
    def grad(self, i: int, b: int, offset: int, numel: int) -> torch.Tensor | None:
        """Parameter ``i``'s averaged gradient at ``offset:offset + numel`` of this rank's part of bucket ``b``."""
        return self.parts[b][offset:offset + numel] if self.present[i] else None

    def lay_flat(self) -> None:
        """The consumer accepted the shards: the parameters become views of one flat tensor per bucket, so that
        their gathers write straight into them (``param_gather.py``). Call before taking views of them."""
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

    def __init__(self, reducer: Any, b: int, s: BucketShard, flat: torch.Tensor, out: torch.Tensor):
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


def shard_gradients(reducer: Any, optimizer: Any, module: torch.nn.Module | None = None) -> GradientShards:
    """Start stage 2 on ``reducer`` for ``optimizer`` (see ``DistributedDataParallel.shard_gradients``)."""
    rank = reducer.transport.rank
    if not callable(getattr(optimizer, "use_gradient_shards", None)):
        raise TypeError(f"DistributedDataParallel.shard_gradients (rank {rank}): optimizer must be a "
                        f"fanfold.ZeroRedundancyOptimizer, got {type(optimizer).__name__}")
    why = ("mixed_precision (the reduction dtype differs from the parameters')" if reducer.reduce_dtype else
           "gradient_as_bucket_view=True (there are no full buckets to view)" if reducer.as_view else
           "sparse gradients (nn.Embedding(sparse=True))" if any(reducer.sparse) else
           "delay_all_reduce_named_params" if reducer.delayed else
           "a backward in progress" if reducer._queued or reducer._touched else None)
    if why:
        raise ValueError(f"DistributedDataParallel.shard_gradients (rank {rank}): not supported with {why}")
    shards = GradientShards(reducer, module)  # module: where reads of the parameters wait for their gather
    optimizer.use_gradient_shards(shards)  # may refuse: then the reducer is left as it was
    reducer.rebuilt = True  # frozen buckets: the optimizer's state is laid out after them
    # The reducer's own full-size buckets are never written again: metadata only (no memory) from here on.
    reducer.flats = [torch.empty(f.numel(), dtype=f.dtype, device="meta") for f in reducer.flats]
    reducer._views = [None if v is None else torch.empty(v.shape, dtype=v.dtype, device="meta")
                      for v in reducer._views]
    reducer._workspaces = {}
    reducer.shards = shards
    return shards
