"""The two autograd Functions of SyncBatchNorm in training: the whole batch's statistics, and the normalisation.

Layer: ``fanfold.nn``, above ``moments.py``; used by ``syncbn.py``. No communication of their own in forward (the
moments are reduced before), one in backward, through the callable the caller hands them.

``BatchStats.apply(plan, *xs) -> (mean_0, var_0, mean_1, var_1, ...)``: the whole batch's mean and biased variance
(``plan.moments``, already reduced over every part), one pair per part ``xs[i]`` on that part's device. Its inputs
are the parts of the batch this node differentiates: one (a rank; a replica whose backward runs in its own thread)
or all the replicas of a DataParallel forward (one node that joins their graphs, for an engine that runs their
backward one after another). Its backward is the dual of the forward's reduction: the gradients with respect to the
mean and the variance, summed over its outputs and then over every other part by ``plan.reduce`` (an all-reduce over
ranks, a rendezvous of replicas, or nothing), are the whole batch's; each part gets
``dL/dmean / M + dL/dvar * 2 (x - mean) / M`` (M: the whole batch's count).

``Normalize.apply(x, mean, var, weight, bias, eps)``: ``(x - mean) / sqrt(var + eps) * weight + bias`` (torch's
``batch_norm`` with these statistics, in eval mode). Backward: torch's kernel for the direct ``dx`` and the part's
sums of ``dy`` and ``dy * xhat`` (the bias and weight gradients, as torch's SyncBatchNorm leaves them per rank), from
which ``dL/dmean = -weight * invstd * sum(dy)`` and ``dL/dvar = -weight * invstd^2 * sum(dy * xhat) / 2``.

Together: ``dx = weight * invstd * (dy - sum(dy)/M - xhat * sum(dy * xhat)/M)`` with the sums over the whole batch,
the gradient of BatchNorm applied to the whole batch; the backward's one collective carries ``[dL/dmean | dL/dvar]``,
per channel the whole batch's ``sum(dy)`` and ``sum(dy * xhat)`` scaled by factors every rank shares.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.autograd import Function

from .moments import Moments, stats_dtype, wide_dtype

__all__ = ["StatsPlan", "BatchStats", "Normalize"]


@dataclass
class StatsPlan:
    """What ``BatchStats`` needs besides tensors: the reduced moments, and how its backward sums the packed
    ``[dL/dmean | dL/dvar]`` (float64, 2C) of its parts with every other part's."""

    moments: Moments
    reduce: Callable[[torch.Tensor], torch.Tensor]


def _channel_view(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.view([1, -1] + [1] * (x.dim() - 2))


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
        packed = torch.zeros(2 * c, dtype=plan.moments.mean.dtype, device=home)
        for i in range(n):
            packed[:c] += grads[2 * i].to(home, packed.dtype)
            packed[c:] += grads[2 * i + 1].to(home, packed.dtype)
        total = plan.reduce(packed)  # the backward's one collective
        count = plan.moments.count
        out: list[torch.Tensor | None] = [None]
        for i, (x, mean) in enumerate(zip(xs, means)):
            if not ctx.needs_input_grad[1 + i]:
                out.append(None)
                continue
            if count == 0 or x.numel() == 0:
                out.append(torch.zeros_like(x))
                continue
            a = (total[:c] / count).to(x.device, mean.dtype)
            b = (total[c:] * (2.0 / count)).to(x.device, mean.dtype)
            dx = (x - _channel_view(mean, x)).mul_(_channel_view(b, x)).add_(_channel_view(a, x))
            out.append(dx.to(x.dtype))
        return tuple(out)


class Normalize(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, eps: float) -> torch.Tensor:
        ctx.eps = eps
        ctx.save_for_backward(x, mean, var, weight)
        return F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, mean, var, weight = ctx.saved_tensors
        need_x, need_mean, need_var, need_w, need_b = ctx.needs_input_grad[:5]
        c = mean.numel()
        if x.numel() == 0:  # torch's kernel divides by the element count: an empty part contributes nothing
            dx = torch.zeros_like(x) if need_x else None
            gw = gb = torch.zeros(c, dtype=var.dtype, device=var.device)
        else:
            sums = need_mean or need_var or need_w or need_b
            dx, gw, gb = torch.ops.aten.native_batch_norm_backward(
                dy, x, weight, mean, var, None, None, False, ctx.eps, [need_x, sums, sums])
        dmean = dvar = None
        if need_mean or need_var:
            wide = wide_dtype(var.device)
            invstd = (var.to(wide) + ctx.eps).rsqrt()
            scale = invstd if weight is None else invstd * weight.to(wide)
            dmean = (-scale * gb.to(wide)).to(mean.dtype)
            dvar = (scale * invstd * gw.to(wide) * -0.5).to(var.dtype)
        # weight and bias exist together, or the bias alone is absent (bias=False): both take the weight's dtype
        return (dx, dmean, dvar, gw.to(weight.dtype) if need_w else None, gb.to(weight.dtype) if need_b else None,
                None)
