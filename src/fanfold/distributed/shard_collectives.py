"""The two collectives of ZeRO stage 2 on DDP's transport: reduce-scatter (each rank gets the average of its own part
of a bucket; on the shm transport with peer reads, straight from the ``.grad`` tensors: ``scatter_tensors``) and
all-gather (every rank's updated part to every rank).

Layer: ``distributed``, under ``sharded_grads.py``; both are methods of the collective interface
(``collectives/protocol.py``): the shm transport's own, torch's on a NCCL group. On gloo (``TorchTransport`` without
``native_scatter``) the reduce-scatter is an all-reduce of which this rank keeps its part, and ``gathers`` is False:
the caller broadcasts each piece from its owner instead, in place (gloo's all-reduce and broadcasts were faster than
its reduce-scatter and all-gather).
"""
from __future__ import annotations

from typing import Any

import torch

from ..collectives.protocol import Transport
from ..collectives.stall import InspectedTransport
from ..collectives.work import completed_work

__all__ = ["reduce_scatter", "scatter_tensors", "all_gather", "gathers", "completed", "reads_peers"]


def reads_peers(transport: InspectedTransport) -> bool:
    """Whether ``transport`` all-reduces tensors where they lie (the shm transport reading its peers' memory)."""
    return transport.reads_peers()


def reduce_scatter(t: Transport, out: torch.Tensor, tensor: torch.Tensor, bucket: int,
                   divisor: float | None) -> Any:
    """Start ``out`` = (sum over ranks of part ``rank`` of ``tensor``) / ``divisor``; a handle with ``wait()``."""
    if t.world_size == 1:
        out.copy_(tensor if divisor is None else tensor / divisor)
        return completed_work(out)
    return t.reduce_scatter(tensor, out, bucket, divisor=divisor)


def scatter_tensors(t: InspectedTransport, tensors: list[torch.Tensor], out: torch.Tensor, bucket: int,
                    divisor: float | None, settle: bool, compress: torch.dtype | None) -> Any:
    """Start ``out`` = this rank's part of the average of ``tensors`` laid end to end, read where they lie (the shm
    transport where :func:`reads_peers`: ``ShmTransport.reduce_scatter_tensors``); numbered by the stall inspector
    as any other collective when ``t`` is inspected."""
    kw = {"divisor": divisor, "settle": settle, **({} if compress is None else {"compress": compress})}
    return t.reduce_scatter_tensors(tensors, out, bucket, **kw)


def gathers(t: InspectedTransport) -> bool:
    """Whether :func:`all_gather` is the way to gather; else the caller broadcasts each piece (gloo)."""
    return t.gathers()


def all_gather(t: Transport, out: torch.Tensor, part: torch.Tensor, bucket: int) -> Any:
    """Start ``out`` = every rank's ``part``, by rank (where :func:`gathers`); ``part`` may be a view of ``out``
    (this rank's place)."""
    return t.all_gather(part, out, bucket)


def completed(handle: Any) -> bool:
    """Whether a handle is done, without waiting (False when it cannot tell)."""
    if callable(getattr(handle, "is_completed", None)):
        return bool(handle.is_completed())
    future = handle.get_future() if callable(getattr(handle, "get_future", None)) else None
    return future is not None and future.done()
