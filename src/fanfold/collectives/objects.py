"""Object collectives without numpy (torch's unpickle goes through ``Tensor.numpy()``): each rank pickles its object
into a uint8 tensor; the ranks exchange the lengths, then the bytes padded to the longest, through an inspected
transport (a stall names the feature). Unpickling runs whatever the peers sent: between trusted ranks only.
"""
from __future__ import annotations

import pickle
from typing import Any

import torch

from .stall import InspectedTransport, group_transport

__all__ = ["all_gather_object", "gather_object", "broadcast_object"]


def all_gather_object(obj: Any, group: Any = None, *, transport: InspectedTransport | None = None) -> list:
    """Every rank's ``obj``, by rank in ``group`` (collective). Each entry is an unpickled copy, this rank's too.
    ``transport``: the caller's inspected transport on ``group`` (default: one made for this call)."""
    t = transport or group_transport(group, "all_gather_object")
    data = _pickled(obj)
    sizes = torch.zeros(t.world_size, dtype=torch.long)
    t.all_gather(torch.tensor([data.numel()]), sizes).wait()
    sizes = sizes.tolist()
    longest = max(sizes)
    out = torch.empty(longest * len(sizes), dtype=torch.uint8)
    t.all_gather(_padded(data, longest), out).wait()
    return [_unpickled(part, n) for part, n in zip(out.split(longest), sizes)]


def gather_object(obj: Any, dst: int = 0, group: Any = None, *, transport: InspectedTransport | None = None
                  ) -> list | None:
    """Every rank's ``obj`` by rank on rank ``dst`` of ``group`` (a rank in the group, not a global one); None on
    the others (collective). An all-gather: the transport's one way to collect from every rank."""
    t = transport or group_transport(group, "gather_object")
    _check_rank("dst", dst, t)
    every = all_gather_object(obj, group, transport=t)
    return every if t.rank == dst else None


def broadcast_object(obj: Any, src: int = 0, group: Any = None, *, transport: InspectedTransport | None = None
                     ) -> Any:
    """Rank ``src``'s ``obj`` (a rank in ``group``, not a global one) on every rank; the others' ``obj`` is ignored
    (collective). The sender gets its own ``obj`` back, the others an unpickled copy."""
    t = transport or group_transport(group, "broadcast_object")
    _check_rank("src", src, t)
    # Sums in which only src contributes, rather than the transport's broadcast: an asynchronous collective, whose
    # wait the stall inspector bounds (a synchronous broadcast is bounded by the group's timeout only).
    data = _pickled(obj) if t.rank == src else None
    size = torch.tensor([0 if data is None else data.numel()])
    t.all_reduce(size).wait()
    if data is None:
        data = torch.zeros(int(size.item()), dtype=torch.uint8)
    t.all_reduce(data).wait()
    return obj if t.rank == src else _unpickled(data, data.numel())


def _pickled(obj: Any) -> torch.Tensor:
    # torch.frombuffer, not numpy; it wants a writable buffer (a pickle is never empty, which it would refuse)
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)


def _unpickled(data: torch.Tensor, size: int) -> Any:
    out = bytearray(size)
    torch.frombuffer(out, dtype=torch.uint8).copy_(data[:size])
    return pickle.loads(out)


def _padded(data: torch.Tensor, length: int) -> torch.Tensor:
    # zeros, not torch.empty: a rank's padding would otherwise send whatever its memory held
    return torch.cat([data, data.new_zeros(length - data.numel())]) if data.numel() < length else data


def _check_rank(name: str, value: Any, t: InspectedTransport) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < t.world_size:
        raise ValueError(f"{name}={value!r} is not a rank of the group (0..{t.world_size - 1})")
