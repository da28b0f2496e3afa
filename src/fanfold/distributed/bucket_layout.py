"""Where the reducer's gradients live: flat bucket tensors, one view per parameter, rebuilt once from rank 0's order.

Layers: ``buckets <- bucket_layout <- bucket_paths <- reducer``. ``BucketLayout`` turns the assignment of
``buckets.py`` into memory: one flat tensor per bucket (in the bucket dtype: the parameters' own, or mixed
precision's ``reduce_dtype``) and a view of it per dense parameter; sparse parameters have no bucket. After the
first synchronised backward the layout is rebuilt, once, from the order in which gradients became ready on rank 0
(broadcast, so that every rank builds the same buckets); where a hook fills the buckets, the rebuilt ones live in
the memory the transport reduces fastest (``Transport.allocate``: for ``ShmTransport``, memory its peers read).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..collectives.protocol import Transport
from .buckets import assign_buckets, rebuild_order

__all__ = ["BucketLayout"]


class BucketLayout:
    """Bucket memory of ``self.params`` (minus the sparse ones); set up by ``Reducer``, which owns the params."""

    params: list[torch.nn.Parameter]
    sparse: list[bool]
    transport: Transport
    as_view: bool
    _direct: bool

    def __init__(self, caps: Sequence[int], reduce_dtype: torch.dtype | None) -> None:
        self.caps, self.reduce_dtype = list(caps), reduce_dtype
        self.rebuilt = False
        self._choose_path()
        self._build(None)

    def _choose_path(self) -> None:
        raise NotImplementedError

    def _bucket_dtype(self, p: torch.Tensor) -> torch.dtype:
        return self.reduce_dtype or p.dtype

    def _build(self, order: list[int] | None) -> None:
        ps = self.params
        dense = [i for i in range(len(ps)) if not self.sparse[i]]
        position = {i: k for k, i in enumerate(dense)}
        sizes = [ps[i].numel() * torch.empty(0, dtype=self._bucket_dtype(ps[i])).element_size() for i in dense]
        keys = [(self._bucket_dtype(ps[i]), ps[i].device) for i in dense]
        groups = assign_buckets(sizes, keys, order=None if order is None else
                                [position[i] for i in order if i in position], caps=self.caps)
        groups = [[dense[k] for k in members] for members in groups]
        old_views = getattr(self, "_views", None)
        self.buckets, self.flats, self._views, self._loc = groups, [], [None] * len(ps), [None] * len(ps)
        self._workspaces: dict[tuple, torch.Tensor] = {}
        for b, members in enumerate(groups):
            first = ps[members[0]]
            flat = self._bucket_memory(sum(ps[i].numel() for i in members), self._bucket_dtype(first), first.device)
            offset = 0
            for i in members:
                n = ps[i].numel()
                self._views[i] = flat[offset: offset + n].view(ps[i].shape)
                self._loc[i] = (b, offset, n)
                offset += n
            self.flats.append(flat)
        if self.as_view and old_views is not None:
            for i, p in enumerate(ps):  # keep .grad a view into the (new) bucket
                if p.grad is not None and p.grad is old_views[i]:
                    self._views[i].copy_(p.grad)
                    p.grad = self._views[i]

    def _bucket_memory(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # The transport's memory (ShmTransport's: all-reduced in place, no copy into its ring) for the buckets
        # rebuilt after the first backward: every rank rebuilds the same buckets at the same point (allocate is
        # collective). Not on the direct path, whose buckets never hold data.
        if self.rebuilt and not self._direct:
            return self.transport.allocate(numel, dtype, device)
        return torch.zeros(numel, dtype=dtype, device=device)

    def _workspace(self, b: int, dtype: torch.dtype) -> torch.Tensor:
        """Bucket ``b``'s scratch tensor of ``dtype`` (a compression hook's narrow copy), kept across steps. Every
        rank's hooks ask for the same ones in bucket order, so taking it from the transport stays collective."""
        key = (b, dtype)
        if key not in self._workspaces:
            flat = self.flats[b]
            self._workspaces[key] = self._bucket_memory(flat.numel(), dtype, flat.device)
        return self._workspaces[key]

    def _rebuild(self, ready_order: list[int]) -> None:
        """Adopt rank 0's observed gradient-ready order, once, so that every rank builds the same buckets."""
        if self.rebuilt:
            return
        order = torch.tensor(rebuild_order(ready_order, len(self.params)), dtype=torch.float32)
        self.transport.broadcast(order, 0)
        self.rebuilt = True
        new = [int(i) for i in order.tolist()]
        current = [i for members in self.buckets for i in members]
        if [i for i in new if not self.sparse[i]] != current or not self._direct:
            self._build(new)  # a hook's buckets move into the transport's memory
