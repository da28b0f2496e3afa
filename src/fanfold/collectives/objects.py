"""Object collectives without numpy (torch's unpickle through ``Tensor.numpy()``; fanfold declares torch and tqdm
only): each rank pickles its object into a uint8 tensor, the ranks exchange the lengths, then the bytes padded to the
longest, through an inspected transport (a stall names the feature). Unpickling runs whatever the peers sent: use
them between trusted ranks only, as torch's.
"""
from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from .stall import InspectedTransport, group_transport

__all__ = ["all_gather_object", "gather_object", "broadcast_object", "wire_device"]


def wire_device(group: Any = None) -> torch.device:
    """The device an object's bytes travel on in ``group``: the CPU where the group's backend takes CPU tensors
    (gloo, fanfold, ``"cpu:gloo,cuda:nccl"``), else the current device of the backend's device type (NCCL: the
    current CUDA device, as torch's own object collectives)."""
    types: list[str] = []
    for part in dist.get_backend(group).lower().split(","):
        device, _, backend = part.rpartition(":")
        types += [device] if device else dist.Backend.backend_capability.get(backend, ["cpu"])
    if not types or "cpu" in types:
        return torch.device("cpu")
    return torch.device(types[0], torch.get_device_module(types[0]).current_device())


def all_gather_object(obj: Any, group: Any = None, *, transport: InspectedTransport | None = None) -> list:
    """Every rank's ``obj``, by rank in ``group`` (collective). Each entry is an unpickled copy, this rank's too.
    ``transport``: the caller's inspected transport on ``group`` (default: one made for this call)."""
    t = transport or group_transport(group, "all_gather_object")
    device = wire_device(group)
    data = _pickled(obj, device)
    sizes = _all_sizes(t, data.numel(), device)
    longest = max(sizes)
    out = torch.empty(longest * len(sizes), dtype=torch.uint8, device=device)
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
    device = wire_device(group)
    # Sums in which only src contributes, rather than the transport's broadcast: an asynchronous collective, whose
    # wait the stall inspector bounds (a synchronous broadcast is bounded by the group's timeout only).
    data = _pickled(obj, device) if t.rank == src else None
    size = torch.tensor([0 if data is None else data.numel()], dtype=torch.long, device=device)
    t.all_reduce(size).wait()
    if data is None:
        data = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    t.all_reduce(data).wait()
    return obj if t.rank == src else _unpickled(data, data.numel())


def _pickled(obj: Any, device: torch.device) -> torch.Tensor:
    # torch.frombuffer, not numpy; it wants a writable buffer (a pickle is never empty, which it would refuse)
    data = bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    return torch.frombuffer(data, dtype=torch.uint8).to(device)


def _unpickled(data: torch.Tensor, size: int) -> Any:
    out = bytearray(size)
    torch.frombuffer(out, dtype=torch.uint8).copy_(data[:size])
    return pickle.loads(out)


def _padded(data: torch.Tensor, length: int) -> torch.Tensor:
    # zeros, not torch.empty: a rank's padding would otherwise send whatever its memory held
    return torch.cat([data, data.new_zeros(length - data.numel())]) if data.numel() < length else data


def _all_sizes(t: InspectedTransport, size: int, device: torch.device) -> list[int]:
    sizes = torch.zeros(t.world_size, dtype=torch.long, device=device)
    t.all_gather(torch.tensor([size], dtype=torch.long, device=device), sizes).wait()
    return sizes.tolist()


def _check_rank(name: str, value: Any, t: InspectedTransport) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < t.world_size:
        raise ValueError(f"{name}={value!r} is not a rank of the group (0..{t.world_size - 1})")
