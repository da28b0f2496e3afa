"""Bytes into a uint8 tensor and back, without numpy.

torch's ``Tensor.numpy()`` (and so ``tobytes()`` on it) raises "Numpy is not available" where numpy is not installed,
and fanfold declares torch and tqdm only: every byte copy between Python and a tensor goes through these two.
"""
from __future__ import annotations

import torch


def bytes_to_tensor(data: bytes | bytearray | memoryview) -> torch.Tensor:
    """A 1-D uint8 CPU tensor holding a copy of ``data`` (a copy: ``torch.frombuffer`` wants a writable buffer)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)


def tensor_to_bytes(tensor: torch.Tensor) -> bytearray:
    """The bytes of a uint8 ``tensor`` on any device, copied into a new ``bytearray``."""
    if tensor.dtype != torch.uint8:
        raise TypeError(f"tensor_to_bytes needs a uint8 tensor, got {tensor.dtype}")
    out = bytearray(tensor.numel())
    if out:  # torch.frombuffer refuses an empty buffer
        torch.frombuffer(out, dtype=torch.uint8).copy_(tensor.reshape(-1))
    return out
