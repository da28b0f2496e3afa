"""Object collectives: any picklable object gathered or broadcast over a process group, without numpy.

torch's ``all_gather_object``, ``gather_object`` and ``broadcast_object_list`` unpickle through ``Tensor.numpy()``
and fail with "Numpy is not available" where numpy is not installed; fanfold declares torch and tqdm only, so every
fanfold module uses these instead. Same wire as torch's: each rank pickles its object into a uint8 tensor, the ranks
exchange the lengths, then the bytes padded to the longest, and unpickle: two collectives per call, on the
device ``wire_device(group)`` names.
Unpickling runs whatever the peers sent: use them between trusted ranks only, as torch's.
"""
from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from .._core.buffers import bytes_to_tensor, tensor_to_bytes

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


def all_gather_object(obj: Any, group: Any = None) -> list:
    """Every rank's ``obj``, by rank in ``group`` (collective). Each entry is an unpickled copy, this rank's too."""
    device = wire_device(group)
    data = _pickled(obj, device)
    sizes = _all_sizes(data.numel(), group, device)
    longest = max(sizes)
    out = torch.empty(longest * len(sizes), dtype=torch.uint8, device=device)
    dist.all_gather(list(out.split(longest)), _padded(data, longest), group=group)
    return [_unpickled(part, n) for part, n in zip(out.split(longest), sizes)]


def gather_object(obj: Any, dst: int = 0, group: Any = None) -> list | None:
    """Every rank's ``obj`` by rank on rank ``dst`` of ``group`` (a rank in the group, not a global one); None on
    the others (collective)."""
    rank = _check_rank("dst", dst, group)
    device = wire_device(group)
    data = _pickled(obj, device)
    sizes = _all_sizes(data.numel(), group, device)  # every rank pads to the longest, so every rank needs them all
    longest = max(sizes)
    out = torch.empty(longest * len(sizes), dtype=torch.uint8, device=device) if rank == dst else None
    dist.gather(_padded(data, longest), None if out is None else list(out.split(longest)), dst=_global(group, dst),
                group=group)
    return None if out is None else [_unpickled(part, n) for part, n in zip(out.split(longest), sizes)]


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Rank ``src``'s ``obj`` (a rank in ``group``, not a global one) on every rank; the others' ``obj`` is ignored
    (collective). The sender gets its own ``obj`` back, the others an unpickled copy."""
    rank = _check_rank("src", src, group)
    device = wire_device(group)
    data = _pickled(obj, device) if rank == src else None
    size = torch.tensor([0 if data is None else data.numel()], dtype=torch.long, device=device)
    dist.broadcast(size, src=_global(group, src), group=group)
    if data is None:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=_global(group, src), group=group)
    return obj if rank == src else _unpickled(data, data.numel())


def _pickled(obj: Any, device: torch.device) -> torch.Tensor:
    return bytes_to_tensor(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).to(device)


def _unpickled(data: torch.Tensor, size: int) -> Any:
    return pickle.loads(tensor_to_bytes(data[:size]))


def _padded(data: torch.Tensor, length: int) -> torch.Tensor:
    # zeros, not torch.empty: a rank's padding would otherwise send whatever its memory held
    return torch.cat([data, data.new_zeros(length - data.numel())]) if data.numel() < length else data


def _all_sizes(size: int, group: Any, device: torch.device) -> list[int]:
    sizes = torch.zeros(dist.get_world_size(group), dtype=torch.long, device=device)
    dist.all_gather(list(sizes.split(1)), torch.tensor([size], dtype=torch.long, device=device), group=group)
    return sizes.tolist()


def _check_rank(name: str, value: Any, group: Any) -> int:
    """This process's rank in ``group``, after checking that ``value`` is a rank of it."""
    world = dist.get_world_size(group)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < world:
        raise ValueError(f"{name}={value!r} is not a rank of the group (0..{world - 1})")
    return dist.get_rank(group)


def _global(group: Any, rank: int) -> int:
    """torch's gather and broadcast take the global rank of a group member."""
    return rank if group is None else dist.get_global_rank(group, rank)
