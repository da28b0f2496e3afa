"""The tensors handed to :class:`~.transport.ShmTransport`: checked, and seen as the contiguous 1-d views in a
supported dtype that the engine works on (with the copy back where a view is not possible).

Layer: used by ``transport.py``; imports only ``request`` (the supported dtypes).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .request import DTYPES

__all__ = ["flat_view", "split_into", "exchange_tensors", "exchange_counts", "check_reduce_tensors"]


def flat_view(tensor: torch.Tensor, what: str) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """A contiguous 1-d view of ``tensor`` in a supported dtype, and the copy back when it had to be a copy."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} needs a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"the shm transport works on CPU tensors; {what} got one on {tensor.device}")
    t = torch.view_as_real(tensor) if tensor.is_complex() else tensor
    if t.dtype not in DTYPES:
        raise TypeError(f"{what}: dtype {tensor.dtype} is not supported by the shm transport ({DTYPES})")
    if t.is_contiguous():
        return t.view(-1), None
    flat = t.contiguous().view(-1)
    return flat, lambda: t.copy_(flat.view_as(t))


def split_into(flat: torch.Tensor, outs: list[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` into ``outs``, in order."""
    offset = 0
    for out in outs:
        out.copy_(flat[offset: offset + out.numel()])
        offset += out.numel()


def exchange_tensors(what: str, tensor: torch.Tensor, out: torch.Tensor, times: int = 1, per: int = 1
                     ) -> tuple[torch.Tensor, torch.Tensor, Callable[[], None] | None]:
    """The flat input and output of all_gather, reduce_scatter or all_to_all, and what to run once the engine has
    written the output (the copy back into a non-contiguous ``out``); ``out`` must hold ``times`` / ``per`` times
    the input's elements."""
    flat, _ = flat_view(tensor, f"{what} (input)")  # the engine only reads the input: a copy is all it needs
    out_flat, back = flat_view(out, f"{what} (output)")
    if out.dtype != tensor.dtype:
        raise TypeError(f"{what}: the output's dtype {out.dtype} differs from the input's {tensor.dtype}")
    if tensor.numel() % per or out.numel() * per != tensor.numel() * times:
        raise ValueError(f"{what}: an input of {tensor.numel()} elements needs an output of {times}/{per} as many, "
                         f"got {out.numel()}")
    return flat, out_flat, back


def exchange_counts(tensor: torch.Tensor, out: torch.Tensor, send: list[int], recv: list[int], n: int) -> tuple:
    """all_to_all's flat input and output, the copy back (or None) and the element counts (sent to each rank,
    received from each rank) in the flat views' elements."""
    for name, counts in (("send", send), ("recv", recv)):
        if len(counts) != n or any(not isinstance(k, int) or k < 0 for k in counts):
            raise ValueError(f"all_to_all: {name} must be {n} non-negative element counts, got {counts!r}")
    flat, _ = flat_view(tensor, "all_to_all (input)")
    out_flat, back = flat_view(out, "all_to_all (output)")
    if out.dtype != tensor.dtype:
        raise TypeError(f"all_to_all: the output's dtype {out.dtype} differs from the input's {tensor.dtype}")
    for name, counts, t in (("send", send, tensor), ("recv", recv, out)):
        if sum(counts) != t.numel():
            raise ValueError(f"all_to_all: {name} counts {counts} add up to {sum(counts)}, not the {t.numel()} "
                             f"elements of the {'input' if t is tensor else 'output'}")
    scale = flat.numel() // tensor.numel() if tensor.numel() else 1  # complex: pairs of reals
    return flat, out_flat, back, (tuple(k * scale for k in send), tuple(k * scale for k in recv))


def check_reduce_tensors(tensors: list[torch.Tensor], compress: torch.dtype | None, what: str = "reduce_tensors"
                         ) -> list[torch.Tensor]:
    """``ShmTransport.reduce_tensors``' (or ``what``'s) tensors, checked: contiguous real CPU tensors of one dtype,
    not overlapping; ``compress`` only to bfloat16 or float16, of float32 tensors."""
    tensors = list(tensors)
    for k, t in enumerate(tensors):
        flat_view(t, f"{what} (tensor {k})")
        if not t.is_contiguous() or t.dtype != tensors[0].dtype or t.is_complex():
            raise ValueError(f"{what}: tensor {k} must be a contiguous real tensor of "
                             f"{tensors[0].dtype}, like tensor 0; got {t.dtype}, contiguous={t.is_contiguous()}")
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), k)
                   for k, t in enumerate(tensors) if t.numel())
    for (_, end, j), (start, _, k) in zip(spans, spans[1:]):
        if start < end:  # summed in place shard by shard: two names for one memory would corrupt both
            raise ValueError(f"{what}: tensors {min(j, k)} and {max(j, k)} overlap in memory")
    if compress is not None and (compress not in (torch.bfloat16, torch.float16) or
                                 any(t.dtype != torch.float32 for t in tensors)):
        raise ValueError(f"{what}: compress must be torch.bfloat16 or torch.float16, for float32 tensors; "
                         f"got {compress} for {tensors[0].dtype if tensors else 'no'} tensors")
    return tensors
