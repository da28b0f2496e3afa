"""Plain-tensor communication between devices of one process, without autograd.

``broadcast``, ``reduce_add``, ``scatter`` and ``gather`` on any device type, a device possibly repeated
(``["cpu", "cpu"]``); every result is a new tensor sharing no memory with the inputs. ``functions.py`` wraps them
into differentiable pairs.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .._core.devices import DeviceLike, usable_device, usable_devices


def _copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    # copy=True: a new tensor even when it is already on `device` (see the module docstring for why)
    return tensor.to(device, copy=True)


def broadcast(tensor: torch.Tensor, devices: Sequence[DeviceLike]) -> list[torch.Tensor]:
    """One copy of ``tensor`` on each of ``devices``."""
    return [_copy_to(tensor, d) for d in usable_devices(devices, "devices")]


def reduce_add(tensors: Sequence[torch.Tensor], destination: DeviceLike) -> torch.Tensor:
    """The sum of ``tensors`` (same shape, any devices) on ``destination``, added in list order."""
    if not tensors:
        raise ValueError("reduce_add: no tensors given")
    shape = tensors[0].shape
    for i, t in enumerate(tensors):
        if t.shape != shape:
            raise ValueError(f"reduce_add: tensors[{i}] has shape {tuple(t.shape)}, tensors[0] has {tuple(shape)}")
    dest = usable_device(destination, "destination")
    out = _copy_to(tensors[0], dest)
    for t in tensors[1:]:
        out.add_(t.to(dest))
    return out


def scatter(
    tensor: torch.Tensor, devices: Sequence[DeviceLike], chunk_sizes: Sequence[int], dim: int = 0
) -> list[torch.Tensor]:
    """Split ``tensor`` along ``dim`` into ``chunk_sizes`` (which must sum to its size) and copy chunk i to device i."""
    devs = usable_devices(devices, "devices")
    if len(chunk_sizes) != len(devs):
        raise ValueError(f"scatter: {len(chunk_sizes)} chunk_sizes for {len(devs)} devices")
    if sum(chunk_sizes) != tensor.size(dim):
        raise ValueError(
            f"scatter: chunk_sizes {list(chunk_sizes)} sum to {sum(chunk_sizes)}, "
            f"but the tensor has {tensor.size(dim)} along dim {dim}"
        )
    return [_copy_to(c, d) for c, d in zip(tensor.split(list(chunk_sizes), dim), devs)]


def gather(tensors: Sequence[torch.Tensor], destination: DeviceLike, dim: int = 0) -> torch.Tensor:
    """Concatenate ``tensors`` along ``dim`` on ``destination``."""
    if not tensors:
        raise ValueError("gather: no tensors given")
    dest = usable_device(destination, "destination")
    return torch.cat([t.to(dest) for t in tensors], dim)
