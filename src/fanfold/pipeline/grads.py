"""Data parallelism over pipelines: start every replica of a stage from the same weights (``broadcast_state``) and
average its gradients over the replicas after the schedule (``average_gradients``, one all-reduce per flat bucket of
one dtype and device), both through the group's inspected transport so that a stall names them.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from ..collectives.stall import group_transport

__all__ = ["broadcast_state", "average_gradients"]

_BUCKET_BYTES = 32 * 1024 * 1024


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one (dtype, device), at most ~32 MiB per bucket, so a big model is not copied whole."""
    groups: dict[tuple, list[list[torch.Tensor]]] = {}
    for t in tensors:
        chunks = groups.setdefault((t.dtype, t.device), [[]])
        if chunks[-1] and sum(x.numel() * x.element_size() for x in chunks[-1]) >= _BUCKET_BYTES:
            chunks.append([])
        chunks[-1].append(t)
    return [c for chunks in groups.values() for c in chunks]


def _wire(t: torch.Tensor, group) -> torch.Tensor:
    # gloo reduces CPU tensors only; an accelerator tensor makes the trip through host memory
    return t.cpu() if t.device.type != "cpu" and dist.get_backend(group) == "gloo" else t


@torch.no_grad()
def broadcast_state(tensors: Iterable[torch.Tensor], group) -> None:
    """Copy ``tensors`` (parameters, buffers) from the group's rank 0 to every rank of ``group``, in place."""
    transport = group_transport(group, "Pipeline data parallelism")
    for bucket in _buckets(list(tensors)):
        flat = _wire(torch.cat([t.detach().reshape(-1) for t in bucket]), group)
        transport.broadcast(flat, 0)
        offset = 0
        for t in bucket:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


@torch.no_grad()
def average_gradients(parameters: Iterable[torch.nn.Parameter], group) -> None:
    """Replace each parameter's ``.grad`` by its mean over ``group``; a missing ``.grad`` counts as zeros.

    Every rank issues the same all-reduces whatever its ``.grad`` holds (a rank whose batch did not touch a
    parameter contributes zeros), so the ranks never disagree about the collectives.
    """
    params = [p for p in parameters if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    transport = group_transport(group, "Pipeline data parallelism")
    for bucket in _buckets([p.grad for p in params]):
        flat = _wire(torch.cat([g.reshape(-1) for g in bucket]), group)
        transport.all_reduce(flat, divisor=transport.world_size).wait()
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
