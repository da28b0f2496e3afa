"""The autograd Functions of SyncBatchNorm in training: normalising with the whole batch's statistics, and the exact
gradient of that, whose one collective sums each part's ``sum(dy)`` and ``sum(dy * xhat)``.

``SyncNormalize``: one node per part (a rank, or a replica whose backward runs in its own thread). ``BatchStats`` +
``Normalize``: replicas whose backward autograd runs one after another on one thread, the statistics one node joining
their graphs. The gradient formulas: docs/syncbn.md, "Design notes".
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd import Function

from .moments import Moments, stats_dtype, wide_dtype

__all__ = ["StatsPlan", "Normalize", "BatchStats", "SyncNormalize"]


@dataclass
class StatsPlan:
    """What the Functions need besides tensors: the whole batch's moments and ``eps``, and ``reduce``, which sums
    the backward's packed vector (2C, float64) of this node's parts with every other part's."""

    moments: Moments
    eps: float
    reduce: Callable[[torch.Tensor], torch.Tensor]


def _channels(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.view([1, -1] + [1] * (x.dim() - 2))


def _part_sums(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, weight: torch.Tensor | None,
               eps: float, need_dx: bool) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(w * invstd * dy if need_dx, sum(dy * xhat), sum(dy))`` over this part, by torch's kernel."""
    if x.numel() == 0:  # the kernel divides by the element count: an empty part contributes nothing
        zeros = var.new_zeros(var.shape)
        return (torch.zeros_like(x) if need_dx else None), zeros, zeros
    # evaluation mode (train=False) on the given statistics. CUDA's kernel wants every optional tensor defined
    # (on an H100 it asserted on None saved statistics, then failed on a None weight): the saved statistics are
    # empty (it then takes the given ones) and a missing weight is ones (the same dx, the same sums)
    saved = mean.new_empty(0)
    if weight is None:
        weight = torch.ones(x.shape[1], dtype=mean.dtype, device=x.device)
    return torch.ops.aten.native_batch_norm_backward(dy, x, weight, mean, var, saved, saved, False, eps,
                                                     [need_dx, True, True])


def _affine_grads(gw: torch.Tensor, gb: torch.Tensor, weight: torch.Tensor | None, need_w: bool,
                  need_b: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    # weight and bias exist together, or the bias alone is absent (bias=False): both take the weight's dtype
    if (need_w or need_b) and gw.dtype != weight.dtype:
        gw, gb = gw.to(weight.dtype), gb.to(weight.dtype)
    return (gw if need_w else None), (gb if need_b else None)


class Normalize(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, plan: StatsPlan) -> torch.Tensor:
        ctx.plan = plan
        ctx.save_for_backward(x, mean, var, weight)
        return F.batch_norm(x, mean, var, weight, bias, False, 0.0, plan.eps)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, mean, var, weight = ctx.saved_tensors
        need_x, need_mean, need_var, need_w, need_b = ctx.needs_input_grad[:5]
        eps = ctx.plan.eps
        dx, gw, gb = _part_sums(dy, x, mean, var, weight, eps, need_x)
        dmean = dvar = None
        if need_mean or need_var:
            wide = wide_dtype(var.device)
            invstd = (var.to(wide) + eps).rsqrt()
            scale = invstd if weight is None else invstd * weight.to(wide)
            dmean = (-scale * gb.to(wide)).to(mean.dtype)
            dvar = (scale * invstd * gw.to(wide) * -0.5).to(var.dtype)
        return (dx, dmean, dvar, *_affine_grads(gw, gb, weight, need_w, need_b), None)


class BatchStats(Function):
    @staticmethod
    def forward(ctx: Any, plan: StatsPlan, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        m = plan.moments
        outs: list[torch.Tensor] = []
        for x in xs:
            dtype = stats_dtype(x)
            outs += [m.mean.to(x.device, dtype), m.var.to(x.device, dtype)]
        ctx.plan = plan
        ctx.save_for_backward(*xs, *outs[0::2])
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = ctx.saved_tensors
        n = len(saved) // 2
        xs, means = saved[:n], saved[n:]
        plan: StatsPlan = ctx.plan
        c, home = means[0].numel(), means[0].device
        packed = torch.cat([torch.stack([g.to(home) for g in grads[0::2]]).sum(0),
                            torch.stack([g.to(home) for g in grads[1::2]]).sum(0)]).to(wide_dtype(home))
        total = plan.reduce(packed)  # the backward's one collective: over the ranks, if any
        count = plan.moments.count
        out: list[torch.Tensor | None] = [None]
        for i, (x, mean) in enumerate(zip(xs, means)):
            if not ctx.needs_input_grad[1 + i]:
                out.append(None)
            elif count == 0 or x.numel() == 0:
                out.append(torch.zeros_like(x))
            else:
                a = (total[:c] / count).to(x.device, mean.dtype)
                b = (total[c:] * (2.0 / count)).to(x.device, mean.dtype)
                out.append((x - _channels(mean, x)).mul_(_channels(b, x)).add_(_channels(a, x)).to(x.dtype))
        return tuple(out)


class SyncNormalize(Normalize):
    """``Normalize``'s forward with constant statistics; backward: the whole gradient, one collective."""

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, mean, var, weight = ctx.saved_tensors
        plan: StatsPlan = ctx.plan
        need_x, _, _, need_w, need_b = ctx.needs_input_grad[:5]
        _, gw, gb = _part_sums(dy, x, mean, var, weight, plan.eps, False)
        dx = None
        if need_x:
            total = plan.reduce(torch.cat((gb, gw)).to(wide_dtype(x.device)))  # the backward's one collective
            dx = torch.zeros_like(x) if x.numel() == 0 else _whole_batch_dx(dy, x, mean, var, weight, total, plan)
        return (dx, None, None, *_affine_grads(gw, gb, weight, need_w, need_b), None)


def _whole_batch_dx(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor,
                    weight: torch.Tensor | None, total: torch.Tensor, plan: StatsPlan) -> torch.Tensor:
    """``dx = a * dy + (x - mean) * k1 + k0`` per channel, with ``a = w * invstd``, ``k0 = -a * sum(dy) / M`` and
    ``k1 = -a * invstd * sum(dy * xhat) / M`` from ``total`` = ``[sum(dy) | sum(dy * xhat)]`` over the whole batch.
    Few operations on the per-channel vectors: in a training step each costs several microseconds, about what a
    pass over a small layer's activations costs."""
    invstd = torch.rsqrt(var + plan.eps)
    a = invstd if weight is None else invstd * weight
    coef = torch.cat((a, a * invstd)).div_(-plan.moments.count)
    k0, k1 = total.to(coef.dtype).mul_(coef).view((2, -1) + (1,) * (x.dim() - 2)).unbind(0)
    # in place after x - mean (not x * k1 - mean * k1, which cancels when |mean| >> std); not addcmul(k0, x - mean,
    # k1): its broadcast first operand takes a slow kernel on CPU (5x one in-place pass)
    dx = (x - mean.view(k0.shape)).mul_(k1).addcmul_(dy, a.view(k0.shape)).add_(k0)
    return dx if dx.dtype == x.dtype else dx.to(x.dtype)
