"""The two collectives of ZeRO stage 2, on whatever transport DDP uses: reduce-scatter (each rank gets the average of
its own part of a bucket) and all-gather (every rank's updated part to every rank).

Layer: ``distributed``, under ``sharded_grads.py``; transports are ``collectives``. A transport plugs in its own by
announcing ``supports_reduce_scatter`` -- ``reduce_scatter(out, tensor, bucket=None, divisor=None) -> handle``:
``out`` (``tensor.numel() / N`` elements) gets the sum of every rank's part ``rank`` of ``tensor``, divided by
``divisor`` when given; ``tensor`` may be overwritten -- and ``supports_all_gather`` -- ``all_gather(out, part,
bucket=None) -> handle``: ``out`` (``N`` parts) gets every rank's ``part`` by rank. Without them: torch's own
collectives on the group of a ``TorchTransport`` (``reduce_scatter_tensor``, ``all_gather_single``), except on
gloo, whose all-reduce and broadcasts were faster than its reduce-scatter and all-gather in a first (contended)
measurement, to be confirmed on a quiet machine. Otherwise -- gloo,
and the shm transport until it has its own -- the reduction is an all-reduce of the whole tensor, of which this
rank keeps its part (the same result and memory for twice the bytes; announced once per process for a transport
that is not torch's), and the gather is one broadcast per piece from its owner (``gathers`` says which).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..collectives.transport import DividedWork, TorchTransport, issue_all_reduce

__all__ = ["ShardOps", "reduce_scatter", "all_gather", "gathers", "completed"]


@dataclass
class ShardOps:
    """How one transport does the two collectives; ``announced`` keeps each fallback's warning to once."""

    transport: Any
    announced: set
    native: bool | None = None  # torch's reduce_scatter/all_gather on a TorchTransport; None: unless gloo

    @property
    def torch_group(self) -> tuple[bool, Any]:
        """Whether to call torch's own collectives, and on which group."""
        inner = getattr(self.transport, "inner", self.transport)  # under the stall inspector
        group = getattr(inner, "group", None)
        if not isinstance(inner, TorchTransport):
            return False, group
        return (dist.get_backend(group) != "gloo" if self.native is None else self.native), group

    def fallback(self, what: str, instead: str) -> None:
        """Announce, once, that a transport other than torch's lacks ``what``."""
        if isinstance(getattr(self.transport, "inner", self.transport), TorchTransport):
            return  # chosen on purpose: faster than torch's own on gloo
        self.announce(what, instead)

    def run(self, kind: str, bucket: int | None, call: Any) -> Any:
        # numbered and bounded by the stall inspector where DDP's transport has one (stall.py)
        inspector = getattr(self.transport, "inspector", None)
        return call() if inspector is None else inspector.run(kind, bucket, call)

    def announce(self, what: str, instead: str) -> None:
        if what not in self.announced:
            self.announced.add(what)
            name = type(getattr(self.transport, "inner", self.transport)).__name__
            warnings.warn(f"ZeRO stage 2 (rank {self.transport.rank}): {name} has no {what}; {instead} (the same "
                          f"result and memory, twice the bytes moved)", stacklevel=3)


class _KeepPart:
    """An all-reduce's handle whose ``wait()`` copies this rank's part of the result into ``out``."""

    def __init__(self, handle: Any, tensor: torch.Tensor, out: torch.Tensor, rank: int):
        self._handle, self._tensor, self._out, self._rank = handle, tensor, out, rank

    def wait(self) -> Any:
        if self._handle is not None:
            self._handle.wait()
            n = self._out.numel()
            self._out.copy_(self._tensor[self._rank * n:(self._rank + 1) * n])
            self._handle = None
        return self._out


class _Done:
    def wait(self) -> None:
        return None


def reduce_scatter(ops: ShardOps, out: torch.Tensor, tensor: torch.Tensor, bucket: int,
                   divisor: float | None) -> Any:
    """Start ``out`` = (sum over ranks of part ``rank`` of ``tensor``) / ``divisor``; a handle with ``wait()``."""
    t = ops.transport
    if t.world_size == 1:
        out.copy_(tensor if divisor is None else tensor / divisor)
        return _Done()
    if getattr(t, "supports_reduce_scatter", False):
        return ops.run("reduce_scatter", bucket,
                       lambda: t.reduce_scatter(out, tensor, bucket=bucket, divisor=divisor))
    native, group = ops.torch_group
    if native:
        handle = ops.run("reduce_scatter", bucket, lambda: dist.reduce_scatter_tensor(
            out, tensor, op=dist.ReduceOp.SUM, group=group, async_op=True))
        return handle if divisor is None else DividedWork(handle, out, divisor)
    ops.fallback("reduce_scatter", "each bucket is all-reduced whole instead and this rank keeps its part")
    return _KeepPart(issue_all_reduce(t, tensor, bucket, divisor), tensor, out, t.rank)


def gathers(ops: ShardOps) -> bool:
    """Whether :func:`all_gather` has a true all-gather to use; else the caller broadcasts each piece."""
    return bool(getattr(ops.transport, "supports_all_gather", False)) or ops.torch_group[0]


def all_gather(ops: ShardOps, out: torch.Tensor, part: torch.Tensor, bucket: int) -> Any:
    """Start ``out`` = every rank's ``part``, by rank (where :func:`gathers`); ``part`` may be a view of ``out``
    (this rank's place)."""
    t = ops.transport
    if getattr(t, "supports_all_gather", False):
        return ops.run("all_gather", bucket, lambda: t.all_gather(out, part, bucket=bucket))
    _, group = ops.torch_group
    send = part.clone() if _overlaps(part, out) else part  # in-place all-gathers are not promised
    # torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return ops.run("all_gather", bucket, lambda: gather(out, send, group=group, async_op=True))


def _overlaps(part: torch.Tensor, out: torch.Tensor) -> bool:
    lo, hi = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
    return lo <= part.data_ptr() < hi


def completed(handle: Any) -> bool:
    """Whether a handle is done, without waiting (False when it cannot tell)."""
    if callable(getattr(handle, "is_completed", None)):
        return bool(handle.is_completed())
    future = handle.get_future() if callable(getattr(handle, "get_future", None)) else None
    return future is not None and future.done()
