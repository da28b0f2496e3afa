"""The collective interface of fanfold's reducer and DDP, and its implementation on torch.distributed.

Every collective that DistributedDataParallel issues -- bucket all-reduces, the fingerprint exchange, parameter and
buffer broadcasts, join-state exchanges -- goes through one transport object, so another implementation (the
shared-memory ``ShmTransport`` of ``shm.py``) or a wrapper (the stall inspector of ``stall.py``, which numbers each
collective) can stand in without touching the reducer. A transport has:

- ``all_reduce(tensor, bucket=None) -> handle``: in-place SUM over the group, asynchronous; ``handle.wait()``
  blocks until ``tensor`` holds the sum. ``bucket`` is a label only (the gradient bucket index, None otherwise);
  a transport may ignore it, a wrapper may record it.
- ``broadcast(tensor, src) -> None``: in place, synchronous; ``src`` is a rank of the group.
- ``barrier() -> None``.
- ``rank``, ``world_size`` attributes.

Optional, announced by class attributes so that the reducer can rely on them: ``supports_divisor`` --
``all_reduce(tensor, bucket=None, divisor=d)`` leaves the sum divided by ``d``; ``supports_reduce_into`` --
``reduce_into(tensor, outs, bucket=None, divisor=None) -> handle`` writes the result into the private tensors
``outs`` (which split ``tensor``'s length, in order) instead; ``supports_reduce_tensors`` (may be an instance
attribute) -- ``reduce_tensors(tensors, bucket=None, divisor=None, settle=True) -> handle`` all-reduces a list of
contiguous tensors in place (the reducer then never copies gradients into a bucket). Without them the reducer
divides and copies itself.

Small exchanges of structured data are built from ``all_reduce`` alone (:func:`all_gather_rows`), summing rows that
only their owner fills, in float32 with values below 2**24 so that the sum is exact on every transport.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .._core.group import require_initialized

__all__ = ["TorchTransport", "DividedWork", "issue_all_reduce", "all_gather_rows", "all_gather_bytes"]


class TorchTransport:
    """The transport interface on a torch.distributed process group (``group=None``: the default group)."""

    def __init__(self, group: Any = None):
        require_initialized("TorchTransport")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_reduce(self, tensor: torch.Tensor, bucket: int | None = None) -> Any:
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        # src is a rank of this group; torch wants the global rank.
        global_src = src if self.group is None else dist.get_global_rank(self.group, src)
        dist.broadcast(tensor, global_src, group=self.group)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def __repr__(self) -> str:
        return f"TorchTransport(rank={self.rank}, world_size={self.world_size}, backend={dist.get_backend(self.group)})"


class DividedWork:
    """A transport's handle whose ``wait()`` also divides the tensor by ``divisor`` (once): an average from a
    transport without ``supports_divisor``."""

    def __init__(self, handle: Any, tensor: torch.Tensor, divisor: float):
        self._handle, self._tensor, self._divisor = handle, tensor, divisor

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._handle.wait(*args, **kwargs)
        if self._divisor is not None:
            self._tensor.div_(self._divisor)
            self._divisor = None
        return result


def issue_all_reduce(transport: Any, tensor: torch.Tensor, bucket: int | None = None,
                     divisor: float | None = None) -> Any:
    """``transport.all_reduce`` of ``tensor`` labelled ``bucket``; with ``divisor`` the result is the sum divided by
    it -- by the transport in its pass over memory where it can (``supports_divisor``), else after the wait."""
    if divisor is None:
        return transport.all_reduce(tensor, bucket=bucket)
    if getattr(transport, "supports_divisor", False):
        return transport.all_reduce(tensor, bucket=bucket, divisor=divisor)
    return DividedWork(transport.all_reduce(tensor, bucket=bucket), tensor, divisor)


def all_gather_rows(transport: Any, row: torch.Tensor) -> torch.Tensor:
    """Every rank's float32 ``row`` (same length everywhere), stacked by rank: one all-reduce of a zero matrix
    whose row ``rank`` this rank fills. Values must be integers below 2**24 for the sum to be exact."""
    table = torch.zeros(transport.world_size, row.numel(), dtype=torch.float32, device=row.device)
    table[transport.rank] = row.to(torch.float32)
    transport.all_reduce(table).wait()
    return table


def all_gather_bytes(transport: Any, data: bytes, device: torch.device | str = "cpu") -> list[bytes]:
    """Every rank's ``data`` by rank, in two fixed-shape all-reduces (lengths, then the padded bytes)."""
    lengths = all_gather_rows(transport, torch.tensor([float(len(data))], device=device))[:, 0].long().tolist()
    if max(lengths) == 0:
        return [b""] * len(lengths)
    row = torch.zeros(max(lengths), dtype=torch.float32, device=device)
    if data:
        row[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device=device, dtype=torch.float32)
    table = all_gather_rows(transport, row).to(torch.uint8).cpu()
    return [bytes(table[r, :n].tolist()) for r, n in enumerate(lengths)]
