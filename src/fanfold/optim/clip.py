"""``clip_grad_norm_`` over gradients sharded across ranks (torch's function when nothing is sharded): every p-norm
combines from per-rank partial sums (max for inf, min for -inf), one collective of a scalar on the group's inspected
transport. torch's 0-"norm" counts whole tensors, which slices cannot: refused when sharded.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ..collectives.stall import group_transport
from .zero import ZeroRedundancyOptimizer

__all__ = ["clip_grad_norm_"]


def _partial(norms: list[torch.Tensor], p: float) -> torch.Tensor:
    if not norms:
        return torch.full((), math.inf if p == -math.inf else 0.0, dtype=torch.float64)
    every = torch.stack(norms)
    return every.max() if p == math.inf else every.min() if p == -math.inf else (every ** p).sum()


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None, *, process_group: Any = None) -> torch.Tensor:
    """Clip gradients to a total ``norm_type``-norm of at most ``max_norm``; return the total norm (before clipping).

    ``parameters`` is what ``torch.nn.utils.clip_grad_norm_`` takes (and then this *is* torch's function), or a
    :class:`ZeroRedundancyOptimizer`: the norm is then taken over the whole model from each rank's slice of the
    (averaged) gradients, and only this rank's slice is scaled, which is all its step reads. With ``process_group``
    the given tensors' gradients are this rank's disjoint shard of the model's. Sharded calls are collectives.
    """
    if isinstance(parameters, ZeroRedundancyOptimizer):  # its 1-D views, each holding its slice's gradient
        held, group, world = parameters._shard_grads(), parameters.process_group, parameters.world_size
    elif process_group is not None:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        held, group = [p for p in params if p.grad is not None], process_group
        world = dist.get_world_size(group)
    else:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    p = float(norm_type)
    if p == 0:
        raise ValueError("clip_grad_norm_: norm_type=0 is not supported over sharded gradients (torch's 0-norm counts "
                         "whole tensors with a non-zero gradient, which a rank holding slices cannot count)")
    # Per-rank partial sums travel in float64 so that every rank sends the same dtype whatever its shard holds.
    grads = [t.grad for t in held]
    norms = [torch.linalg.vector_norm(g, p).to(torch.float64).cpu() for g in grads]
    total = _partial(norms, p)
    if world > 1:
        transport = group_transport(group, "clip_grad_norm_")
        total = total.to(grads[0].device if grads else total.device).reshape(1)
        if p in (math.inf, -math.inf):  # the transport sums: the extreme of every rank's partial, gathered
            every = total.new_empty(world)
            transport.all_gather(total, every).wait()
            total = every.max() if p == math.inf else every.min()
        else:
            transport.all_reduce(total).wait()
            total = total[0]
    if p not in (math.inf, -math.inf):
        total = total ** (1.0 / p)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is {total.item()} "
                           f"(non-finite); pass error_if_nonfinite=False to clip anyway")
    torch.nn.utils.clip_grads_with_norm_(held, max_norm, total, foreach)
    return total.to(grads[0].dtype) if grads else total
