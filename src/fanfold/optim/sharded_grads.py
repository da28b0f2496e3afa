"""ZeRO stage 2: the reducer's gradient strategy that reduce-scatters each full bucket and keeps only this rank's
part of the average, and the parameters laid flat per bucket, all-gathered in place after the step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..collectives.stall import for_feature
from ..distributed.comm_hooks import GradBucket
from ..distributed.reducer import BUILT_IN, SMALL_TENSOR_BYTES, Reducer
from .layout import Space, laid_end_to_end

__all__ = ["GradientShards", "check_shards"]


@dataclass
class _Flight:  # the bucket under reduction: its handle, its result (the part, or a temporary to add), its inputs
    bucket: int
    handle: Any
    result: torch.Tensor
    accumulate: bool
    grads: list[torch.Tensor]  # read by the collective until its wait returns: kept alive until then


class GradientShards:
    """This rank's parts of every bucket's averaged gradient: filled by ``reducer`` (its ``GradientStrategy``), read
    by the optimizer. Bucket b is a :class:`Space` over the reducer's parameters."""

    def __init__(self, reducer: Reducer):
        self.reducer, self.params = reducer, reducer.params
        self.rank, self.world_size = reducer.transport.rank, reducer.transport.world_size
        self.layout = [laid_end_to_end(self.params[m[0]].dtype, self.params[m[0]].device, list(m),
                                       [self.params[i].numel() for i in m], self.world_size)
                       for m in reducer.buckets]
        self.parts = [torch.zeros(s.shard, dtype=s.dtype, device=s.device) for s in self.layout]
        self.filled = [False] * len(self.layout)  # parts[b] holds gradients not yet zeroed: they accumulate
        self.present = [False] * len(self.params)  # parameter i has a gradient: some rank used it
        self._flight: _Flight | None = None
        self._launched: list[int] = []
        self.flats: list[torch.Tensor] = []  # the parameters laid flat, one tensor per bucket (lay_flat)
        # step()'s all-gather over DDP's transport, numbered apart: a rank that skips step() is named as ZeRO's
        self.gather_transport = for_feature(reducer.transport, "ZeroRedundancyOptimizer")

    def launch(self, b: int) -> None:
        """Bucket ``b`` is full: its reduction started on the gradients where autograd left them (``.grad`` let go;
        a parameter unused here contributes zeros)."""
        r, s = self.reducer, self.layout[b]
        self._launched.append(b)
        self.finish()  # one bucket in flight: its gradients are the only ones held past their reduction
        grads = []
        for i in s.indices:
            p = self.params[i]
            grads.append(torch.zeros(p.numel(), dtype=s.dtype, device=s.device) if p.grad is None
                         else p.grad.reshape(-1))
            p.grad = None
        if s.total * grads[0].element_size() < SMALL_TENSOR_BYTES * len(grads):
            grads = [torch.cat(grads)]  # small gradients: one copy costs less than the transport's work per tensor
        accumulate, narrow = self.filled[b], BUILT_IN.get(r.hook)
        if r.hook in BUILT_IN and (narrow is None or s.dtype == torch.float32):  # as the reducer's built-in path
            out = torch.empty(s.shard, dtype=s.dtype, device=s.device) if accumulate else self.parts[b]
            handle: Any = r.transport.reduce_scatter_tensors(grads, out, b, divisor=r.hook_divisor,
                                                             compress=narrow)
        else:  # any other hook (or a compression of other dtypes) reduces the whole bucket; this rank keeps its part
            flat = torch.zeros(s.shard * self.world_size, dtype=s.dtype, device=s.device)
            torch.cat(grads, out=flat[:s.total])
            out = torch.empty(s.shard, dtype=s.dtype, device=s.device)
            handle = _HookPart(r, b, s, s.slice(self.rank), flat, out)
        self._flight = _Flight(b, handle, out, accumulate, grads)

    def finish(self) -> None:
        f, self._flight = self._flight, None
        if f is None:
            return
        f.handle.wait()
        part = self.parts[f.bucket]
        if f.accumulate:
            part.add_(f.result)
        elif f.result is not part:
            part.copy_(f.result)
        self.filled[f.bucket] = True

    def write_back(self, used: list[float] | None) -> None:
        """End of a synchronised backward; ``used[i]``: how many ranks used parameter i (None: all did). A parameter
        no rank used keeps no gradient, as in a single process."""
        self.finish()
        for b in self._launched:
            for i in self.layout[b].indices:
                if used is None or used[i] > 0:
                    self.present[i] = True
        self._launched = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        if set_to_none:
            self.present = [False] * len(self.params)
            self.filled = [False] * len(self.layout)
        else:
            for part in self.parts:
                part.zero_()

    def grad(self, i: int, b: int, offset: int, numel: int) -> torch.Tensor | None:
        return self.parts[b][offset:offset + numel] if self.present[i] else None

    @torch.no_grad()
    def lay_flat(self) -> None:
        """The parameters become views of one flat tensor per bucket (their gathers write straight into them)."""
        for s in self.layout:
            flat = torch.zeros(s.shard * self.world_size, dtype=s.dtype, device=s.device)
            for i, start, numel in zip(s.indices, s.starts, s.numels):
                p, view = self.params[i], flat[start:start + numel]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(p.shape)  # the Parameter object, its hooks and .grad stay
            self.flats.append(flat)

    @torch.no_grad()
    def gather_params(self) -> None:
        if self.world_size == 1:
            return
        t = self.gather_transport
        for work in [t.all_gather(flat[self.rank * s.shard:][:s.shard], flat, b)
                     for b, (s, flat) in enumerate(zip(self.layout, self.flats))]:
            work.wait()


class _HookPart:
    """A user's comm hook on bucket ``b`` (staged in ``flat``); ``wait()`` leaves this rank's ``part`` in ``out``."""

    def __init__(self, reducer: Reducer, b: int, s: Space, part: tuple[int, int], flat: torch.Tensor,
                 out: torch.Tensor):
        whole = flat[:s.total]
        views = [whole[o:o + m].view(reducer.params[i].shape) for i, o, m in zip(s.indices, s.starts, s.numels)]
        bucket = GradBucket(b, whole, [reducer.params[i] for i in s.indices], views, b == len(reducer.buckets) - 1,
                            reducer.hook_divisor, reducer.all_reduce)
        self._future, self._whole, self._out, self._part = reducer.hook(reducer.hook_state, bucket), whole, out, part

    def wait(self) -> None:
        result = self._future.wait()
        if isinstance(result, (list, tuple)):  # a torch future of a c10d work yields [tensor]
            result = result[0]
        result = result.reshape(-1) if isinstance(result, torch.Tensor) else self._whole
        lo, hi = self._part
        self._out[:hi - lo].copy_(result[lo:hi])


def check_shards(shards: GradientShards, params: list[torch.Tensor], rank: int, world_size: int) -> list[int]:
    """The optimizer's index of each of the reducer's parameters; ValueError unless both hold the same ones."""
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
