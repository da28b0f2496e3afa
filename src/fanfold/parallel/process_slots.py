"""Fixed shared-memory slots for the process engine: a step's tensors cross between the caller and a worker unpickled.

Each direction of each worker owns one shared byte buffer (``Arena``) and sends small ``Slot`` headers (offset,
shape, dtype, strides); parameter gradients get slots of their own, laid out once (``layout``). Tensors that are not
plain dense CPU tensors stay in the message and are pickled.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._core.shm import shared_bytes

ALIGN = 64  # bytes: every slot starts on a cache line, so any dtype's view of the byte buffer is aligned


@dataclass(frozen=True)
class Slot:
    """Where one dense tensor lies in a byte buffer; ``stride`` keeps its memory format (channels_last, say)."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]


def dense_stride(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides where they describe a dense layout in some order of the dims (contiguous, channels_last, a
    transpose): the layout the receiver gets, as ``torch.empty_like`` keeps it; else the contiguous strides."""
    if t.is_contiguous():  # the common case, first: this runs for every tensor of every message
        return tuple(t.stride())
    order = sorted((i for i in range(t.dim()) if t.shape[i] != 1), key=lambda i: t.stride(i))
    expected = 1
    for i in order:  # dense: the strides, smallest first, are the running products of the sizes
        if t.stride(i) != expected:
            return _contiguous(t.shape)
        expected *= t.shape[i]
    return tuple(t.stride())  # size-1 dims' strides read nothing else, whatever they are


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _plain(value: Any) -> bool:
    return (type(value) is torch.Tensor and value.layout == torch.strided and value.device.type == "cpu"
            and not value.is_quantized)


def layout(tensors: Sequence[torch.Tensor]) -> tuple[list[Slot], int]:
    """One slot per tensor, packed in order; and the bytes they take in all."""
    slots, size = [], 0
    for t in tensors:
        slots.append(Slot(size, tuple(t.shape), t.dtype, dense_stride(t)))
        size += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return slots, size


def view(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The tensor ``slot`` describes, as a view of ``buffer`` (no copy)."""
    nbytes = math.prod(slot.shape) * slot.dtype.itemsize
    return buffer[slot.offset:slot.offset + nbytes].view(slot.dtype).as_strided(slot.shape, slot.stride)


class Arena:
    """One direction's buffer for one worker; it grows, and must then be sent again, only when a step needs more.
    The slots and their views are kept per structure (the shapes and dtypes of one pack's tensors), so that a loop
    alternating forward and backward messages gets the same ``Slot`` objects each step (``process_mailbox`` sends
    a message whose slots are the last one's in compact form). Every layout starts at offset 0: only one message
    per direction is in flight, and its receiver reads (or copies) it before answering."""

    _KEEP = 8  # layouts kept; more distinct structures than this are laid out again

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._layouts: dict[tuple, tuple[list[Slot], list[torch.Tensor]]] = {}

    def pack(self, leaves: Sequence[Any]) -> tuple[list, torch.Tensor | None]:
        """``leaves`` with each plain tensor copied into the buffer and replaced by its Slot; the new buffer if the
        old one was too small, else None."""
        found = [(k, v) for k, v in enumerate(leaves) if _plain(v)]
        key = tuple((t.shape, t.dtype, dense_stride(t)) for _, t in found)
        grown = None
        known = self._layouts.get(key)
        if known is None:
            slots, size = layout([t for _, t in found])
            if size > self.buffer.numel():
                self.buffer = grown = shared_bytes(max(size, 2 * self.buffer.numel()))
                self._layouts.clear()  # their views are of the old buffer
            if len(self._layouts) >= self._KEEP:
                self._layouts.clear()
            known = self._layouts[key] = (slots, [view(self.buffer, slot) for slot in slots])
        packed = list(leaves)
        for (k, t), slot, target in zip(found, *known):
            target.copy_(t.detach() if t.requires_grad else t)
            packed[k] = slot
        return packed, grown


def unpack(buffer: torch.Tensor, leaves: Sequence[Any], copy: bool) -> list:
    """``leaves`` with each Slot read from ``buffer``: a copy where the tensor must outlive the next message."""
    return [(view(buffer, v).clone() if copy else view(buffer, v)) if isinstance(v, Slot) else v for v in leaves]
