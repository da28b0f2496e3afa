"""The collective interface: what every fanfold feature that reaches other ranks asks of a transport.

Implemented in full by ``TorchTransport`` (``transport.py``, on a torch.distributed process group), ``ShmTransport``
(``shm/transport.py``, shared memory on one host) and the stall inspector's ``InspectedTransport`` (``stall.py``),
which delegates each method once and is what the features above ``collectives`` hold. Nothing is optional: where a
transport has a faster way (peer reads, shared buckets), it takes it inside the method. Collectives match by issue
order, so every rank calls the same methods with the same sizes in the same order.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Transport", "Work", "TransportOwner"]


@runtime_checkable
class Work(Protocol):
    """The handle of an asynchronous collective: ``wait()`` blocks until its result is in place."""

    def wait(self) -> Any: ...


@runtime_checkable
class Transport(Protocol):
    """Collectives over the ranks ``0..world_size-1`` of one group; this process is ``rank``."""

    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor, bucket: int | None = None, divisor: float | None = None) -> Work:
        """In-place SUM of ``tensor`` over the group, divided by ``divisor`` when given (bitwise the sum, then a
        division). ``bucket`` is a label for diagnostics (the gradient bucket index, None otherwise)."""
        ...

    def reduce_tensors(self, tensors: Sequence[torch.Tensor], bucket: int | None = None, *,
                       divisor: float | None = None, settle: bool = True,
                       compress: torch.dtype | None = None) -> Work:
        """All-reduce ``tensors`` (contiguous, one dtype, not overlapping), laid end to end as one tensor, in place:
        DDP's gradients where autograd left them. ``divisor``: as ``all_reduce``. The tensors must not change until
        the wait returns; with ``settle=False`` (every rank alike) not until a later collective of this transport
        has returned either. ``compress`` (torch.bfloat16 or torch.float16, float32 tensors): cast to it, average,
        cast back, as the compression hook of that name does on a bucket of these tensors. ``TorchTransport``: bitwise
        torch's hook; ``ShmTransport``: fanfold's (``comm_hooks``: the same bits on 2 ranks, but for values in
        float16's subnormal range, which fanfold rounds once where torch rounds twice)."""
        ...

    def reduce_scatter(self, tensor: torch.Tensor, out: torch.Tensor, bucket: int | None = None, *,
                       divisor: float | None = None) -> Work:
        """The sum over the group of ``tensor`` (world_size times ``out``'s elements), divided by ``divisor`` when
        given; this rank's part (rank r: elements r * n .. (r + 1) * n) into ``out``. ``tensor`` may be overwritten.
        ZeRO stage 2's gradient reduction."""
        ...

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor, bucket: int | None = None) -> Work:
        """Every rank's ``tensor`` (the same size on every rank) into ``out``, by rank. ZeRO's parameter gather."""
        ...

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Rank ``src``'s ``tensor`` into every rank's, in place, synchronously."""
        ...

    def barrier(self) -> None:
        """Return once every rank has reached it."""
        ...

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """A zeroed 1-d tensor that this transport all-reduces fastest (DDP's buckets, where a hook fills them).
        Collective: every rank allocates the same sizes in the same order."""
        ...


@runtime_checkable
class TransportOwner(Protocol):
    """A process group that runs its collectives on a transport of its own (the ``fanfold`` backend's group):
    fanfold's DDP on such a group uses that transport, so torch's calls and DDP's share one collective layer."""

    def shared_transport(self) -> Transport | None:
        """The group's transport (None: it has none, e.g. ranks on different hosts). Collective at first use."""
        ...
